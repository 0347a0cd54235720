"""``efx.compile``: a function's :class:`~effectfx.drivers.callable.CompiledCallable`, or a module's compiled
module -- an ``nn.Module`` that is the model for every purpose but the call (:func:`compiled_module`)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..backends.tiers import Tiers
from ..guards.reads import same_class
from .callable import CompiledCallable


def compile(fn: Callable[..., Any], *, backend: str = "eager",  # noqa: A001
            profile_regions: bool = False, dynamic: bool | None = None, tiers: str | Tiers | None = None
            ) -> Any:
    """Compile ``fn``: autograd, caching per signature, effects in order.  A function gives a
    :class:`CompiledCallable`; an ``nn.Module`` gives its compiled module (:func:`compiled_module`), which
    is the model for every purpose but the call.  ``profile_regions=True`` opens a profiler range
    ``region:<name>`` around every region call.  ``dynamic`` (Note [Symbolic shapes]): None captures
    static first and makes the sizes that change between calls symbolic; True makes every size symbolic
    from the first call; False captures each new size anew.  ``tiers`` (backend="inductor";
    ``effectfx.backends.tiers``): "background" (the default) compiles a whole-program tier 2 in a thread
    once a program served 10 calls and switches to it at a call boundary; "at-once" compiles it in the
    calling thread, at the first call; "tier1" never; ``efx.Tiers(mode, after=n)`` after ``n`` calls."""
    if isinstance(fn, torch.nn.Module):
        return compiled_module(fn, backend=backend, profile_regions=profile_regions, dynamic=dynamic,
                               tiers=tiers)
    return CompiledCallable(fn, backend=backend, profile_regions=profile_regions, dynamic=dynamic,
                            tiers=tiers)


# -- the compiled module ----------------------------------------------------------------------------------
# What a compiled module forwards to its CompiledCallable when the model itself has no such attribute.
_CALLABLE_API = frozenset({"programs", "stats", "cache", "backend", "profile_regions", "entry_for",
                           "signature", "dynamic"})


def _rebuild(model: torch.nn.Module, backend: str, profile_regions: bool,
             dynamic: bool | None = None, tiers: str | Tiers | None = None) -> torch.nn.Module:
    return compiled_module(model, backend=backend, profile_regions=profile_regions, dynamic=dynamic,
                           tiers=tiers)


def compiled_module(model: torch.nn.Module, backend: str = "eager", profile_regions: bool = False,
                    dynamic: bool | None = None, tiers: str | Tiers | None = None) -> torch.nn.Module:
    """``efx.compile(model)``: an ``nn.Module`` that is the model for every purpose but the call.

    It is an instance of a subclass of the model's own class made for it, whose instance state *is* the
    model's -- one ``__dict__`` for both -- so it has the same parameters and buffers (the same tensors),
    the same ``state_dict`` keys (no prefix), attributes, training flag and hooks, and
    ``isinstance(compiled, type(model))`` holds.  Only ``forward`` differs: it runs the model's forward
    through a :class:`CompiledCallable` (the model's own hooks run around it, eagerly, as
    ``nn.Module.__call__`` runs them).  A method of the model (``generate``) called on the compiled module
    has it as ``self``, so its ``self(...)`` is compiled.  ``compiled.original`` (or ``_orig_mod``, as
    torch spells it) is the model, ``compiled.compiled`` the callable (``programs()``, ``stats``, which
    the compiled module also answers when the model has no attribute of that name).  ``copy.deepcopy``
    copies the model and compiles the copy; pickling (``torch.save``) stores the model and compiles it
    again when loaded."""
    base = type(model)
    compiled = CompiledCallable(model.forward, backend=backend, profile_regions=profile_regions,
                                dynamic=dynamic, tiers=tiers)

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return compiled(*args, **kwargs)

    # the model's own parameters, as inspect reads them: transformers' generate passes position_ids and
    # logits_to_keep only to a forward whose signature names them (a left-padded batch needs the former)
    forward.__signature__ = inspect.signature(base.forward)  # type: ignore[attr-defined]

    def getattr_(self: Any, name: str) -> Any:
        try:
            return base.__getattr__(self, name)
        except AttributeError:
            if name in _CALLABLE_API:
                return getattr(compiled, name)
            raise

    def reduce(self: Any, protocol: Any = None) -> tuple:
        return (_rebuild, (model, backend, profile_regions, dynamic, tiers))

    namespace = {
        "forward": forward, "__getattr__": getattr_, "__reduce__": reduce, "__reduce_ex__": reduce,
        "__repr__": lambda self: f"{base.__repr__(self)}  # {compiled!r}",
        "__deepcopy__": lambda self, memo: compiled_module(copy.deepcopy(model, memo), backend,
                                                           profile_regions, dynamic, tiers),
        "original": property(lambda self: model, doc="the model this compiled module runs"),
        "_orig_mod": property(lambda self: model), "compiled": property(lambda self: compiled),
        "__module__": base.__module__, "__qualname__": base.__qualname__,
    }
    module = object.__new__(same_class(base, namespace))
    module.__dict__ = model.__dict__  # one state for both: parameters, buffers, submodules, hooks, flags
    return module
