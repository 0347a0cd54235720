"""Region identity (Note [Region identity]): the key a call site is matched by, and the guards on what a
body read.  The words ``efx.explain`` and ``efx.compile`` use for them are ``effectfx.regions.words``.

A body is found in two steps.  The *key* (:func:`call_key`) is what every call shows without running
anything: ambient state (grad mode, autocast), the argument structure, tensor metadata, non-string values
and the structure of modules passed in (classes and tensor metadata, not attributes).  The *guards* are
what the body's trace read (``effectfx.regions.reads``): ``path -> expectation`` for attributes of the
modules and objects reached from the arguments at any depth, closure cells and named globals.  A call
site reuses the first body with its key whose guards hold on its own arguments.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..graph.traced import TensorMeta
from .hooks import GLOBAL, HOOKS, global_hook_key, global_tables, has_hooks, hook_key, hooks_of, tables
from .label import Label, raw
from .reads import (
    MISSING,
    Ref,
    active_reads,
    class_of,
    expectation,
    freeze,
    plain_value,
    report_read,
    satisfies,
)

AUTOCAST_DEVICES = ("cpu", "cuda")


def ambient() -> tuple:
    """Grad mode and autocast (enabled, dtype) per device type: state that changes every op's meaning."""
    return (torch.is_grad_enabled(), *[
        (torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None) for d in AUTOCAST_DEVICES])


class ambient_context:  # noqa: N801  (used like torch.no_grad)
    """Re-enter the grad mode and autocast state of when it was made: a body retraced from a backward
    (Note [Partial backward]) is traced as its forward call was."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in AUTOCAST_DEVICES if d == "cpu" or torch.is_autocast_enabled(d)]

    def __enter__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(torch.set_grad_enabled(self.grad))
        for device, enabled, dtype in self.autocast:
            self.stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


def module_tensors(module: torch.nn.Module, subs: list[tuple[str, torch.nn.Module]] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a module holds, by name: parameters, buffers, and plain tensor attributes (a mask
    stored as ``self.mask = ...``), which differ between instances just as parameters do.  ``subs`` is
    ``module.named_modules()`` when the caller walked it already."""
    seen: set[int] = set()
    for prefix, sub in module.named_modules() if subs is None else subs:
        for table in (sub._parameters, sub._buffers, vars(sub)):
            for k, v in table.items():
                if isinstance(v, torch.Tensor) and not k.startswith("_") and id(v) not in seen:
                    seen.add(id(v))
                    yield (f"{prefix}.{k}" if prefix else k), v


class ModuleWalk:
    """One walk of a module a region is called with: its submodules, and its tensors by name (the
    call site's operands).  A call site walks each module once, for its key and its operands."""

    __slots__ = ("subs", "tensors")

    def __init__(self, module: torch.nn.Module) -> None:
        self.subs = list(module.named_modules())
        self.tensors = dict(module_tensors(module, self.subs))

    def structure(self) -> tuple:
        """A module as a body's key holds it: classes, tensor metadata by name and the hooks of every
        submodule (``regions.hooks``, with torch's global ones); attributes are guards."""
        hooks = tuple((prefix, hook_key(sub, True)) for prefix, sub in self.subs if has_hooks(sub))
        global_hooks = global_hook_key(True)
        return (tuple((prefix, class_of(sub)) for prefix, sub in self.subs),
                tuple((name, TensorMeta.of(t)) for name, t in self.tensors.items()),
                (hooks, global_hooks) if hooks or global_hooks else ())


def leaf_key(value: Any, labels: bool = True, walk: ModuleWalk | None = None) -> Any:
    """How a key holds one argument.  Strings are keyed by type only when ``labels`` (region calls): a
    body decides by its guards whether it uses their value or takes them as operands."""
    if isinstance(value, torch.Tensor):
        return TensorMeta.of(value)
    if isinstance(value, torch.nn.Module):
        return ("module", (walk or ModuleWalk(value)).structure())
    if isinstance(value, str) and labels:
        return ("str",)
    value = raw(value)
    if plain_value(value):
        return (type(value), value)
    frozen = freeze(value)
    if frozen is not MISSING:
        return ("frozen", frozen)
    return ("object", Ref(value))


