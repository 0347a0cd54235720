"""Small models the tests share: blocks whose forward is a region that records an effect."""

from __future__ import annotations

import torch
from torch import nn

import effectfx as efx

from . import effect_ops  # noqa: F401  (registers the efxtest ops)


class Block(nn.Module):
    """``relu(Linear(x))`` with a ``record_memory("block")`` effect; its forward is one region."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.record_memory("block")
        return torch.relu(self.lin(x))


class Stack(nn.Module):
    """``n`` :class:`Block` s in a row, optionally followed by a top-level ``record_stdout("done")``."""

    def __init__(self, n: int = 2, width: int = 4, done: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(n))
        self.done = done

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if self.done:
            torch.ops.efxtest.record_stdout("done")
        return x
