"""Module hooks in region identity (Note [Region identity]): a module's forward, pre-forward and backward
hooks are part of what calling it does, so they are part of what a body is for and of what a compiled
program relies on.  So is an *instance* ``forward``: one assigned on the object
(``mod.forward = types.MethodType(f, mod)``), which ``nn.Module``'s call runs instead of its class's.

A *hook key* describes the hooks of one module (or torch's global ones), in the order ``nn.Module`` calls
them, then its instance ``forward`` (None: its class's).  In a body's key (``ModuleWalk.structure``,
structural) a function is its code, the values it closes over and the globals it names -- plain data by
value, anything else by identity -- so the layers of a stack whose hooks come from one ``lambda`` with equal
values share a body, and a layer whose hook logs another name gets its own; a method bound to the module
itself is its function (each layer's ``types.MethodType(f, layer)`` is one).  In a compiled program's guards
(by identity, :func:`hooks_of`) a hook is the function object itself, and so is what its code names
(:func:`names_of`): the closure cells and globals it reads, functions too -- a hook calling a global
``hook_fn`` calls whichever is bound now.  Registering or removing a hook on any module the program may run,
or a global one, assigning or deleting an instance ``forward``, or rebinding what their code names,
captures anew; undoing it serves the first program again.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.modules.module as torch_module

from .values import Ref, plain_value

# the hook tables nn.Module's call reads
HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_DICTS = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                 "_global_backward_hooks")
_GLOBAL_FLAGS = ("_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")
GLOBAL = torch_module  # the path root of a guard on the global hooks
HOOKS = ("hooks",)  # the path step of a guard on hooks (effectfx.guards.check.step)
FORWARD = "forward"  # an instance attribute of that name is what nn.Module's call runs
TABLES = 4  # a hook key: its hook tables, then the instance forward (then, in a guard's, what they name)


def _value(v: Any) -> Any:
    return v if plain_value(v) else Ref(v)


def _hook(fn: Any, structural: bool) -> Any:
    """One hook as a key holds it: the function itself (by identity), or, ``structural``, its code, the
    values it closes over and the globals it names."""
    if not structural:
        return Ref(fn)
    if type(fn) is types.FunctionType:
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(_value(cell.cell_contents))
            except ValueError:  # an empty cell
                cells.append(None)
        scope = fn.__globals__  # (the globals it names too: a body's effects are known by its key)
        named = tuple((name, _value(scope[name])) for name in dict.fromkeys(_names(fn.__code__))
                      if name in scope and not isinstance(scope[name], types.ModuleType))
        return (Ref(fn.__code__), tuple(_value(v) for v in fn.__defaults__ or ()),
                tuple((k, _value(v)) for k, v in (fn.__kwdefaults__ or {}).items()), tuple(cells), named)
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


def _table(hooks: dict, flags: tuple[dict, ...], structural: bool) -> tuple:
    return tuple((_hook(fn, structural), *(hook_id in f for f in flags)) for hook_id, fn in hooks.items())


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
    return (_table(d.get("_forward_pre_hooks", {}), pre_flags, structural),
            _table(d.get("_forward_hooks", {}), flags, structural),
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
