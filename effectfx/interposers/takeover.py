"""How a higher-order op's capture rule reaches the tracer: one mechanism for every family in
``effectfx.hops`` (Note [Higher-order ops]).

A higher-order op (HOP) would reach a dispatch mode through the op's own table of rules, one per mode class,
after torch's eager wrappers have handed the user's functions to Dynamo or to torch's ``make_fx``. effectfx
takes the HOPs it captures over *before* that: :func:`take_over` interposes on the HOP class's ``__call__``
(``effectfx.interposers.interpose``) so that, on a thread with an active capture, the call goes to the
family's rule ``rule(tracer, *args, **kwargs)``, which traces the user's functions with effectfx's own tracer;
on every other thread, and outside a capture, torch's call runs as it always does.

A HOP that is not taken over is refused with a clear error (``effectfx.capture.unsupported``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..regions.decorator import active_tracer
from .interpose import interpose

_TAKEN: dict[type, Callable[..., Any]] = {}  # HOP class -> its capture rule


def take_over(hop_class: type, rule: Callable[..., Any]) -> None:
    """During a capture on this thread, calls of ``hop_class``'s instances run ``rule(tracer, *args,
    **kwargs)`` (an interposer on the class's ``__call__``).  Registered once per class (importing a
    family again changes nothing)."""
    if hop_class in _TAKEN:
        return

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return rule(active_tracer(), *args, **kwargs)

    interpose(hop_class, "__call__", call)
    _TAKEN[hop_class] = rule


def taken_over(hop: Any) -> bool:
    """Whether the HOP ``hop`` has a capture rule."""
    return any(cls in _TAKEN for cls in type(hop).__mro__)
