"""``efx.compile``: a function's :class:`~effectfx.drivers.callable.CompiledCallable`, or a module's compiled
module -- an ``nn.Module`` that is the model for every purpose but the call (:func:`compiled_module`).

Note [Nested compiles]
~~~~~~~~~~~~~~~~~~~~~~
A library compiles a block, then its user compiles the model; or a compiled function calls another.  A
compiled callable called while a capture runs on its thread (``active_tracer()``: a root, a region body, a
program's retrace) is *inlined*: it calls the function it compiled, so the outer trace sees the code itself
-- its regions stay regions, its effects effects, its parameters the outer program's lifted tensors -- as
if it had never been compiled.  It runs no program of its own then, captures none, and counts no call in
its ``stats``.  Called outside any capture it runs its own programs, from its own cache, as before: the
block compiled alone and the model around it each keep theirs.  Compiling a compiled callable or module
again is idempotent: with the same options it is the same object; with others, the original function or
model compiled with them (never a compile of the compiled one).  A ``torch.compile``'d function inside
captured code is Dynamo's, and is traced through (``interposers.dynamo_frames``).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..backends.tiers import Tiers, tiers_for
from ..guards.reads import same_class
from ..regions.decorator import active_tracer
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
    once a program's calls paid for it (Note [When tier 2 pays]) and switches to it at a call boundary;
    "at-once" compiles it in the
    calling thread, at the first call; "tier1" never; ``efx.Tiers(mode, after=n)`` after ``n`` calls.  A
    compiled callable or module is not compiled again (Note [Nested compiles])."""
    compiled = fn.compiled if isinstance(fn, torch.nn.Module) and _is_compiled(fn) else fn
    if isinstance(compiled, CompiledCallable):  # compiled already: idempotent (Note [Nested compiles])
        options = (compiled.backend, compiled.profile_regions, compiled.dynamic, compiled.tiers)
        if options == (backend, profile_regions, dynamic, tiers_for(backend, tiers)):
            return fn
        fn = fn.original if compiled is not fn else compiled.fn
    if isinstance(fn, torch.nn.Module):
        return compiled_module(fn, backend=backend, profile_regions=profile_regions, dynamic=dynamic,
                               tiers=tiers)
    return CompiledCallable(fn, backend=backend, profile_regions=profile_regions, dynamic=dynamic,
                            tiers=tiers)


def _is_compiled(module: torch.nn.Module) -> bool:
    return getattr(type(module), "__efx_compiled__", None) is not None


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
        if active_tracer() is not None:  # inlined, with this module as ``self``: what the outer trace reads
            return base.forward(self, *args, **kwargs)  # of it is guarded (Note [Nested compiles])
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
        "__efx_compiled__": base, "__module__": base.__module__, "__qualname__": base.__qualname__,
    }
    module = object.__new__(same_class(base, namespace))
    module.__dict__ = model.__dict__  # one state for both: parameters, buffers, submodules, hooks, flags
    return module
