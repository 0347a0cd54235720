"""The systems of ``benchmarks/runtime.py``: the block stack of :mod:`benchmarks.first_call_systems`, 16
blocks, with and without the effect op, run eagerly, by ``efx.compile`` and by ``torch.compile(aot_eager)``;
and the op alone (16 direct calls of ``torch.ops.efxbench.record``, its own eager cost)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

N_BLOCKS, BATCH = 16, 32
# system -> (compiler, marker of the blocks, whether blocks call the effect op)
SYSTEMS: dict[str, tuple[str, str, bool]] = {
    "eager": ("eager", "eager", True),
    "efx": ("efx", "efx", True),
    "tc": ("tc", "tc", True),
    "eager_noeffect": ("eager", "eager", False),
    "efx_noeffect": ("efx", "efx", False),
    "tc_noeffect": ("tc", "tc", False),
}
LABELS = {
    "eager": "eager", "efx": "effectfx", "tc": "torch.compile",
    "eager_noeffect": "eager (no effects)", "efx_noeffect": "effectfx (no effects)",
    "tc_noeffect": "torch.compile (no effects)", "op": f"effect op x{N_BLOCKS}, eager",
}


def step_of(fn: Callable[..., Any], x: torch.Tensor, train: bool) -> Callable[[], Any]:
    """One call of ``fn`` on ``x``: a training step (``fn(x).sum().backward()``) or an inference call."""
    if train:
        def step() -> None:
            fn(x).sum().backward()
    else:
        def step() -> Any:
            return fn(x)
    return step


def op_step() -> Callable[[], None]:
    """The effect op alone, called as often as the stack calls it."""
    record = torch.ops.efxbench.record

    def step() -> None:
        for _ in range(N_BLOCKS):
            record("block")
    return step
