"""Training with efx.compile: optimizer loops against eager from the same initialization, gradient
accumulation, retain_graph, torch.autograd.grad, and optimizer updates seen by the compiled module."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx.testing import recording

R = torch.ops.efxtest


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    @efx.region
    def forward(self, x):
        R.record_memory("block fwd")
        h = R.scale(torch.relu(self.lin(self.norm(x))), 0.9)  # backward records ("grad 0.9")
        return x + h


class Transformerish(nn.Module):
    def __init__(self, n_layers: int = 4, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        R.record_stdout("model in")
        for b in self.blocks:
            x = b(x)
        R.record_stdout("model out")
        return self.head(x)


def make_pair(n_layers: int = 4, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model = Transformerish(n_layers)
    return model, copy.deepcopy(model)


def assert_same_params(a: nn.Module, b: nn.Module, rtol: float = 1e-5) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=rtol, atol=1e-6), name


def train(model, call, opt_cls, steps: int = 3, **opt_kwargs) -> tuple[list[float], list[tuple]]:
    opt = opt_cls(model.parameters(), **opt_kwargs)
    g = torch.Generator().manual_seed(123)
    losses = []
    with recording() as log:
        for _ in range(steps):
            x = torch.randn(6, 8, generator=g)
            loss = call(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, list(log)


@pytest.mark.parametrize("opt_cls,kwargs", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                            (torch.optim.Adam, {"lr": 0.01})])
def test_three_step_training_loop_matches_eager(opt_cls, kwargs):
    eager_model, model = make_pair()
    cmodel = efx.compile(model)
    eager_losses, eager_log = train(eager_model, eager_model, opt_cls, **kwargs)
    losses, log = train(model, cmodel, opt_cls, **kwargs)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert log == eager_log
    assert len(log) == 3 * (2 + 4 + 4)  # per step: 2 top-level, 4 block forwards, 4 backward scales
    assert_same_params(eager_model, model)
    # parameters moved, and the compiled module saw the updates without recompiling
    assert cmodel.stats.compiles == 1
    assert cmodel.stats.calls == 3
    assert losses[0] != losses[-1]


def test_optimizer_updates_are_seen_by_the_cached_program():
    eager_model, model = make_pair(2, seed=1)
    cmodel = efx.compile(model)
    x = torch.randn(3, 8)
    with recording():
        before = cmodel(x).detach()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05)
            for p in eager_model.parameters():
                p.add_(0.05)
        after = cmodel(x)
        expected = eager_model(x)
    assert not torch.allclose(before, after)
    assert torch.allclose(after, expected, rtol=1e-5, atol=1e-6)
    assert cmodel.stats.compiles == 1


def test_gradient_accumulation_without_zero_grad():
    eager_model, model = make_pair(2, seed=2)
    cmodel = efx.compile(model)
    xs = [torch.randn(4, 8), torch.randn(4, 8)]
    with recording() as eager_log:
        for x in xs:
            eager_model(x).sum().backward()
    with recording() as log:
        for x in xs:
            cmodel(x).sum().backward()
    assert log == eager_log
    for (name, p), q in zip(eager_model.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name
    # accumulated: differs from the gradient of the second step alone
    single = copy.deepcopy(eager_model)
    single.zero_grad()
    with recording():
        single(xs[1]).sum().backward()
    assert not torch.allclose(single.head.weight.grad, model.head.weight.grad)


def test_retain_graph_backward_twice():
    eager_model, model = make_pair(2, seed=3)
    cmodel = efx.compile(model)
    x = torch.randn(4, 8)
    with recording() as eager_log:
        out = eager_model(x).sum()
        out.backward(retain_graph=True)
        out.backward()
    with recording() as log:
        out = cmodel(x).sum()
        out.backward(retain_graph=True)
        out.backward()
    assert log == eager_log
    assert [e for e in log if e == ("record_memory", "grad 0.9")] == [("record_memory", "grad 0.9")] * 4
    for (name, p), q in zip(eager_model.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name


def test_backward_twice_without_retain_graph_fails_like_eager():
    _, model = make_pair(1, seed=4)
    cmodel = efx.compile(model)
    with recording():
        out = cmodel(torch.randn(2, 8)).sum()
        out.backward()
        with pytest.raises(RuntimeError):
            out.backward()


def test_autograd_grad_wrt_input_and_parameters():
    eager_model, model = make_pair(2, seed=5)
    cmodel = efx.compile(model)
    x = torch.randn(3, 8)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    with recording() as eager_log:
        ge = torch.autograd.grad(eager_model(xe).sum(), [xe, eager_model.blocks[0].lin.weight])
    with recording() as log:
        gc = torch.autograd.grad(cmodel(xc).sum(), [xc, model.blocks[0].lin.weight])
    assert log == eager_log
    for a, b in zip(ge, gc):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    # autograd.grad does not accumulate into .grad
    assert all(p.grad is None for p in model.parameters())
    assert xc.grad is None


def test_double_use_of_compiled_output_accumulates_in_backward():
    eager_model, model = make_pair(1, seed=6)
    cmodel = efx.compile(model)
    x = torch.randn(2, 8)
    with recording() as eager_log:
        y = eager_model(x)
        (y * y + y).sum().backward()
    with recording() as log:
        y = cmodel(x)
        (y * y + y).sum().backward()
    assert log == eager_log
    for (name, p), q in zip(eager_model.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name


def test_compiled_function_closing_over_parameters():
    torch.manual_seed(7)
    w = torch.randn(4, 4, requires_grad=True)

    @efx.region
    def layer(x, w):
        R.record_memory("layer")
        return R.scale(torch.tanh(x @ w), 2.0)

    def f(x):
        return layer(layer(x, w), w).sum()

    x = torch.randn(3, 4)
    with recording() as eager_log:
        f(x).backward()
    expected = w.grad.clone()
    w.grad = None
    cf = efx.compile(f)
    with recording() as log:
        cf(x).backward()
    assert log == eager_log
    assert torch.allclose(w.grad, expected, rtol=1e-5, atol=1e-6)
