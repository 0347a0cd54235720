"""Promotion (Note [Region identity]): a region call whose tensor arguments need no gradient, while another
of its tensors does, shares the body of calls whose arguments need one -- the first layer of a stack, or of
a model fine-tuned with frozen embeddings -- unless that body could not be eager's for it."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx.testing import check_against_eager, recording
from effectfx.testing import effect_ops as R


def bodies_of(prog) -> int:
    return len(prog.forward.regions)


class Named(nn.Module):
    def __init__(self, name: str, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.name = name
        self.gain = 1.0

    @efx.region
    def forward(self, x):
        torch.ops.efxtest.record_memory(self.name)
        return torch.relu(self.lin(x)) * self.gain


def stack(cls=Named, n: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[cls(f"layer{i}") for i in range(n)])


def test_a_first_layer_whose_input_needs_no_grad_shares_the_body() -> None:
    model = stack()
    x = torch.randn(2, 4)
    check_against_eager(model, x)
    prog = efx.capture(model, x)
    assert bodies_of(prog) == 1
    explained = efx.explain(model, x).regions["Named.forward"]
    assert len(explained.bodies) == 1 and explained.calls == 3


def test_promotion_golden() -> None:
    """The first call passes its input without a gradient to the shared backward's variant that does not
    compute it (``_skip0``); the others call the backward itself."""
    prog = efx.capture(stack(n=2), torch.randn(2, 4))
    backward = prog.backward.code()
    assert "named_forward_subgraph0_backward_skip0 = self.Named_forward_subgraph0_backward_skip0" in backward
    calls = [line.split("(")[1].split(",")[0] for line in backward.splitlines()
             if "= effectfx.ops.invoke_subgraph(" in line]
    assert calls == ["named_forward_subgraph0_backward", "named_forward_subgraph0_backward_skip0"]
    # the input's gradient (``mm(threshold_backward, t_1)`` in the backward itself) is not computed
    skip = backward.split("# Named_forward_subgraph0_backward_skip0: 'subgraph_0'\n")[1]
    assert skip == textwrap.dedent("""\
        def Named_forward_subgraph0_backward_skip0(self, x, t, detach, tangent_0):
            mul = torch.ops.aten.mul.Tensor(tangent_0, 1.0)
            detach_1 = torch.ops.aten.detach.default(detach)
            threshold_backward = torch.ops.aten.threshold_backward.default(mul, detach_1, 0)
            t_1 = torch.ops.aten.t.default(threshold_backward)
            mm = torch.ops.aten.mm.default(t_1, x)
            t_2 = torch.ops.aten.t.default(mm)
            sum_1 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True)
            view = torch.ops.aten.view.default(sum_1, [4])
            t_3 = torch.ops.aten.t.default(t_2)
            return (None, t_3, view)""")


class TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @efx.region
    def forward(self, x):
        torch.ops.efxtest.record_memory("two")
        return self.lin(x), x * 2  # the second output reaches the input only


@pytest.mark.parametrize("x_grad", [False, True])
def test_an_output_only_a_promoted_input_reaches_does_not_require_grad(x_grad: bool) -> None:
    torch.manual_seed(0)
    layer = TwoOutputs()

    def f(x):
        a, b = layer(x)
        c, d = layer(a)
        return a, b, c, d

    x = torch.randn(2, 4, requires_grad=x_grad)
    check_against_eager(f, x)
    got = efx.compile(f)(x)
    assert [t.requires_grad for t in got] == [t.requires_grad for t in f(x)] == [True, x_grad, True, True]


class ReadsRequiresGrad(Named):
    @efx.region
    def forward(self, x):
        torch.ops.efxtest.record_memory(self.name)
        return self.lin(x) * (2.0 if x.requires_grad else 3.0)


class BackwardEffect(Named):
    @efx.region
    def forward(self, x):
        return R.scale(self.lin(x), 0.5)  # its backward records ("grad", 0.5): only if x needs the gradient?


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class CustomFunction(Named):
    @efx.region
    def forward(self, x):
        return self.lin(Square.apply(x))


class UpdatesInput(Named):
    @efx.region
    def forward(self, x):
        x.mul_(2)
        return self.lin(x)


class PrintsIntermediate(Named):
    @efx.region
    def forward(self, x):
        h = self.lin(x) @ torch.eye(4)  # needs a gradient through the weight: its grad_fn is printed
        print("twice", x * 2)  # x * 2 shows a grad_fn exactly where x requires grad
        return h


@pytest.mark.parametrize(("cls", "why"), [
    (PrintsIntermediate, "reads a tensor's autograd state"),
    (ReadsRequiresGrad, "reads a tensor's autograd state"),
    (BackwardEffect, "its backward has effects"),
    (CustomFunction, "torch.autograd.Function"),
])
def test_a_body_that_could_not_be_eager_s_keeps_its_own(cls, why: str) -> None:
    model = stack(cls)
    x = torch.randn(2, 4)
    check_against_eager(model, x)
    assert bodies_of(efx.capture(model, x)) == 2
    text = str(efx.explain(model, x))
    assert why in text and "requires_grad False -> True" in text


def test_a_body_updating_its_input_keeps_its_own() -> None:
    model = stack(UpdatesInput)
    x = torch.randn(2, 4)

    def f(x):
        return model(x.clone())

    check_against_eager(f, x)
    assert bodies_of(efx.capture(f, x)) == 2


def test_a_frozen_embedding_model_trains_with_one_body() -> None:
    """Fine-tuning with frozen embeddings: the first layer's input needs no gradient, the others' do."""
    hf = pytest.importorskip("effectfx.testing.hf")
    model = hf.build("gpt2")
    model.transformer.wte.requires_grad_(False)
    model.transformer.wpe.requires_grad_(False)
    eager = copy.deepcopy(model)
    compiled = efx.compile(model)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, hf.VOCAB, (2, 8), generator=g)
        with recording() as got_log:
            got = compiled(ids, labels=ids).loss
            got.backward()
        with recording() as want_log:
            want = eager(ids, labels=ids).loss
            want.backward()
        torch.testing.assert_close(got, want)
        assert got_log == want_log
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    region = efx.explain(compiled).programs[0].regions
    assert [len(r.bodies) for r in region] == [1]


def test_a_changed_attribute_of_a_layer_that_reused_a_body_is_seen() -> None:
    """Every call site's reads are its caller's guards, also where no trace ran (layers after the first):
    renaming the last layer logs the new name, changing its gain changes its output."""
    model = stack()
    compiled = efx.compile(model)
    x = torch.randn(2, 4, requires_grad=True)
    for name, gain in (("layer2", 1.0), ("renamed", 1.0), ("renamed", 0.5)):
        model[2].name, model[2].gain = name, gain
        with recording() as want:
            expected = model(x)
        with recording() as got:
            out = compiled(x)
        assert got == want
        torch.testing.assert_close(out, expected)
    assert compiled.stats.compiles == 3


@efx.region
def _inner(a, b):
    torch.ops.efxtest.record_memory("inner")
    return a * 3, b * 2  # the first result reaches ``a`` only


@efx.region
def _outer(a, b):
    return _inner(a, b)[0]


def test_an_output_reaching_only_a_promoted_input_through_a_nested_region() -> None:
    """A nested region call's autograd node has an edge to every operand: the walk follows only those its
    output reaches (a fuzz find: the outer result required grad where eager's did not)."""
    def f(x, w):
        return _outer(x, w), _inner(w, x)[0]

    check_against_eager(f, torch.randn(2, 3), torch.randn(2, 3, requires_grad=True))
    got = efx.compile(f)(torch.randn(2, 3), torch.randn(2, 3, requires_grad=True))
    assert [t.requires_grad for t in got] == [False, True]


class ReadsRequiresGradLater(Named):
    @efx.region
    def forward(self, x):
        return self.lin(x) * (2.0 if x.requires_grad else 3.0)


def test_a_body_traced_where_nothing_was_promoted_is_checked_too() -> None:
    """The body of the call whose input needs a gradient comes first; a later call whose input needs none
    must not reuse it when it read autograd state (the checks run on every body, not only promoted traces)."""
    torch.manual_seed(0)
    layer = ReadsRequiresGradLater("layer")
    check_against_eager(lambda x, y: (layer(x), layer(y)), torch.randn(2, 4, requires_grad=True),
                        torch.randn(2, 4))


@efx.region
def _reads_requires_grad(x, w):
    return x * w * (2.0 if x.requires_grad else 3.0)


@efx.region
def _calls_the_reader(x, w):
    return _reads_requires_grad(x, w) + 1


def test_a_nested_body_reused_inside_a_promoted_trace_counts() -> None:
    """The nested body was traced before (with an argument that needed a gradient); the outer promoted
    trace reuses it, so its reads happened in no trace of the outer's: each of its calls reports them."""
    w = torch.randn(4, requires_grad=True)

    def f(x, y):
        return _reads_requires_grad(x, w), _calls_the_reader(y, w)

    check_against_eager(f, torch.randn(4, requires_grad=True), torch.randn(4))


class TwoUses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    @efx.region
    def forward(self, x):
        return torch.tanh(self.a(x)) * self.b(x) + x  # two casts of x, or one cached: autocast caches leaves


@pytest.mark.parametrize("kind", ["no grad", "leaf", "computed"])
def test_autocast_casts_the_input_as_eager_does(kind: str) -> None:
    """Autocast caches its cast of a leaf that requires grad: a body traced with a leaf input casts it once
    (its gradients summed in bfloat16), eager's later layers cast per use. Leaf-ness is part of a body's
    identity under autocast, and nothing is promoted there."""
    torch.manual_seed(0)
    model = nn.Sequential(TwoUses(), TwoUses(), TwoUses())

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x * 1.0 if kind == "computed" else x).float()

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).requires_grad_(kind != "no grad")
    check_against_eager(f, x, forms=())
    if kind == "no grad":
        assert "autocast is on" in str(efx.explain(f, x))
