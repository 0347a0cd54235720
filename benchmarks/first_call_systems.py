"""The block stack of ``benchmarks/first_call.py`` (and ``benchmarks/runtime.py``) and the systems the first
call compares.

The model is a stack of N blocks, each ``relu(Linear(x))`` plus one call of the effect op
``efxbench::record`` (:mod:`benchmarks.common`).  The same block body is marked once per system
(``common.MARKERS``), one class per marker and effect, so each system sees its own marker and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import effectfx as efx
from benchmarks import common

# system -> (marker of the blocks, whether blocks call the effect op)
SYSTEMS: dict[str, tuple[str, bool]] = {
    "efx": ("efx", True),
    "tc": ("tc", True),
    "eager": ("eager", True),
    "efx_noeffect": ("efx", False),
    "tc_noeffect": ("tc", False),
}
LABELS = {
    "efx": "effectfx",
    "tc": "torch.compile",
    "eager": "eager",
    "efx_noeffect": "effectfx (no effects)",
    "tc_noeffect": "torch.compile (no effects)",
}
WIDTH, BATCH = 64, 8


# -- the stack -------------------------------------------------------------------------------------
def _forward_effect(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.ops.efxbench.record("block")
    return torch.relu(self.lin(x))


def _forward_plain(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(self.lin(x))


class BlockBase(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)


BLOCKS: dict[tuple[str, bool], type[BlockBase]] = {
    (marker, effects): type(
        f"Block_{marker}{'' if effects else '_noeffect'}",
        (BlockBase,),
        {"forward": mark(_forward_effect if effects else _forward_plain)},
    )
    for marker, mark in common.MARKERS.items()
    for effects in (True, False)
}


class Stack(torch.nn.Module):
    def __init__(self, n: int, width: int, marker: str = "eager", effects: bool = True) -> None:
        super().__init__()
        block = BLOCKS[(marker, effects)]
        self.blocks = torch.nn.ModuleList(block(width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def make_model(n: int, width: int, marker: str, effects: bool = True, train: bool = True,
               seed: int = 0) -> Stack:
    """A fresh stack; the same ``seed`` gives the same weights whatever the marker."""
    torch.manual_seed(seed)
    model = Stack(n, width, marker, effects)
    model.requires_grad_(train)
    return model


def compile_for(system: str, model: torch.nn.Module) -> Callable[..., Any]:
    if system == "efx":
        return efx.compile(model)
    if system == "tc":
        return torch.compile(model, backend="aot_eager")
    if system == "eager":
        return model
    raise ValueError(system)


def warmup() -> None:
    """Pay one-time costs (lazy imports, dynamo/AOT initialisation, first dispatch) before measuring."""
    for train in (False, True):
        for system, marker in (("efx", "efx"), ("tc", "tc"), ("eager", "eager")):
            torch._dynamo.reset()
            model = make_model(1, 8, marker, train=train)
            x = torch.randn(2, 8)
            with torch.set_grad_enabled(train):
                out = compile_for(system, model)(x)
                if train and out.requires_grad:
                    out.sum().backward()
    torch._dynamo.reset()
    common.LOG.clear()
    common.freeze_heap()


# -- the first call's input and eager's results ----------------------------------------------------
def example_input() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g)


def reference(n: int, train: bool, effects: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Eager's output (and, training, every parameter's gradient) on a fresh N-block stack."""
    model = make_model(n, WIDTH, "eager", effects, train)
    x = example_input()
    with torch.set_grad_enabled(train):
        out = model(x)
        if not train:
            return out.detach(), None
        out.sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]
