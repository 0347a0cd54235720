"""Profiler ranges in captured code: ``torch.profiler.record_function`` (and ``torch.autograd.profiler``'s,
the same class) opens and closes its range at run time, on every call, as eager does.

In eager, ``record_function.__enter__`` calls ``profiler::_record_function_enter_new``, which returns a
handle (a ``ScriptObject``) that ``__exit__`` hands to ``_record_function_exit``: a range exists only while
the code runs.  Captured as it is, the range would open once, at capture, on fakes' time, and never again.
While a capture runs, the context manager's methods on the capturing thread (others are untouched: an
interposer, ``effectfx.interposers.interpose``) call two ordered effect ops instead, on key ``"profiler"``:

    effectfx::range_enter(str name) -> ()      effectfx::range_exit() -> ()

whose kernels open and close the range at run time, keeping the open handles on a per-thread stack.  The
range's name is an effect argument like any other: a ``str`` a body reads (``record_function(self.name)``)
is its operand (Note [Region identity], labels), one body for every layer.  ``record_function`` used as a
decorator goes through the same methods.  The ranges DDP and FSDP2 open around their forward keep torch's
own op, whose capture rule refuses those wrappers (``effectfx.interposers.collectives``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.profiler as autograd_profiler

from ..effects import register_effect
from ..guards.labels import raw
from .collectives import parallel_wrapper_range
from .interpose import interpose

KEY = "profiler"
_RUNNING = threading.local()  # .ranges: the handles of the ranges open on this thread, innermost last


@torch.library.custom_op("effectfx::range_enter", mutates_args=())
def range_enter(name: str) -> None:
    handles = getattr(_RUNNING, "ranges", None)
    if handles is None:
        handles = _RUNNING.ranges = []
    handles.append(torch.ops.profiler._record_function_enter_new(name, None))


@range_enter.register_fake
def _(name: str) -> None:
    return None


@torch.library.custom_op("effectfx::range_exit", mutates_args=())
def range_exit() -> None:
    handles = getattr(_RUNNING, "ranges", None)
    if handles:  # (a range opened outside the program is not the program's to close)
        with torch._C.DisableTorchFunctionSubclass():
            torch.ops.profiler._record_function_exit._RecordFunction(handles.pop())


@range_exit.register_fake
def _() -> None:
    return None


register_effect(range_enter, key=KEY)
register_effect(range_exit, key=KEY)



def _enter(self: Any) -> Any:
    # (the name's raw value: effectfx's own look at a label is no use of it, the name stays an operand)
    # DDP's and FSDP2's ranges keep torch's op, whose capture rule (collectives) refuses those wrappers
    if parallel_wrapper_range(raw(self.name)) is not None:
        return _ENTER.original(self)
    self._efx_captured = True
    torch.ops.effectfx.range_enter(self.name)
    return self


def _exit(self: Any, exc_type: Any, exc_value: Any, traceback: Any) -> Any:
    if not getattr(self, "_efx_captured", False):
        return _EXIT.original(self, exc_type, exc_value, traceback)
    self._efx_captured = False
    torch.ops.effectfx.range_exit()
    return None


# while a capture runs on this thread: ``record_function`` records its range as effects
_ENTER = interpose(autograd_profiler.record_function, "__enter__", _enter)
_EXIT = interpose(autograd_profiler.record_function, "__exit__", _exit)


def profiled(call_region: Callable[..., Any]) -> Callable[..., Any]:
    """``efx.compile(..., profile_regions=True)``: every region call opens a range ``region:<name>`` of
    its own around the call, so a trace viewer shows the compiled model's layers (eager has no such
    range: an option, not eager's behaviour)."""
    def call(tracer: Any, region: Any, args: tuple, kwargs: dict) -> Any:
        torch.ops.effectfx.range_enter(f"region:{region.name}")
        out = call_region(tracer, region, args, kwargs)
        torch.ops.effectfx.range_exit()
        return out

    return call
