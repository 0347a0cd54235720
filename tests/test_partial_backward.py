# ruff: noqa: E501  (golden graph text has long lines)
"""A backward that reaches some outputs only (Note [Partial backward]): eager's engine never runs the
autograd formulas of an output nothing used -- nor their effects -- and leaves the gradient of an input
only that output reaches at None.  effectfx traces such a backward anew for exactly the outputs that got a
gradient, for a region's results inside a capture and for a compiled program's results at run time."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx.testing import check_against_eager, recording
from effectfx.testing.differential import check_mutations_against_eager, fresh_args

R = torch.ops.efxtest


@efx.region
def scaled_and_squared(x):
    R.record_memory("fwd")
    return R.scale(x, 0.5), x * x


def second_only(x):
    return scaled_and_squared(x)[1].sin()


PARTIAL_BACKWARD = '''
def forward(self, x, getitem_1, tangent_0):
    cos = torch.ops.aten.cos.default(getitem_1)
    mul = torch.ops.aten.mul.Tensor(tangent_0, cos)
    scaled_and_squared_subgraph0_backward_01 = self.scaled_and_squared_subgraph0_backward_01
    invoke_subgraph = effectfx.ops.invoke_subgraph(scaled_and_squared_subgraph0_backward_01, 'subgraph_0', x, mul)
    getitem = invoke_subgraph[0]
    return (getitem,)

# scaled_and_squared_subgraph0_backward_01: 'subgraph_0'
def scaled_and_squared_subgraph0_backward_01(self, x, tangent_0):
    mul_1 = torch.ops.aten.mul.Tensor(tangent_0, x)
    mul_2 = torch.ops.aten.mul.Tensor(tangent_0, x)
    add = torch.ops.aten.add.Tensor(mul_2, mul_1)
    return (add,)
'''


def x_grad(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).requires_grad_()


def test_region_partial_backward_golden() -> None:
    # the region's backward for its second result only: efxtest::scale's backward (and its effect) is gone
    prog = efx.capture(second_only, x_grad(2, 3))
    assert prog.backward.code() == PARTIAL_BACKWARD.strip("\n")


def test_unused_region_result_runs_no_backward_effect() -> None:
    result = check_against_eager(second_only, x_grad(2, 3))
    assert result.log == [("record_memory", "fwd")]


@efx.region
def inner(x):
    return R.scale(x, 2.0), R.scale(x.cos(), 3.0)


@efx.region
def outer(x):
    a, b = inner(x)
    return a * 2, b + 1, R.scale(x, 4.0)


@pytest.mark.parametrize("use", [(0,), (1,), (2,), (0, 2), (1, 2), (0, 1, 2)])
def test_nested_regions_run_the_backward_of_what_was_used(use: tuple[int, ...]) -> None:
    def f(x):
        outs = outer(x)
        return sum(outs[i].sum() for i in use)

    result = check_against_eager(f, x_grad(3))
    expected = {0: "grad 2.0", 1: "grad 3.0", 2: "grad 4.0"}
    assert sorted(e[1] for e in result.log) == sorted(expected[i] for i in use)


@efx.region
def _adds_into(target, xs):
    first = xs[0]
    target.add_(first)  # the caller's tensor now requires grad and has a history
    return first, R.scale(first, 2.0)


@efx.region
def _updates_then_uses_one(x, y):
    _, scaled = _adds_into(y, [x, x + x])  # its first result is unused: a partial backward of _adds_into
    return scaled


def test_retrace_sees_the_arguments_as_they_were_at_the_call() -> None:
    """A partial backward traces the body again (Note [Partial backward]) on the call site's arguments as
    they were when it was called: the forward wrote one in place since, which made it require grad."""
    check_mutations_against_eager(_updates_then_uses_one, fresh_args((x_grad(2, 3), torch.randn(2, 3))))
    prog = efx.capture(_updates_then_uses_one, x_grad(2, 3), torch.randn(2, 3))
    assert prog.region_traces == {"subgraph_0": 1, "subgraph_1": 1}  # the retrace reused the inner body


def test_input_reached_only_through_an_unused_result_gets_no_gradient() -> None:
    @efx.region
    def two(x, y):
        return x.sin(), R.scale(y, 0.5)

    def f(x, y):
        return two(x, y)[0]

    x, y = x_grad(3), x_grad(3)
    check_against_eager(f, x, y)
    with recording() as log:
        f(x, y).sum().backward()
    assert y.grad is None and log == []


def both(x, y):
    return R.scale(x, 0.5), x * y


@pytest.mark.parametrize("use", [0, 1])
def test_compiled_program_backward_of_one_output(use: int) -> None:
    x, y = x_grad(2, 3), x_grad(2, 3)
    with recording() as eager_log:
        both(x, y)[use].sum().backward()
    eager = (x.grad.clone(), None if y.grad is None else y.grad.clone())
    x.grad = y.grad = None
    compiled = efx.compile(both)
    for _ in range(2):  # the partial backward is traced once, then reused
        with recording() as log:
            compiled(x, y)[use].sum().backward()
        assert log == eager_log
        assert torch.equal(x.grad, eager[0])
        assert (y.grad is None) == (eager[1] is None)
        if eager[1] is not None:
            assert torch.equal(y.grad, eager[1])
        x.grad = y.grad = None
    assert compiled.stats.compiles == 1


def test_loss_of_a_model_output_with_logits() -> None:
    # a transformers-style result: the loss and the logits it came from; backward from the loss only
    lin = nn.Linear(4, 5)

    def model(x, target):
        logits = R.scale(lin(x), 0.5)
        return torch.nn.functional.cross_entropy(logits, target), logits

    x, target = torch.randn(3, 4), torch.tensor([0, 2, 4])
    with recording() as eager_log:
        model(x, target)[0].backward()
    eager = [p.grad.clone() for p in lin.parameters()]
    lin.zero_grad(set_to_none=True)
    with recording() as log:
        efx.compile(model)(x, target)[0].backward()
    assert log == eager_log == [("record_memory", "grad 0.5")]
    assert all(torch.equal(p.grad, g) for p, g in zip(lin.parameters(), eager))


def test_loaded_program_refuses_a_partial_backward() -> None:
    x, y = x_grad(2, 3), x_grad(2, 3)
    buf = io.BytesIO()
    efx.remove_effect_tokens(efx.capture(both, x, y)).save(buf)
    buf.seek(0)
    loaded = efx.load(buf)
    a, b = loaded(x, y)
    (a.sum() + b.sum()).backward()  # every output: runs
    with pytest.raises(efx.PartialBackwardError, match="Use every output in the loss"):
        loaded(x, y)[1].sum().backward()


def _loss_and_logits(x, w):
    logits = R.scale(x @ w, 2.0)
    return logits.logsumexp(-1).mean(), logits


def test_backward_of_a_loss_from_its_logits_needs_no_new_trace() -> None:
    # the loss's backward reaches the logits' own: the full backward with a zero tangent for the logits runs
    # exactly eager's formulas, so nothing is traced again -- also for a saved and loaded program
    x, w = torch.randn(3, 4), x_grad(4, 5)
    with recording() as eager_log:
        _loss_and_logits(x, w)[0].backward()
    eager = w.grad.clone()
    prog = efx.capture(_loss_and_logits, x, w)
    assert prog.covered_by == (frozenset(), frozenset({0}))  # the logits are reached from the loss
    buf = io.BytesIO()
    efx.remove_effect_tokens(prog).save(buf)
    buf.seek(0)
    compiled = efx.compile(_loss_and_logits)
    for run in (compiled, prog, efx.load(buf)):
        w.grad = None
        with recording() as log:
            run(x, w)[0].backward()
        assert log == eager_log and torch.equal(w.grad, eager)
    assert not prog.partial and not compiled.programs()[0].partial


_MODE = {"scale": 2.0}


def _flagged(x):
    return x.sin() * _MODE["scale"], x * 2  # a constant the forward reads: the retrace sees it too


def test_a_retrace_that_runs_another_forward_is_refused() -> None:
    """The backward of some outputs only is traced anew; when the state the code reads changed since the
    forward ran, the new trace's forward differs, and its backward would not be this forward's: an error,
    whether the program's graphs were simplified in place (efx.compile) or not."""
    x = torch.randn(3, requires_grad=True)
    for run in (efx.compile(_flagged), efx.capture(_flagged, x)):
        _MODE["scale"] = 2.0
        try:
            _, doubled = run(x)
            _MODE["scale"] = 3.0  # the same nodes and saved values; another constant
            with pytest.raises(efx.CaptureError, match="ran a different forward"):
                doubled.sum().backward()
        finally:
            _MODE["scale"] = 2.0
    _, doubled = efx.compile(_flagged)(x)  # unchanged state: the same forward, and eager's gradient
    doubled.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_in_place_simplification_is_the_copying_one() -> None:
    """efx.compile simplifies its own capture in place; the result prints as the copying pass's does."""
    from effectfx.passes.pipeline import run_passes
    from effectfx.passes.simplify import simplify_for_runtime, simplify_in_place
    from effectfx.passes.thread_tokens import discover_effects

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    copied = run_passes(efx.capture(model, x, functionalize=False), [discover_effects, simplify_for_runtime])
    captured = run_passes(efx.capture(model, x, functionalize=False), [discover_effects])
    assert "aten.detach" in captured.backward.code()  # something to simplify
    before = captured.forward.graph_module
    in_place = run_passes(captured, [simplify_in_place])
    assert in_place.forward.graph_module is before  # the same module, changed
    assert in_place.forward.code() == copied.forward.code() and in_place.backward.code() == copied.backward.code()
    assert "aten.detach" not in in_place.backward.code()
    assert in_place.forward.history[-1].name == "simplify_in_place"


