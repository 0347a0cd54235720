"""efx.compile(fn, backend="inductor"): pure work runs as Inductor kernels, effects run between them in
eager's order; outputs, gradients and effect logs equal eager's.  Inductor compiles are slow: few, small."""

from __future__ import annotations

import pytest
import torch

import effectfx as efx
from effectfx.testing.differential import compare, run_eager, run_program


@efx.region
def seed_region(x):
    torch.ops.efxtest.record_memory("N")
    return x + x


def seed(x):
    return seed_region(seed_region(x)).sin()


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @efx.region
    def forward(self, x):
        torch.ops.efxtest.record_memory("block")
        torch.ops.efxtest.log_tensor(x, "in")  # reads a value Inductor computed
        return torch.ops.efxtest.scale(torch.tanh(self.lin(x)), 0.5)  # records an effect in backward


class FourBlocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        torch.ops.efxtest.record_stdout("done")
        return x


def check_inductor(fn, *args) -> None:
    eager = run_eager(fn, args)
    results = run_program(lambda f, a, k: efx.compile(f, backend="inductor"), fn, args, {}, calls=2)
    for i, result in enumerate(results):
        compare(f"inductor call {i + 1}", eager, result)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_seed(requires_grad: bool) -> None:
    check_inductor(seed, torch.randn(3, requires_grad=requires_grad))


def test_lowered_program_has_segments_and_effects() -> None:
    cfn = efx.compile(seed, backend="inductor")
    cfn(torch.randn(3))
    (prog,) = cfn.programs()
    text = prog.code()
    assert "self.segment_0(" in text and text.count("record_memory.default") == 2
    assert prog.history[-1].name == "lower_to_inductor"


@pytest.mark.slow
def test_four_blocks_forward_and_backward() -> None:
    check_inductor(FourBlocks(), torch.randn(2, 4, requires_grad=True))


@pytest.mark.slow
def test_four_blocks_inference() -> None:
    check_inductor(FourBlocks().requires_grad_(False), torch.randn(2, 4))


def test_needs_token_free_form() -> None:
    from effectfx.backends.inductor import lower_to_inductor

    with pytest.raises(efx.BackendError, match="token-free"):
        lower_to_inductor(efx.capture(seed, torch.randn(3)))
