"""Module hooks in region identity (Note [Region identity]): a module's forward, pre-forward and backward
hooks are part of what calling it does, so they are part of what a body is for and of what a compiled
program relies on.  So is an *instance* ``forward``: one assigned on the object
(``mod.forward = types.MethodType(f, mod)``), which ``nn.Module``'s call runs instead of its class's.

A *hook key* describes the hooks of one module (or torch's global ones), in the order ``nn.Module`` calls
them, then its instance ``forward`` (None: its class's).  In a body's key (``ModuleWalk.structure``,
structural) a function is its code, the values it closes over and the globals it names -- plain data by
value, anything else by identity -- so the layers of a stack whose hooks come from one ``lambda`` with equal
values share a body; a method bound to the module itself is its function (each layer's
``types.MethodType(f, layer)`` is one).  A forward hook's strings are keyed by type only: the body takes
them as labels (:func:`hook_labels`), so a hook logging its layer's name is one body for every layer while
it only passes the name to effect ops.  In a compiled program's guards
(by identity, :func:`hooks_of`) a hook is the function object itself, and so is what its code names
(:func:`names_of`): the closure cells and globals it reads, functions too -- a hook calling a global
``hook_fn`` calls whichever is bound now.  Registering or removing a hook on any module the program may run,
or a global one, assigning or deleting an instance ``forward``, or rebinding what their code names,
captures anew; undoing it serves the first program again.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.modules.module as torch_module

from .labels import raw
from .values import MISSING, Ref, plain_value

# the hook tables nn.Module's call reads
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")
_GLOBAL_FLAGS = ("_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")
GLOBAL = torch_module  # the path root of a guard on the global hooks
HOOKS = ("hooks",)  # the path step of a guard on hooks (effectfx.guards.check.step)
FORWARD = "forward"  # an instance attribute of that name is what nn.Module's call runs
TABLES = 4  # a hook key: its hook tables, then the instance forward (then, in a guard's, what they name)
# the hooks a body's trace runs itself, on its thread: the strings they close over are labels (operands)
LABELLED = ("_forward_pre_hooks", "_forward_hooks")


def _value(v: Any) -> Any:
    return v if plain_value(v) else Ref(v)


def _slot(v: Any, labels: bool) -> Any:
    # (``isinstance``, not a hash: a label in a cell while a body is traced would count it as used)
    return ("str",) if labels and isinstance(v, str) else _value(v)


def _hook(fn: Any, structural: bool, labels: bool = False) -> Any:
    """One hook as a key holds it: the function itself (by identity), or, ``structural``, its code, the
    values it closes over and the globals it names; with ``labels`` (a forward hook), the strings it closes
    over by type only: the body takes them as operands while only effects use them (:func:`hook_labels`)."""
    if not structural:
        return Ref(fn)
    if type(fn) is types.FunctionType:
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(_slot(cell.cell_contents, labels))
            except ValueError:  # an empty cell
                cells.append(None)
        scope = fn.__globals__  # (the globals it names too: a body's effects are known by its key)
        named = tuple((name, _value(scope[name])) for name in dict.fromkeys(_names(fn.__code__))
                      if name in scope and not isinstance(scope[name], types.ModuleType))
        kwdefaults = tuple((k, _slot(v, labels)) for k, v in (fn.__kwdefaults__ or {}).items())
        return (Ref(fn.__code__), tuple(_slot(v, labels) for v in fn.__defaults__ or ()), kwdefaults,
                tuple(cells), named)
    return Ref(fn)  # a bound method, a partial, a callable object: by identity


def _forward(module: torch.nn.Module, structural: bool) -> Any:
    """The instance ``forward`` of ``module`` as a key holds it; None when it has none.  A method is its
    function and the object it is bound to (the module itself: ``"self"``, structurally), so binding the
    same function anew (``types.MethodType(f, mod)`` again) is the same forward."""
    d = module.__dict__
    if FORWARD not in d:
        return None
    fn = d[FORWARD]
    region = getattr(fn, "__effectfx_region__", None) if structural else None
    if region is not None:  # ``layer.forward = efx.region(layer.forward)``: one wrapper per layer
        return ("region", Ref(region.fn), "self" if region.bound is module else _value(region.bound))
    if type(fn) is types.MethodType:
        bound = fn.__self__
        to = "self" if structural and bound is module else Ref(bound)
        return ("method", _hook(fn.__func__, structural), to)
    return ("function", _hook(fn, structural))


def _table(hooks: dict, flags: tuple[dict, ...], structural: bool, labels: bool = False) -> tuple:
    return tuple((_hook(fn, structural, labels), *(hook_id in f for f in flags))
                 for hook_id, fn in hooks.items())


def has_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has hooks or an instance ``forward``: calling it does more than its class says."""
    d = module.__dict__  # (not an attribute read a trace records: nn.Module's bookkeeping)
    return bool(d.get("_forward_pre_hooks") or d.get("_forward_hooks") or d.get("_backward_pre_hooks")
                or d.get("_backward_hooks") or FORWARD in d)