class _HalfUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @efx.region
    def forward(self, x):
        y = self.lin(x)  # under autocast: a bfloat16 copy of the weight, which autocast caches
        return y.relu(), y * 2  # the second result is never used: a partial backward, traced again


def test_a_retrace_under_autocast_casts_the_weights_itself() -> None:
    """The retrace (Note [Partial backward]) must not pick up the first trace's cached cast of a weight: it
    was refused as a tensor the region did not receive (T5 training under autocast)."""
    torch.manual_seed(0)
    block = _HalfUsed()

    def inside(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return block(x)[0].float()

    check_against_eager(inside, torch.randn(2, 4))

    def outside(x):
        return block(x)[0].float()

    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.autograd.grad(outside(x).sum(), list(block.parameters()))
        got = torch.autograd.grad(efx.compile(outside)(x).sum(), list(block.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


@efx.region
def _sin_and_scaled(x):
    return x.sin(), R.scale(x, 0.5)  # the second result's formula records ("grad", 0.5)


def test_outputs_of_one_region_call_do_not_cover_each_other() -> None:
    """Two results of one region call share its autograd node, but not their formulas: a backward from the
    first runs none of the second's (eager logs nothing). The full backward with a zero gradient for the
    second ran its formula and logged ("grad", 0.5)."""
    def f(x):
        return _sin_and_scaled(x)

    x = x_grad(3)
    compiled = efx.compile(f)
    for call in (f, compiled, f):
        with recording() as log:
            out = call(x)[0]
            (grad,) = torch.autograd.grad(out.sum(), [x])
        assert log == []
        torch.testing.assert_close(grad, x.cos())


class _ReturnsItsInput(nn.Module):
    """Its input as is, and a layer of its detached copy (a fuzzed program's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return x, self.lin(x.detach())


@pytest.mark.parametrize("use", [0, 1])
def test_a_retrace_that_drops_a_detach_runs_the_same_forward(use: int) -> None:
    """A backward of one output keeps fewer ``detach`` nodes than the full one (no computation below
    autograd): it is the same forward, not refused, and its gradients are eager's."""
    torch.manual_seed(0)
    model, x = _ReturnsItsInput(), torch.randn(2, 4, requires_grad=True)
    wrt = (x,) if use == 0 else tuple(model.parameters())
    eager = torch.autograd.grad(model(x)[use].sum(), wrt)
    compiled = efx.compile(model)
    for _ in range(2):
        got = torch.autograd.grad(compiled(x)[use].sum(), wrt)
        assert all(torch.equal(a, b) for a, b in zip(got, eager))


@efx.region
def _named(lin: nn.Linear, x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    h = lin(x)
    R.log_tensor(h, name)
    return h, x * 2.0


class _Named(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.lin, self.name = nn.Linear(4, 4), name

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _named(self.lin, x, self.name)[0].relu()  # (the inner region's first result only)


def test_a_retrace_while_the_callers_backward_is_derived_keeps_labels_operands() -> None:
    """The inner region's partial backward is traced anew while the outer body's backward is derived, where
    autograd runs outside the label mode (``torch.autograd.grad`` goes through it): the retrace enters it
    again, so the name stays the operand the first trace made it, not a constant of another forward."""
    torch.manual_seed(0)
    model = nn.Sequential(_Named("a"), _Named("b"))
    eager = check_against_eager(model, x_grad(2, 4))
    assert [e[1] for e in eager.log] == ["a", "b"]
    compiled = efx.compile(model)
    compiled(x_grad(2, 4)).sum().backward()
    (prog,) = compiled.programs()
    assert "'subgraph_1', x, lin_weight, lin_bias, 'a')" in prog.forward.code()  # one inner body, 'a' passed
