"""A capture leaves Dynamo as it found it: every frame Dynamo saw during the capture is forgotten.

Code that runs during a capture may call a ``torch.compile``'d function: the user's own, or one inside
torch (eager ``torch.cond``, ``while_loop`` and ``scan`` compile their body with Dynamo).  Dynamo skips every
frame it is handed while a non-infra dispatch mode -- effectfx's tracer -- is on the stack, and remembers
the skip *on the code object*, for good: after the capture the ``torch.compile``'d function runs eager
(silently), and ``torch.cond`` or ``scan`` in eager fails in the whole process (Dynamo now starts tracing
in frames it would have inlined, inside torch's own code).

:func:`frames_forgotten` wraps a capture.  It records the code objects Dynamo is handed on the capturing
thread (an interposer on Dynamo's ``input_codes.add``, which each of its frame callbacks calls first) and
resets them when the capture ends, however it ends (``torch._C._dynamo.eval_frame.reset_code``, what
``torch._dynamo.reset`` does per code object): the next eager call is Dynamo's first look at them.  Dynamo is
imported lazily (it costs seconds); when a capture imports it, every code it has seen so far was seen during
that capture.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from types import CodeType
from typing import Any

from .interpose import interpose, interposed

_LOCAL = threading.local()  # .recording: one set of code objects per capture running on this thread


def _tracker() -> Any:
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    return getattr(convert_frame, "input_codes", None)


def _recording() -> list[set[CodeType]]:
    stack = getattr(_LOCAL, "recording", None)
    if stack is None:
        stack = _LOCAL.recording = []
    return stack


def _interpose(tracker: Any) -> None:
    """Dynamo's ``input_codes.add``, also noting the code for the captures running on this thread."""
    if interposed(tracker, "add"):
        return
    add = tracker.add

    def record(code: CodeType) -> None:
        add(code)
        for codes in getattr(_LOCAL, "recording", ()):
            codes.add(code)

    interpose(tracker, "add", record)


@contextlib.contextmanager
def frames_forgotten() -> Iterator[None]:
    """Run a capture; then reset Dynamo's state of every code object it saw meanwhile (module docstring)."""
    tracker = _tracker()
    if tracker is not None:
        _interpose(tracker)
    codes: set[CodeType] = set()
    stack = _recording()
    stack.append(codes)
    try:
        yield
    finally:
        stack.pop()
        if tracker is None:
            tracker = _tracker()
            if tracker is not None:  # Dynamo was imported during the capture: all it saw is ours
                codes.update(c for c in (ref() for ref in tracker.seen) if c is not None)
        if codes:
            import torch

            reset_code = torch._C._dynamo.eval_frame.reset_code
            for code in codes:
                reset_code(code)