def hook_key(module: torch.nn.Module, structural: bool) -> tuple:
    """The hooks and instance ``forward`` of ``module`` (``()`` when it has neither), as a key or guard
    holds them."""
    if not has_hooks(module):
        return ()
    d = module.__dict__
    pre_flags = (d.get("_forward_pre_hooks_with_kwargs", {}),)
    flags = (d.get("_forward_hooks_with_kwargs", {}), d.get("_forward_hooks_always_called", {}))
    return (_table(d.get("_forward_pre_hooks", {}), pre_flags, structural, labels=True),
            _table(d.get("_forward_hooks", {}), flags, structural, labels=True),
            _table(d.get("_backward_pre_hooks", {}), (), structural),
            _table(d.get("_backward_hooks", {}), (), structural),
            _forward(module, structural))


def global_hook_key(structural: bool) -> tuple:
    """torch's global module hooks (``register_module_forward_hook`` and its family), as :func:`hook_key`."""
    g = torch_module.__dict__
    if not any(g[name] for name in _GLOBAL_DICTS):
        return ()
    flags = tuple(g[name] for name in _GLOBAL_FLAGS)
    return (*(_table(g[name], flags if name == "_global_forward_hooks" else (), structural)
              for name in _GLOBAL_DICTS), None)


def identity_key(value: Any) -> tuple | None:
    """The hook key of ``value`` (a module, or :data:`GLOBAL`) by identity; None for anything else."""
    if isinstance(value, torch.nn.Module):
        return hook_key(value, structural=False)
    if value is GLOBAL:
        return global_hook_key(structural=False)
    return None


def hooks_of(value: Any) -> tuple | None:
    """What a guard on the hooks of ``value`` (a module, or :data:`GLOBAL`) reads: its :func:`identity_key`
    and what the functions in it name (:func:`names_of`); None for anything else."""
    key = identity_key(value)
    if not key:
        return key
    return (*key, names_of(key))


# -- what a function's code names: closure cells and globals ------------------------------------------------


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def named_values(fn: Any) -> Iterator[tuple[Any, Any, Any]]:
    """``(holder, step, value)`` for every closure cell and global ``fn``'s code names (nested functions
    included): a cell and ``"cell_contents"``, or the globals and ``("item", name)``."""
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell: a name bound later in the enclosing function
            continue
        yield cell, "cell_contents", value
    scope = getattr(fn, "__globals__", {})
    for name in dict.fromkeys(_names(code)):
        if name in scope:
            yield scope, ("item", name), scope[name]


def _functions(key: tuple) -> Iterator[Any]:
    for table in key[:TABLES]:
        for entry in table:
            yield entry[0].obj
    forward = key[TABLES]
    if forward is not None:
        yield forward[1].obj


def names_of(key: tuple) -> tuple:
    """What the functions of a hook key (by identity) name, as ``((Ref(holder), step), value)``: a plain
    value as ``(type, value)``, anything else by identity.  Modules (``torch``, ``F``) are left out: code
    does not rebind them."""
    found: dict[tuple, Any] = {}
    for fn in _functions(key):
        for holder, step, value in named_values(fn):
            if not isinstance(value, types.ModuleType):
                held = (type(value), value) if plain_value(value) else Ref(value)
                found.setdefault((Ref(holder), step), held)
    return tuple(found.items())


def tables(module: torch.nn.Module) -> tuple[dict, ...]:
    """The hook tables of ``module`` themselves: a guard that a module still has no hook tests these."""
    d = module.__dict__
    return tuple(d.get(name, {}) for name in HOOK_DICTS)


def global_tables() -> tuple[dict, ...]:
    return tuple(torch_module.__dict__[name] for name in _GLOBAL_DICTS)


# -- strings hooks close over, as labels (Note [Region identity]) -------------------------------------------


