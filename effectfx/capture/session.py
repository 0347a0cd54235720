"""One capture session: everything a capture changes about the process while it runs, and puts back.

A capture runs the user's code on this thread with effectfx's tracer as the active one (regions and
interposers consult it), every interposer in place (``effectfx.interposers.interpose``: ``print``, print
options, profiler ranges, ``backward()``, optimizer steps, higher-order ops...), the tracer's fake mode
and dispatch mode entered, and the capture's own Python state: the prints it records, the Dynamo frames
it makes Dynamo see (forgotten afterwards), the objects it watches (their classes given back).  However
the capture ends, the session leaves the process as it found it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..interposers import interpose, python_random, sym_numbers  # noqa: F401  (their interposers)
from ..interposers.dynamo_frames import frames_forgotten
from ..interposers.python_print import capture_prints
from ..regions import decorator as _regions
from .tracer import Tracer


class CaptureSession:
    """``with CaptureSession(tracer):`` the capture with ``tracer`` on this thread (module docstring)."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self._stack: contextlib.ExitStack | None = None
        self._previous: Any = None

    def __enter__(self) -> CaptureSession:
        tracer = self.tracer
        self._previous = _regions.active_tracer()
        _regions._ACTIVE.tracer = tracer
        # autocast caches its casts of leaf tensors (weights): a cast made by eager code must not leak into
        # the trace, nor a fake one made by the trace into the user's eager code
        torch.clear_autocast_cache()
        stack = self._stack = contextlib.ExitStack()
        try:
            # under inference_mode the trace runs as under no_grad (what inference_mode is, for the graph):
            # fake views of a parameter need version counters, which inference tensors cannot have; the
            # program runs in the caller's inference_mode, so its results are inference tensors as eager's
            grad = torch.is_grad_enabled()  # (leaving inference_mode enables grad mode)
            if torch.is_inference_mode_enabled():
                stack.enter_context(torch.inference_mode(False))
            stack.enter_context(torch.set_grad_enabled(grad))
            stack.enter_context(interpose.installed())
            stack.enter_context(frames_forgotten())
            stack.enter_context(capture_prints(tracer))
            stack.enter_context(tracer.fake_mode)
            stack.enter_context(tracer)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._stack is not None:
                self._stack.__exit__(*exc)
        finally:
            self._stack = None
            _regions._ACTIVE.tracer = self._previous
            self.tracer.watcher.restore()  # every watched object gets its class back
            torch.clear_autocast_cache()
