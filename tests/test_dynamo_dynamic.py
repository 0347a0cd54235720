"""Dynamic sizes behind ``torch.compile(backend="effectfx")`` (``effectfx.drivers.dynamo_inputs``): a Dynamo
graph that takes its sizes symbolically is captured once by effectfx, symbolically -- GPT-2 trained over 4
sequence lengths under ``dynamic=True`` and under automatic dynamic gives eager's losses, gradients and
effect log with at most 2 effectfx captures per Dynamo graph; an ``int`` argument Dynamo made a size is one
too; a float Dynamo passes as a tensor is a number again."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx.testing import hf, recording
from effectfx.testing.dynamo import BackendCallables as Made
from effectfx.testing.dynamo import logged_gpt2

LENGTHS = (8, 9, 11, 13)
LAYERS = 2


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()  # (Dynamo's recompile limit per code object: every test compiles transformers')


def train(model: nn.Module, call: Any) -> tuple[list[float], list[dict[str, torch.Tensor]], list[tuple]]:
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    with recording() as log:
        for length in LENGTHS:
            ids = torch.randint(0, hf.VOCAB, (2, length), generator=g)
            loss = call(input_ids=ids, labels=ids).loss
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, grads, list(log)


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic=True", "automatic"])
def test_gpt2_over_lengths_captures_once_per_dynamo_graph(dynamic: bool | None) -> None:
    eager_model = logged_gpt2(LAYERS)
    model = copy.deepcopy(eager_model)
    losses, grads, log = train(eager_model, eager_model)
    with Made() as made:
        compiled = torch.compile(model, backend="effectfx", dynamic=dynamic)
        got_losses, got_grads, got_log = train(model, compiled)
    assert log == [("record_memory", f"layer{i}") for i in range(LAYERS)] * len(LENGTHS)
    assert got_log == log
    assert got_losses == pytest.approx(losses, rel=1e-5)
    for step, (ge, gc) in enumerate(zip(grads, got_grads)):
        for name in ge:
            assert torch.allclose(ge[name], gc[name], rtol=1e-5, atol=1e-6), (step, name)
    compiles = [c.stats.compiles for c in made.callables]
    # dynamic=True: one symbolic graph; automatic: a static graph for the first length, then a symbolic one
    assert len(compiles) == (1 if dynamic else 2)
    assert all(n <= 2 for n in compiles), compiles
    assert sum(c.stats.calls for c in made.callables) == len(LENGTHS)
    symbolic = made.callables[-1]
    assert symbolic.stats.calls >= len(LENGTHS) - 1 and symbolic.stats.compiles == 1
    assert efx.explain(symbolic).programs[0].symbolic  # the lengths are symbols, not constants


def sizes_and_scale(x: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    torch.ops.efxtest.record_memory("f")
    return (x.sin() * scale).sum() + torch.arange(n, dtype=x.dtype).sum() * x.mean() + scale


def test_int_size_and_float_arguments() -> None:
    """``n`` is a size no tensor has: passed as a carrier and read from it (one capture for every ``n``);
    ``scale`` reaches the graph as a tensor Dynamo ``.item()``s: a number again, specialized by value."""
    calls = [(3, 0.5), (4, 0.5), (5, 1.5), (6, 1.5)]
    with Made() as made:
        compiled = torch.compile(sizes_and_scale, backend="effectfx", dynamic=True)
        for n, scale in calls:
            x = torch.randn(n + 2, requires_grad=True)
            with recording() as log:
                got = compiled(x, n, scale)
                (got_grad,) = torch.autograd.grad(got, x)
            y = x.detach().requires_grad_()
            with recording() as eager_log:
                expected = sizes_and_scale(y, n, scale)
                (grad,) = torch.autograd.grad(expected, y)
            assert log == eager_log == [("record_memory", "f")]
            assert torch.allclose(got, expected) and torch.allclose(got_grad, grad)
    (callable_,) = made.callables
    assert callable_.stats.compiles == 2  # one per value of scale; none per n or per length of x
