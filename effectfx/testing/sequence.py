"""Calls of a generated program with its hooks changed between them (``between(model, call)`` in its
source, ``effectfx.testing.program.ProgramSpec.sequence``): eager and ``efx.compile`` alike.

The eager model and the compiled module share one state (``efx.compile(model)`` is the model but for the
call), so each change is made once, on the model, and both runs of a call see it; each call of the compiled
module starts from the buffers eager's call started from, and the next call from where the compiled one
left them.  A compiled program guards every module's hooks: a hook registered or removed after a compiled
call must capture anew (Note [Region identity]), or reuse the program made for the hooks as they are again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .differential import RunResult, StartingState, run_sequence, state_of


class EagerFailed(Exception):
    """Eager itself failed on a call (the generator made an invalid program); the cause is eager's error."""


def run_changing(model: torch.nn.Module, compiled: Callable[..., Any], make_args: Callable[[], tuple],
                 between: Callable[[torch.nn.Module, int], None], calls: int
                 ) -> list[tuple[RunResult, RunResult]]:
    """(eager's result, the compiled one's) of each of ``calls`` calls on fresh ``make_args()``, with
    ``between(model, k)`` before call ``k >= 1``; each result holds the arguments and the buffers after
    its call (``RunResult.after``)."""
    pairs = []
    for k in range(calls):
        if k:
            between(model, k)
        start = StartingState(state_of(model))  # where this call starts, for both runs
        try:
            (want,) = run_sequence(model, model, make_args, start, 1)
        except Exception as exc:
            raise EagerFailed(f"eager failed at call {k + 1}") from exc
        (got,) = run_sequence(compiled, model, make_args, start, 1)
        pairs.append((want, got))
    return pairs


__all__ = ["EagerFailed", "run_changing"]