def named_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``module.named_modules()``, read from each module's ``__dict__``: effectfx's own walk, which a trace
    does not record (its ``_modules`` read would be a guard on their order: ``kinds.Keys``)."""
    found: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()

    def walk(prefix: str, sub: torch.nn.Module) -> None:
        if id(sub) not in seen:
            seen.add(id(sub))
            found.append((prefix, sub))
            for name, child in vars(sub)["_modules"].items():
                if child is not None:
                    walk(f"{prefix}.{name}" if prefix else name, child)

    walk("", module)
    return found


def _strings(fn: types.FunctionType) -> Iterator[tuple[tuple, str]]:
    """``(step, value)`` for each string ``fn`` closes over or has as a default: what :func:`hook_step`
    reads at ``step``."""
    for k, cell in enumerate(fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, str):
            yield ("cell", k, fn.__code__.co_freevars[k]), value
    defaults = fn.__defaults__ or ()
    parameters = fn.__code__.co_varnames[:fn.__code__.co_argcount][-len(defaults):] if defaults else ()
    for k, (value, name) in enumerate(zip(defaults, parameters)):
        if isinstance(value, str):
            yield ("default", k, name), value
    for name, value in (fn.__kwdefaults__ or {}).items():
        if isinstance(value, str):
            yield ("kwdefault", name), value


def _put(fn: types.FunctionType, step: tuple, value: Any) -> Callable[[], None]:
    """Put ``value`` where ``step`` of ``fn`` is; returns what puts back what was there."""
    if step[0] == "cell":
        cell = fn.__closure__[step[1]]  # type: ignore[index]
        old = cell.cell_contents
        cell.cell_contents = value
        return lambda: setattr(cell, "cell_contents", old)
    if step[0] == "default":
        old_defaults = fn.__defaults__ or ()
        fn.__defaults__ = (*old_defaults[:step[1]], value, *old_defaults[step[1] + 1:])
        return lambda: setattr(fn, "__defaults__", old_defaults)
    old_kw = dict(fn.__kwdefaults__ or {})
    fn.__kwdefaults__ = {**old_kw, step[1]: value}
    return lambda: setattr(fn, "__kwdefaults__", old_kw)


HOOK_STEPS = frozenset({"hook", "cell", "default", "kwdefault"})  # (a path step's first item)


def hook_step(value: Any, step: tuple) -> Any:
    """What a path step into hooks reads (MISSING where there is nothing): ``("hook", table, position)`` of
    a module, then ``("cell", k, name)``, ``("default", k, name)`` or ``("kwdefault", name)`` of the
    function."""
    try:
        if step[0] == "hook":
            return list(vars(value)[step[1]].values())[step[2]]
        if type(value) is not types.FunctionType:
            return MISSING
        if step[0] == "cell":
            return value.__closure__[step[1]].cell_contents  # type: ignore[index]
        if step[0] == "default":
            return value.__defaults__[step[1]]  # type: ignore[index]
        return value.__kwdefaults__[step[1]]  # type: ignore[index]
    except (KeyError, IndexError, TypeError, ValueError):
        return MISSING


@contextmanager
def hook_labels(leaves: list[Any], make: Callable[..., Any]) -> Iterator[None]:
    """While a body is traced: each string a forward (pre-)hook of a module it is passed (or of one of its
    submodules) closes over or has as a default is a label the body made (``make``: ``BodyLabels.make``),
    at its path from the body's arguments -- the module, the hook's position, its cell or default.  A hook
    that only passes it to effect ops (``lambda m, a, o, n=f"attn{i}": record(n)``) leaves it an operand:
    one body for every layer, each call site passing its own.  The hooks' own cells and defaults hold the
    labels meanwhile (the hook is the very function nn.Module calls), and get their values back after.

    A label already there (an enclosing body's, traced meanwhile) is the parent: a use of the inner one
    is a use of it."""
    undo: list[Callable[[], None]] = []
    try:
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.nn.Module):
                continue
            for prefix, sub in named_modules(leaf):
                for table in LABELLED:
                    for position, fn in enumerate(vars(sub).get(table, {}).values()):
                        if type(fn) is not types.FunctionType:
                            continue
                        at = (("leaf", i), *(prefix.split(".") if prefix else ()), ("hook", table, position))
                        for step, value in list(_strings(fn)):
                            undo.append(_put(fn, step, make((*at, step), raw(value), parent=value)))
        yield
    finally:
        for put_back in reversed(undo):
            put_back()
