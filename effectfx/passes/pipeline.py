"""Run passes in order, stamping each Program with the pass's name and time.

In debug mode (``EFFECTFX_DEBUG=1``) every pass is followed by the verifier, and a failure names the pass
that broke the graph.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..errors import debug_enabled
from ..program.program import Program
from ..program.records import PassRecord
from ..program.training import TrainingProgram

P = TypeVar("P", Program, TrainingProgram)
Pass = Callable[[Program], Program]


def _apply(pass_: Pass, prog: Program) -> Program:
    start = time.perf_counter()
    out = pass_(prog)
    record = PassRecord(getattr(pass_, "__name__", type(pass_).__name__), time.perf_counter() - start)
    out = out.replace(history=(*prog.history, record))
    if debug_enabled():
        from .verify import verify

        verify(out, after=record.name)
    return out


def run_passes(prog: Any, passes: Sequence[Pass]) -> Any:
    """Apply ``passes`` in order to a Program, or to both halves of a TrainingProgram."""
    for pass_ in passes:
        if isinstance(prog, TrainingProgram):
            prog = prog.map(lambda p, pass_=pass_: _apply(pass_, p))
        else:
            prog = _apply(pass_, prog)
    return prog
