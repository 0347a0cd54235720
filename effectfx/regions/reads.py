"""What a trace reads from Python objects: the facts region identity guards on (Note [Region identity]).

During a capture, every object a trace reaches through attributes -- the modules passed to regions, their
submodules, config objects hanging off them, objects held in closures and globals -- is *watched*: its
class is swapped, for the capture only and on the capturing thread only, for a subclass whose attribute
lookups report ``(object, name, value)`` to every active :class:`Reads`.  A read of a ``str`` inside a
region body hands the body a :class:`Label` instead, a ``str`` that notices when its value is looked at
(compared, hashed, formatted, sliced...).  A label that is only ever passed to effectful ops becomes an
operand of the body (``effectfx.regions.labels``); any other use specializes the body on its value.
"""

from __future__ import annotations

import enum
import functools
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .label import Label

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "<missing>"})()

_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
# functions compared by identity inside a frozen value: their code is the same object
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, torch._ops.OpOverload,
              torch._ops.OpOverloadPacket)

# nn.Module's own bookkeeping: read on every call, never part of what a layer computes
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}

_LOCAL = threading.local()


def active_reads() -> list[Reads]:
    """The recorders of this thread, outermost first (the root's, then one per region body being traced)."""
    return getattr(_LOCAL, "stack", None) or []


@contextmanager
def recording(reads: Reads) -> Iterator[Reads]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    stack.append(reads)
    try:
        yield reads
    finally:
        stack.pop()


class Ref(int):
    """A path root that is one particular object: equal and hashed by identity (as the int ``id(obj)``,
    so in C: guards hold thousands of these), holding the object alive.  Paths never hold a plain int
    where a Ref stands."""

    obj: Any

    def __new__(cls, obj: Any) -> Ref:
        ref = super().__new__(cls, id(obj))
        ref.obj = obj
        return ref

    def __repr__(self) -> str:
        return f"<{type(self.obj).__name__}>"

    def __copy__(self) -> Ref:
        return self

    def __deepcopy__(self, memo: dict) -> Ref:  # a copy refers to the very object
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a guard's reference to a live object cannot be pickled")


def plain_value(value: Any) -> bool:
    """Hashable plain data (numbers, strings, dtypes, enums...): values a trace can bake in."""
    if isinstance(value, tuple):
        return all(plain_value(v) for v in value)
    return isinstance(value, _PLAIN)


def freeze(value: Any, depth: int = 0) -> Any:
    """A hashable snapshot of plain data in lists, dicts and sets, or MISSING if it holds anything else."""
    if plain_value(value):
        return str.__str__(value) if isinstance(value, Label) else value
    if depth > 4:
        return MISSING
    if isinstance(value, (list, tuple)):
        items = tuple(freeze(v, depth + 1) for v in value)
    elif isinstance(value, dict):
        items = tuple((freeze(k, depth + 1), freeze(v, depth + 1)) for k, v in value.items())
    elif isinstance(value, (set, frozenset)):
        items = tuple(sorted((freeze(v, depth + 1) for v in value), key=repr))
    elif type(value) is types.SimpleNamespace:  # a config object: its attributes are all it is
        items = tuple((k, freeze(v, depth + 1)) for k, v in vars(value).items())
    elif type(value) is functools.partial and isinstance(value.func, _FUNCTIONS):
        # an activation such as ``partial(F.gelu, approximate="tanh")``, one per layer: equal when it
        # calls the same function with equal arguments
        items = (value.func, freeze(value.args, depth + 1), freeze(value.keywords, depth + 1),
                 freeze(vars(value), depth + 1))
    else:
        return MISSING
    if MISSING in items or any(isinstance(i, tuple) and MISSING in i for i in items):
        return MISSING
    return (type(value).__name__, items)


def expectation(value: Any, structural: bool) -> tuple:
    """What a guard expects of a value read: its value for plain data, its class (``structural``, for
    region bodies, whose call sites hold other instances) or identity (compiled programs) otherwise."""
    if value is MISSING:
        return ("missing",)
    if isinstance(value, Label):
        return ("=", str, str.__str__(value))
    if plain_value(value):
        return ("=", type(value), value)
    frozen = freeze(value)
    if frozen is not MISSING:
        return ("=", type(value), frozen)
    if structural and (isinstance(value, torch.nn.Module) or watchable(value)):
        return ("type", class_of(value))
    if not watchable(value) and not isinstance(value, torch.nn.Module) and hasattr(value, "__dict__"):
        state = freeze(vars(value))  # its reads cannot be seen: guard on all its plain state
        if state is not MISSING:
            return ("state", Ref(value), state)
    return ("is", Ref(value))


