"""The guard kinds (Note [Region identity]): what a trace relied on of one value it read, at a path.

A guard is a frozen dataclass: its ``path`` (``values.Path``) and what it expects there.  Equal guards are
equal and hash alike (a body's cache key holds its guards); a :class:`~effectfx.guards.values.Ref` in one
compares by identity.  Each kind says

* ``holds(value)``: whether the value now at its path is what the trace relied on;
* ``describe()``: what ``efx.explain`` and ``efx.compile`` say it expects (``found_text``: what was found);
* ``tree_check(tree)`` / ``python_check(out)``: how a compiled program checks it -- added to the C++ guard
  tree or to the generated code (``effectfx.guards.emit``), True if added; a kind that adds itself to
  neither is interpreted (``holds`` on the value its path reads: ``effectfx.guards.check``).  ``Hooks``
  adds a part to each: what its functions name to the tree (saying False), their tables to the code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from .emit import Tree, Writer
from .hooks import FORWARD, GLOBAL, HOOK_STEPS, HOOKS, TABLES, global_tables, hooks_of, identity_key, tables
from .labels import Label, raw
from .values import MISSING, Path, Ref, class_of, freeze, plain_value, watchable

# classes whose values the tree and the code compare as the interpretation does (the same type, then ==);
# a str only in the tree, on attribute paths (the interpretation also passes a ``str`` subclass)
_SCALARS = (bool, int, float, type(None))
# a module's tables of its parameters, buffers and submodules: a trace that reads one iterates it (nn.Module
# finds a submodule through ``__dict__``), so its guard is the order of its keys (``Keys``)
MODULE_TABLES = ("_parameters", "_buffers", "_modules")


@dataclass(frozen=True, slots=True)
class Guard:
    """What a trace relied on of the value at ``path``."""

    path: Path

    def holds(self, value: Any) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def found_text(self, value: Any) -> str:
        """What the value found is, in the words of :meth:`describe`."""
        return value_text(value)

    def value_type(self) -> str | None:
        """The name of the plain type this guard expects a value of, if it does (``efx.explain``'s hint)."""
        return None

    def tree_check(self, tree: Tree) -> bool:
        return False

    def python_check(self, out: Writer) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Equals(Guard):
    """Plain data: a value of class ``cls`` equal to ``value`` (for containers, their ``values.freeze``);
    any ``str`` for ``cls is str``."""

    cls: type
    value: Any

    def holds(self, value: Any) -> bool:
        if isinstance(value, Label):
            Label.mark_used(value)  # the body depends on the value: so does its caller
            value = str.__str__(value)
        if type(value) is not self.cls and not (self.cls is str and isinstance(value, str)):
            return False
        return value is self.value or (value if plain_value(value) else freeze(value)) == self.value

    def describe(self) -> str:
        if self.cls is functools.partial:  # ("partial", (func, args, keywords, attributes)), frozen
            func, args, keywords, _ = self.value[1]
            words = [repr(a) for a in _items(args)] + [f"{k}={v!r}" for k, v in _items(keywords)]
            return f"partial({getattr(func, '__name__', func)}, {', '.join(words)})"
        return repr(self.value) if plain_value(self.value) else f"{self.cls.__name__} {self.value[1]!r:.60}"

    def value_type(self) -> str:
        return self.cls.__name__

    def _plain_tuple(self) -> bool:  # ``normalized_shape``
        return self.cls is tuple and plain_value(self.value)

    def tree_check(self, tree: Tree) -> bool:
        # (a str on a path of attributes, or to a string a hook closes over: not where a label may be)
        attributes = all(isinstance(step, str) or step[0] in HOOK_STEPS for step in self.path[1:])
        if not (self.cls in _SCALARS or self._plain_tuple() or self.cls is str and attributes):
            return False
        read = tree.read(self.path)
        if read is not None:
            tree.equal(read, self.value)
        return read is not None

    def python_check(self, out: Writer) -> bool:
        if not (self.cls in _SCALARS or self._plain_tuple() or self.cls is str):
            return False
        var = out.read(self.path)
        if var is not None and self.cls is tuple:
            out.fails_if(f"type({var}) is not tuple or {var} != {out.constant(self.value)}")
        elif var is not None and self.cls is str:  # (any str: a label in a capture, raw)
            out.fails_if(f"not isinstance({var}, str) or str.__str__({var}) != {out.constant(self.value)}")
        elif var is not None:
            out.equal(var, self.value)
        return var is not None


@dataclass(frozen=True, slots=True)
class SameObject(Guard):
    """That very object (a submodule, an object whose reads cannot be seen)."""

    ref: Ref

    def holds(self, value: Any) -> bool:
        return value is self.ref.obj

    def describe(self) -> str:
        return f"that {type(self.ref.obj).__name__} object"

    def tree_check(self, tree: Tree) -> bool:
        read = tree.read(self.path)
        if read is not None:
            tree.same(read, self.ref.obj)
        return read is not None

    def python_check(self, out: Writer) -> bool:  # (a path through dicts keyed by objects)
        var = out.read(self.path)
        if var is not None:
            out.same(var, self.ref.obj)
        return var is not None


@dataclass(frozen=True, slots=True)
class OfType(Guard):
    """An object of that class (a region body's module argument: its call sites hold other instances)."""

    cls: type

    def holds(self, value: Any) -> bool:
        return class_of(value) is self.cls

    def describe(self) -> str:
        return f"a {self.cls.__name__}"

    def python_check(self, out: Writer) -> bool:  # (a float input's, a zeroed .grad's: on every call)
        var = out.read(self.path)
        if var is not None:
            out.fails_if(f"{out.helper('_class_of', class_of)}({var}) is not {out.constant(self.cls)}")
        return var is not None


@dataclass(frozen=True, slots=True)
class ObjectState(Guard):
    """That very object, with the same plain state (an object whose reads cannot be seen)."""

    ref: Ref
    state: Any  # freeze(vars(obj))

    def holds(self, value: Any) -> bool:
        return value is self.ref.obj and freeze(vars(value)) == self.state

    def describe(self) -> str:
        return f"that {type(self.ref.obj).__name__} object in that state"

    def python_check(self, out: Writer) -> bool:
        var = out.read(self.path)
        if var is not None:
            out.fails_if(f"not {out.helper('_holds', _holds)}({out.constant(self)}, {var})")
        return var is not None


@dataclass(frozen=True, slots=True)
class IsStr(Guard):
    """Any ``str``: a label a body passes on as an operand (``effectfx.guards.labels``)."""

    def holds(self, value: Any) -> bool:
        return isinstance(value, str)

    def describe(self) -> str:
        return "a str (an operand)"

    def value_type(self) -> str:
        return "str"


@dataclass(frozen=True, slots=True)
class Absent(Guard):
    """No such attribute or item (``getattr(config, "x", None)`` found none)."""

    def holds(self, value: Any) -> bool:
        return value is MISSING

    def describe(self) -> str:
        return "<missing>"

    def python_check(self, out: Writer) -> bool:  # (the tree's read of a missing attribute fails)
        var = out.read(self.path)
        if var is not None:
            out.fails_if(f"{var} is not MISSING")
        return var is not None


@dataclass(frozen=True, slots=True)
class Hooks(Guard):
    """The hooks and instance ``forward`` of a module, or torch's global hooks (``effectfx.guards.hooks``),
    as ``key``: the functions by identity, then what their code names (``hooks.names_of``)."""

    key: tuple

    @classmethod
    def on(cls, obj: Any) -> Hooks:
        """A compiled program's guard on the hooks of ``obj`` (a module, or ``hooks.GLOBAL``)."""
        found = hooks_of(obj)
        assert found is not None
        return cls((("id", Ref(obj)), HOOKS), found)

    def holds(self, value: Any) -> bool:
        return value == self.key

    def describe(self) -> str:
        return hooks_text(self.key)

    def found_text(self, value: Any) -> str:
        if not isinstance(value, tuple):
            return value_text(value)
        text = hooks_text(value)
        if text != hooks_text(self.key) or not value or not self.key:
            return text
        if value[:TABLES] != self.key[:TABLES]:
            return f"{text} (other functions)"
        if value[TABLES] != self.key[TABLES]:
            return f"{text} (another instance forward)"
        was, now = dict(self.key[-1]), dict(value[-1])
        names = {step[1] if isinstance(step, tuple) else "a closed-over value"
                 for (holder, step) in {*was, *now} if was.get((holder, step)) != now.get((holder, step))}
        return f"{text} ({', '.join(sorted(names))} rebound)"

    def tree_check(self, tree: Tree) -> bool:
        """What the functions name, each an identity or equality check in the tree; their tables are code
        (``python_check``), so this adds a part and says False."""
        for (holder, step), value in self.key[-1] if self.key and self.path[0][0] == "id" else ():
            read = tree.read((("id", holder), step))
            assert read is not None  # (a cell's attribute, or a globals item by name: the tree reads both)
            if isinstance(value, Ref):
                tree.same(read, value.obj)
            else:
                tree.equal(read, value[1])
        return False

    def python_check(self, out: Writer) -> bool:
        if self.path[0][0] != "id":
            return False
        obj = self.path[0][1].obj
        if not self.key:  # (most modules: their hook tables, and dicts, tested together)
            out.stay_empty(global_tables() if obj is GLOBAL else tables(obj))
            if obj is not GLOBAL:
                out.lacks(obj.__dict__, FORWARD)
        else:  # the functions by identity; what they name is in the tree (``tree_check``)
            now = f"{out.helper('identity_key', identity_key)}({out.constant(obj)})"
            out.fails_if(f"{now} != {out.constant(self.key[:-1])}")
        return True


@dataclass(frozen=True, slots=True)
class Keys(Guard):
    """A dict with those keys in that order: a module's ``_parameters``, ``_buffers`` or ``_modules`` that
    a trace read (``parameters()``, ``children()``, iterating a ``ModuleList``): the order of what they
    yield."""

    keys: tuple

    def holds(self, value: Any) -> bool:
        return type(value) is dict and tuple(value) == self.keys

    def describe(self) -> str:
        return f"keys {self.keys!r}"

    def found_text(self, value: Any) -> str:
        return f"keys {tuple(value)!r}" if isinstance(value, dict) else value_text(value)

    def tree_check(self, tree: Tree) -> bool:
        read = tree.read(self.path)
        if read is not None:
            tree.keys(read, self.keys)
        return read is not None


def guard_on(path: Path, value: Any, structural: bool) -> Guard:
    """The guard on a value read at ``path``: its value for plain data, its class (``structural``, for
    region bodies, whose call sites hold other instances) or identity (compiled programs) otherwise."""
    if value is MISSING:
        return Absent(path)
    if path[-1] in MODULE_TABLES and type(value) is dict:
        return Keys(path, tuple(value))
    if isinstance(path[-1], tuple) and path[-1][0] == "hook":  # a hook, read for a label it closes over:
        # which function it is, the key (a body's) or the module's Hooks guard (a program's) says already
        return OfType(path, class_of(value)) if structural else SameObject(path, Ref(value))
    if isinstance(value, Label):
        return Equals(path, str, str.__str__(value))
    if plain_value(value):
        return Equals(path, type(value), value)
    frozen = freeze(value)
    if frozen is not MISSING:
        return Equals(path, type(value), frozen)
    if structural and (isinstance(value, torch.nn.Module) or watchable(value)):
        return OfType(path, class_of(value))
    if not watchable(value) and not isinstance(value, torch.nn.Module) and hasattr(value, "__dict__"):
        state = freeze(vars(value))  # its reads cannot be seen: guard on all its plain state
        if state is not MISSING:
            return ObjectState(path, Ref(value), state)
    return SameObject(path, Ref(value))


def _holds(guard: Guard, value: Any) -> bool:
    return guard.holds(value)


def value_text(value: Any) -> str:
    if value is MISSING:
        return "<missing>"
    value = raw(value)
    return repr(value) if plain_value(value) else f"a {type(value).__name__}"


def _items(frozen: Any) -> tuple:
    """The items of a list, tuple or dict as ``values.freeze`` holds it (a tuple of plain values as is)."""
    if type(frozen) is tuple and len(frozen) == 2 and frozen[0] in ("tuple", "list", "dict"):
        return frozen[1]
    return frozen


def hooks_text(key: tuple) -> str:
    """How many hooks a hook key (``guards.hooks``) holds, and whether an instance forward, in words."""
    n = sum(len(table) for table in key[:TABLES]) if key else 0
    forward = ", an instance forward" if len(key) > TABLES and key[TABLES] is not None else ""
    return f"{n} hook{'s' if n != 1 else ''}{forward}"
