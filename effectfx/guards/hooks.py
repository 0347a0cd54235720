"""Module hooks in region identity (Note [Region identity]): a module's forward, pre-forward and backward
hooks are part of what calling it does, so they are part of what a body is for and of what a compiled
program relies on.

A *hook key* describes the hooks of one module (or torch's global ones), in the order ``nn.Module`` calls
them.  In a body's key (``ModuleWalk.structure``, structural) a hook function is its code and the values it
closes over -- plain data by value, anything else by identity -- so the layers of a stack whose hooks come
from one ``lambda`` with equal values share a body, and a layer whose hook logs another name gets its own.
In a compiled program's guards (by identity) a hook is the function object itself: registering or
removing a hook on any module the program may run, or a global one, captures anew.
"""

from __future__ import annotations

import types
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


def _value(v: Any) -> Any:
    return v if plain_value(v) else Ref(v)


def _hook(fn: Any, structural: bool) -> Any:
    """One hook as a key holds it: the function itself (by identity), or, ``structural``, its code and the
    values it closes over."""
    if not structural:
        return Ref(fn)
    if type(fn) is types.FunctionType:
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(_value(cell.cell_contents))
            except ValueError:  # an empty cell
                cells.append(None)
        return (Ref(fn.__code__), tuple(_value(v) for v in fn.__defaults__ or ()),
                tuple((k, _value(v)) for k, v in (fn.__kwdefaults__ or {}).items()), tuple(cells))
    return Ref(fn)  # a bound method, a partial, a callable object: by identity


def _table(hooks: dict, flags: tuple[dict, ...], structural: bool) -> tuple:
    return tuple((_hook(fn, structural), *(hook_id in f for f in flags)) for hook_id, fn in hooks.items())


def has_hooks(module: torch.nn.Module) -> bool:
    d = module.__dict__  # (not an attribute read a trace records: nn.Module's bookkeeping)
    return bool(d.get("_forward_pre_hooks") or d.get("_forward_hooks") or d.get("_backward_pre_hooks")
                or d.get("_backward_hooks"))


def hook_key(module: torch.nn.Module, structural: bool) -> tuple:
    """The hooks of ``module`` (``()`` when it has none), as a key or guard holds them."""
    if not has_hooks(module):
        return ()
    d = module.__dict__
    pre_flags = (d.get("_forward_pre_hooks_with_kwargs", {}),)
    flags = (d.get("_forward_hooks_with_kwargs", {}), d.get("_forward_hooks_always_called", {}))
    return (_table(d.get("_forward_pre_hooks", {}), pre_flags, structural),
            _table(d.get("_forward_hooks", {}), flags, structural),
            _table(d.get("_backward_pre_hooks", {}), (), structural),
            _table(d.get("_backward_hooks", {}), (), structural))


def global_hook_key(structural: bool) -> tuple:
    """torch's global module hooks (``register_module_forward_hook`` and its family), as :func:`hook_key`."""
    g = torch_module.__dict__
    if not any(g[name] for name in _GLOBAL_DICTS):
        return ()
    flags = tuple(g[name] for name in _GLOBAL_FLAGS)
    return tuple(_table(g[name], flags if name == "_global_forward_hooks" else (), structural)
                 for name in _GLOBAL_DICTS)


def hooks_of(value: Any) -> tuple | None:
    """What a guard on the hooks of ``value`` (a module, or :data:`GLOBAL`) reads; None for anything
    else."""
    if isinstance(value, torch.nn.Module):
        return hook_key(value, structural=False)
    if value is GLOBAL:
        return global_hook_key(structural=False)
    return None


def tables(module: torch.nn.Module) -> tuple[dict, ...]:
    """The hook tables of ``module`` themselves: a guard that a module still has no hook tests these."""
    d = module.__dict__
    return tuple(d.get(name, {}) for name in HOOK_DICTS)


def global_tables() -> tuple[dict, ...]:
    return tuple(torch_module.__dict__[name] for name in _GLOBAL_DICTS)