def satisfies(value: Any, expect: tuple) -> bool:
    kind = expect[0]
    if kind == "=":
        if type(value) is not expect[1] and not (expect[1] is str and isinstance(value, str)):
            return False
        got = str.__str__(value) if isinstance(value, Label) else value
        return (got if plain_value(got) else freeze(got)) == expect[2]
    if kind == "str":
        return isinstance(value, str)
    if kind == "type":
        return class_of(value) is expect[1]
    if kind == "is":
        return value is expect[1].obj
    if kind == "state":
        return value is expect[1].obj and freeze(vars(value)) == expect[2]
    if kind == "hooks":  # (value: what regions.hooks reads of a module's hooks)
        return value == expect[1]
    return value is MISSING  # "missing"


def _fresh_each_read(owner: Any, step: Any, value: Any) -> bool:
    """Whether reading attribute ``step`` of ``owner`` again gives another object (read unrecorded)."""
    if not isinstance(step, str):
        return False
    stack = getattr(_LOCAL, "stack", None)
    _LOCAL.stack = []
    try:
        return getattr(owner, step) is not value
    except Exception:  # noqa: BLE001 -- a property that fails the second time: keep the identity guard
        return False
    finally:
        _LOCAL.stack = stack


def class_of(value: Any) -> type:
    """The object's own class, also while it is watched (its class swapped for a recording subclass)."""
    cls = type(value)
    return getattr(cls, "__efx_watched__", cls)


# -- watching objects -------------------------------------------------------------------------------------


def watchable(obj: Any) -> bool:
    """Objects whose attribute reads can be recorded: instances of ordinary Python classes."""
    cls = type(obj)
    if isinstance(obj, (type, torch.Tensor, enum.Enum)) or callable(obj) and not isinstance(
            obj, torch.nn.Module):
        return False
    return bool(cls.__flags__ & (1 << 9)) and hasattr(obj, "__dict__")  # a heap type with a __dict__


_WATCHED_CLASSES: dict[type, type] = {}
_CLASS_LOCK = threading.Lock()


def report_read(obj: Any, name: Any, value: Any, watch: bool = True) -> Any:
    """Tell every active recorder that ``name`` (an attribute, or ``("item", key)``) of ``obj`` was read
    as ``value``; returns what the reader gets (a Label, for a string a body reads).  With ``watch``, the
    object read is watched from now on; a reader that reports each of its reads itself (a guard's path)
    need not pay for that."""
    stack = getattr(_LOCAL, "stack", None)
    if not stack or name[:2] == "__" or (name in _MODULE_INTERNALS and isinstance(obj, torch.nn.Module)):
        return value
    if isinstance(value, torch.Tensor):
        for reads in stack:
            reads.tensor_read(obj, name, value)
        return value  # tensors are lifted operands
    if callable(value) and not isinstance(value, torch.nn.Module) and getattr(value, "__self__", None) is obj:
        return value  # methods come with the (keyed) class
    value = stack[-1].read(obj, name, value, innermost=True, watch=watch)  # first: it may hand out a Label
    for reads in stack[:-1]:
        reads.read(obj, name, value, watch=watch)
    return value


def same_class(cls: type, namespace: dict[str, Any]) -> type:
    """A subclass of ``cls`` with only ``namespace`` of its own, standing in for ``cls`` itself (a recording
    subclass, a compiled module's class): what a base's ``__init_subclass__`` added to it is taken away
    (transformers' checkpointing layers wrap ``forward`` again there), so it inherits everything as it is."""
    sub = type(cls.__name__, (cls,), namespace)
    for name in set(vars(sub)) - set(namespace) - {"__doc__", "__dict__", "__weakref__"}:
        delattr(sub, name)
    return sub


