"""The one mechanism of every interposer: :func:`interpose` puts a replacement in place of a Python-level
attribute while captures run, and only the capturing thread sees it act.

``interpose(owner, name, replacement)`` registers ``owner.<name>`` (a module's function, a class's
method, an instance's attribute).  While at least one capture session runs in the process
(``effectfx.capture.session``, through :func:`installed`), ``owner.<name>`` is a dispatcher: on a thread
with an active capture it calls ``replacement``, on every other thread the original, unchanged.  When the
last session ends the original is put back -- unless someone replaced the attribute meanwhile, whose
replacement stays.  ``per_thread=False`` installs ``replacement`` itself (a class to swap an object's
``__class__`` to, whose methods make the per-thread choice).  Outside captures nothing is interposed, so
eager code pays nothing.

A replacement that hands a call back to the original -- a range DDP opens, a print while the capture is
suspended -- calls ``interposer.original``.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

from ..regions.decorator import active_tracer

_MISSING = object()


class Interposer:
    """One interposed attribute: what it was (``original``), what stands in for it while captures run."""

    __slots__ = ("owner", "name", "original", "replacement", "installed_value", "owned")

    def __init__(self, owner: Any, name: str, replacement: Any, per_thread: bool) -> None:
        self.owner, self.name, self.replacement = owner, name, replacement
        original = getattr(owner, name)
        # (registered while a capture runs: an inherited attribute may be a base's dispatcher)
        inner = getattr(original, "__effectfx_interposer__", None)
        self.original = inner.original if inner is not None else original
        # an attribute the owner inherits (a base class's method, a class's method on an instance) is
        # deleted again, not set to the inherited value
        self.owned = name == "__class__" or name in getattr(owner, "__dict__", {})
        self.installed_value = _dispatcher(self) if per_thread else replacement

    def install(self) -> None:
        setattr(self.owner, self.name, self.installed_value)

    def remove(self) -> None:
        if getattr(self.owner, self.name, _MISSING) is not self.installed_value:
            return  # someone replaced ours meanwhile: theirs stays
        if self.owned:
            setattr(self.owner, self.name, self.original)
        else:
            delattr(self.owner, self.name)

    def __repr__(self) -> str:
        owner = getattr(self.owner, "__qualname__", None) or type(self.owner).__name__
        return f"<interposer {owner}.{self.name}>"


def _dispatcher(interposer: Interposer) -> Callable[..., Any]:
    original, replacement = interposer.original, interposer.replacement

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        if active_tracer() is None:
            return original(*args, **kwargs)
        return replacement(*args, **kwargs)

    if isinstance(original, (types.FunctionType, types.BuiltinFunctionType)):
        functools.update_wrapper(dispatch, original)  # (its name and signature stay the original's)
    dispatch.__effectfx_interposer__ = interposer  # type: ignore[attr-defined]
    return dispatch


_LOCK = threading.Lock()
_REGISTERED: list[Interposer] = []
_SESSIONS = 0  # capture sessions running, on every thread


def interpose(owner: Any, name: str, replacement: Any, *, per_thread: bool = True) -> Interposer:
    """Register ``replacement`` for ``owner.<name>`` while captures run (the module docstring).  Registered
    while a capture runs, it takes effect at once."""
    interposer = Interposer(owner, name, replacement, per_thread)
    with _LOCK:
        _REGISTERED.append(interposer)
        if _SESSIONS:
            interposer.install()
    return interposer


def interposed(owner: Any, name: str) -> bool:
    """Whether ``owner.<name>`` is registered already (a registration made once per owner)."""
    return any(i.owner is owner and i.name == name for i in _REGISTERED)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Every registered interposer in place while this runs: the first session installs them, the last
    one to end removes them."""
    global _SESSIONS
    with _LOCK:
        if _SESSIONS == 0:
            for interposer in _REGISTERED:
                interposer.install()
        _SESSIONS += 1
    try:
        yield
    finally:
        with _LOCK:
            _SESSIONS -= 1
            if _SESSIONS == 0:
                for interposer in reversed(_REGISTERED):
                    interposer.remove()