def call_key(leaves: Sequence[Any], spec: Any, labels: bool = True,
             walks: dict[int, ModuleWalk] | None = None) -> tuple:
    """``walks``: the call site's walk of each module argument, by leaf position."""
    get = (walks or {}).get
    return (ambient(), spec, *[leaf_key(v, labels, get(i)) for i, v in enumerate(leaves)])


def leaf_of_key(key: tuple, i: int) -> Any:
    """What :func:`call_key` holds for leaf ``i`` (a tensor's: its TensorMeta at the call)."""
    return key[2 + i]


def key_labels(names: Sequence[str]) -> tuple[str, ...]:
    """Human names for the parts of :func:`call_key`, in the same order."""
    return ("ambient", "argument structure", *names)


# -- what a body's code names: closures and globals --------------------------------------------------------


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def code_reads(fn: Any) -> Iterator[tuple[Any, Any, Any]]:
    """``(holder, step, value)`` for every closure cell and global ``fn``'s code names (nested functions
    included): Python state the trace may bake in, guarded like attribute reads."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell: a name bound later in the enclosing function
            continue
        if not _code_like(value):
            yield cell, "cell_contents", value
    scope = getattr(fn, "__globals__", {})
    for name in dict.fromkeys(_names(code)):
        value = scope.get(name, MISSING)
        if value is not MISSING and not _code_like(value):
            yield scope, ("item", name), value


def _code_like(value: Any) -> bool:
    # functions, classes and modules: their code is not guarded (a redefinition is not seen)
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
                              types.ModuleType, torch.Tensor)) or (callable(value) and not isinstance(
                                  value, torch.nn.Module) and not hasattr(value, "__dict__"))


# -- guards -------------------------------------------------------------------------------------------------


def step(value: Any, s: Any) -> Any:
    if s == HOOKS:  # a module's hooks (or torch's global ones, from the GLOBAL root): regions.hooks
        found = hooks_of(value)
        return MISSING if found is None else found
    if isinstance(s, tuple):  # ("item", key) of a dict; ("key", Ref(obj)): keyed by an object (a tensor)
        key = s[1].obj if s[0] == "key" else s[1]
        return value.get(key, MISSING) if isinstance(value, dict) else MISSING
    try:
        return getattr(value, s)
    except AttributeError:
        return MISSING


def resolve(path: tuple, leaves: Sequence[Any], reported: dict | None = None) -> Any:
    """The value at ``path`` from a call site's arguments.  Every step is a read its caller depends on
    (the caller's recorders see it: Note [Region identity]), also from an object no trace watches -- a
    module whose call reuses a body.  ``reported``: the reads made so far for one call site (guards share
    their first steps), reported once each."""
    root = path[0]
    value = leaves[root[1]] if root[0] == "leaf" else root[1].obj
    recorded = bool(active_reads())
    for s in path[1:]:
        if value is MISSING:
            return MISSING
        owner, value = value, step(value, s)
        if recorded and not hasattr(type(owner), "__efx_watched__") and not isinstance(owner, torch.Tensor):
            # (a watched object reports its own reads; a tensor's autograd state is its caller's own)
            key = (id(owner), s)
            if reported is not None and key in reported:
                value = reported[key]
            else:
                value = report_read(owner, s, value, watch=False)
                if reported is not None:
                    reported[key] = value
    return value


def guards_hold(guards: tuple, leaves: Sequence[Any]) -> bool:
    reported: dict = {}
    for path, expect in guards:
        value = resolve(path, leaves, reported)
        if isinstance(value, Label) and expect[0] == "=":
            Label.mark_used(value)  # the body depends on the value: so does its caller
        if not satisfies(value, expect):
            return False
    return True


def object_guards(guards: tuple) -> tuple[tuple, tuple, tuple, tuple, tuple]:
    """A compiled program's guards split for its hot path: ``(object, attribute, value)`` for a plain value
    read straight off an object (most of them: ``training``, config fields), checked with one getattr and
    one comparison; ``(object, attributes, object)`` for an object reached through attributes (a layer's
    submodule, every call site's), checked by identity; ``(object, attributes, value)`` for a plain value
    at the end of such a chain (``model.config.use_cache``, a layer's ``attn.scale``); the rest as general
    guards; and the hook guards
    (``regions.hooks``): the hook tables that must stay empty, tested together, and the modules whose
    hooks must stay what they were."""
    fast, same, chains, rest = [], [], [], []
    empty: list[dict] = []
    hooked: list[tuple[Any, tuple]] = []
    for path, expect in guards:
        steps = path[1:]
        if expect[0] == "hooks":
            obj = path[0][1].obj
            if expect[1]:
                hooked.append((obj, expect[1]))
            else:
                empty.extend(global_tables() if obj is GLOBAL else tables(obj))
        elif path[0][0] != "id" or not all(isinstance(s, str) for s in steps):
            rest.append((path, expect))
        elif len(steps) == 1 and expect[0] == "=" and expect[1] in (bool, int, float, str, type(None)):
            fast.append((path[0][1].obj, steps[0], expect[2]))
        elif expect[0] == "is" or (expect[0] == "=" and expect[1] is type(None)):
            same.append((*_first_step(path[0][1].obj, steps[0]), steps[1:],
                         expect[1].obj if expect[0] == "is" else None))
        elif expect[0] == "=" and expect[1] in (bool, int, float, str):
            chains.append((*_first_step(path[0][1].obj, steps[0]), steps[1:], expect[2]))
        else:
            rest.append((path, expect))
    return tuple(fast), tuple(same), tuple(chains), tuple(rest), (tuple(empty), tuple(hooked))


def object_guards_hold(fast: tuple, same: tuple, chains: tuple, rest: tuple, hooks: tuple = ((), ())) -> bool:
    empty, hooked = hooks
    if any(empty) or not all(hooks_of(obj) == expected for obj, expected in hooked):
        return False
    for obj, name, value in fast:
        got = getattr(obj, name, MISSING)
        if got is not value and (type(got) is not type(value) or got != value):
            return False
    for holder, first, steps, value in same:
        obj = holder.get(first, MISSING) if type(holder) is dict else getattr(holder, first, MISSING)
        for name in steps:
            obj = getattr(obj, name, MISSING)
        if obj is not value:
            return False
    for holder, first, steps, value in chains:
        got = holder.get(first, MISSING) if type(holder) is dict else getattr(holder, first, MISSING)
        for name in steps:
            got = getattr(got, name, MISSING)
        if got is not value and (type(got) is not type(value) or got != value):
            return False
    return guards_hold(rest, ())


def _first_step(obj: Any, name: str) -> tuple[Any, str]:
    """Where a guard's first read looks: a submodule straight in its module's ``_modules`` (what
    ``nn.Module.__getattr__`` would find, without its Python-level lookup), else the object itself."""
    if (isinstance(obj, torch.nn.Module) and name in obj._modules and name not in vars(obj)
            and not hasattr(type(obj), name)):
        return obj._modules, name
    return obj, name


def failed_guards(guards: tuple, leaves: Sequence[Any]) -> list[tuple[tuple, tuple, Any]]:
    """``(path, expected, found)`` for each guard that does not hold now."""
    out = []
    for path, expect in guards:
        value = resolve(path, leaves)
        if not satisfies(value, expect):
            out.append((path, expect, value))
    return out


__all__ = ["ambient", "call_key", "code_reads", "expectation", "guards_hold", "failed_guards", "key_labels",
           "leaf_key"]
