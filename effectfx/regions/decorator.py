"""Regions: functions and module methods traced once and called many times.

See Note [Region identity] in ``effectfx.notes`` for what makes two calls share a body.  Outside a capture
a region is a plain call; inside one, the active tracer takes over the call.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from typing import Any, TypeVar, overload

F = TypeVar("F", bound=Callable[..., Any])

# The tracer active on this thread (set by effectfx.capture); regions consult it on every call.
_ACTIVE = threading.local()


def active_tracer() -> Any:
    return getattr(_ACTIVE, "tracer", None)


def _default_name(fn: Callable[..., Any]) -> str:
    # "Block.forward" for methods, "repeated" for functions (closures lose their "<locals>" prefix)
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "region")
    return qualname.rsplit("<locals>.", 1)[-1]


class Region:
    """One region: the user's function, its display name, and what its traces revealed so far."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        # a bound method (``layer.forward = efx.region(layer.forward)``) is its function called with the
        # module first, so every instance's calls share bodies and lift their own parameters
        self.bound = getattr(fn, "__self__", None) if inspect.ismethod(fn) else None
        self.fn = fn.__func__ if self.bound is not None else fn  # type: ignore[union-attr]
        self.name = name or _default_name(self.fn)
        # cache key -> effect keys seen when that key's body was functionalized (across captures)
        self.known_effects: dict[Any, frozenset[str]] = {}

    def __repr__(self) -> str:
        return f"<effectfx region {self.name!r}>"

    def call(self, args: tuple, kwargs: dict) -> Any:
        if self.bound is not None:
            args = (self.bound, *args)
        tracer = active_tracer()
        if tracer is None:
            return self.fn(*args, **kwargs)
        return tracer.call_region(self, args, kwargs)


@overload
def region(fn: F) -> F: ...
@overload
def region(*, name: str | None = None) -> Callable[[F], F]: ...


def region(fn: Any = None, *, name: str | None = None) -> Any:
    """Mark a function or ``nn.Module`` method as a reusable region (Note [Region identity]).

    ``@region``, ``@region(name="block")``.  In eager it is a plain call.
    """

    def wrap(f: F) -> F:
        reg = Region(f, name)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return reg.call(args, kwargs)

        wrapper.__effectfx_region__ = reg  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    if fn is not None:
        return wrap(fn)
    return wrap


def region_of(fn: Any) -> Region | None:
    """The Region behind a decorated callable (bound methods included), else None."""
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__effectfx_region__", None)


__all__ = ["Region", "region", "region_of", "active_tracer"]