def _watched_class(cls: type) -> type:
    with _CLASS_LOCK:
        sub = _WATCHED_CLASSES.get(cls)
        if sub is not None:
            return sub
        base_getattribute = cls.__getattribute__
        base_getattr = getattr(cls, "__getattr__", None)

        def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
            if name == "__class__":
                return cls
            try:
                value = base_getattribute(self, name)
            except AttributeError:
                if base_getattr is None:
                    report_read(self, name, MISSING)
                raise
            return report_read(self, name, value)

        namespace: dict[str, Any] = {"__getattribute__": __getattribute__, "__efx_watched__": cls,
                                     "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        if base_getattr is not None:
            def __getattr__(self: Any, name: str) -> Any:  # noqa: N807
                try:
                    value = base_getattr(self, name)
                except AttributeError:
                    report_read(self, name, MISSING)
                    raise
                return report_read(self, name, value)

            namespace["__getattr__"] = __getattr__
        if "__slots__" in cls.__dict__:
            namespace["__slots__"] = ()
        sub = _WATCHED_CLASSES[cls] = same_class(cls, namespace)
        return sub


class Watcher:
    """The objects one capture watches; ``restore()`` gives every one its class back."""

    def __init__(self) -> None:
        self.watched: dict[int, tuple[Any, type]] = {}

    def watch(self, obj: Any) -> bool:
        if id(obj) in self.watched:
            return True
        if not watchable(obj) or hasattr(type(obj), "__efx_watched__"):
            return False
        cls = type(obj)
        try:
            obj.__class__ = _watched_class(cls)
        except TypeError:  # an incompatible layout: read by identity instead
            return False
        self.watched[id(obj)] = (obj, cls)
        return True

    def restore(self) -> None:
        for obj, cls in self.watched.values():
            object.__setattr__(obj, "__class__", cls)
        self.watched.clear()


# -- recorders ------------------------------------------------------------------------------------------

Path = tuple  # (root, *steps): root ("leaf", i) or ("id", Ref); a step is an attribute name or ("item", k)


class Reads:
    """The reads of one trace, as guards: ``path -> expectation`` (the first read of a path wins).

    A body's recorder (``structural``) names objects by their path from the body's arguments, so a guard
    can be checked against another call site's arguments; objects it cannot reach from them are named by
    identity.  The root's recorder names everything by identity: a compiled program runs on these very
    objects.
    """

    def __init__(self, watcher: Watcher, structural: bool,
                 on_label: Callable[..., Any] | None = None) -> None:
        self.watcher = watcher
        self.structural = structural
        self.paths: dict[int, Path] = {}
        self.named: list[Any] = []
        self.guards: dict[Path, tuple] = {}
        self.on_label = on_label  # makes a Label for a str the body read (bodies only)
        # id(tensor) -> (object, step) it was first read from (the root's: a compiled program reads it
        # there again at each call, so a replaced tensor attribute is seen)
        self.tensor_sources: dict[int, tuple[Any, Any]] = {}

    def root(self, obj: Any, path: Path) -> None:
        """``obj`` is reachable at ``path`` (an argument of the body); watch what is read from it."""
        self.paths.setdefault(id(obj), path)
        self.watcher.watch(obj)

    def path_of(self, obj: Any) -> Path:
        path = self.paths.get(id(obj))
        return path if path is not None else (("id", Ref(obj)),)

    def read(self, owner: Any, step: Any, value: Any, innermost: bool = False, watch: bool = True) -> Any:
        path = (*self.path_of(owner), step)
        if isinstance(value, Label) and not self.structural:
            self.specialize(path, str.__str__(value))  # the root passes the value itself: guard it
        elif isinstance(value, Label):
            value.watch(self, path)
        elif isinstance(value, str) and innermost and self.on_label is not None and (
                self.guards.get(path, ("str",)) == ("str",)):
            return self.on_label(path, value)
        elif path not in self.guards:
            expect = expectation(value, self.structural)
            if expect[0] in ("is", "state") and _fresh_each_read(owner, step, value):
                # a property that makes a new object per read (transformers' config.per_layer_config): by
                # identity it would fail at every call; its class, and the reads through it, say it all
                expect = ("type", class_of(value))
            self.guards[path] = expect
        if not plain_value(value) and value is not MISSING and (not watch or self.watcher.watch(value)):
            if id(value) not in self.paths:
                self.paths[id(value)] = path
                self.named.append(value)  # its id names it only while it lives
        return value

    def tensor_read(self, owner: Any, step: Any, value: torch.Tensor) -> None:
        if not self.structural:
            self.tensor_sources.setdefault(id(value), (owner, step))

    def specialize(self, path: Path, value: str) -> None:
        self.guards[path] = ("=", str, value)
