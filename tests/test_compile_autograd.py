"""efx.compile under autograd: outputs, gradients of inputs and parameters, forward and backward
effect logs against eager, for every scenario the issue lists; plus the structure that makes them right
(one forward and one backward body per region cache key, effects in the graph of their phase)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx import ops
from effectfx.testing import check_against_eager
from effectfx.testing.effect_ops import LOG

R = torch.ops.efxtest


def leaf_input(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_()


def phased_log(fn, *args) -> tuple[list[tuple], list[tuple], torch.Tensor]:
    """Run fn forward then backward; return (effects of forward, effects of backward, output)."""
    start = len(LOG)
    try:
        out = fn(*args)
        mid = len(LOG)
        out.backward(torch.linspace(-1, 2, out.numel()).reshape(out.shape))
        return list(LOG[start:mid]), list(LOG[mid:]), out
    finally:
        del LOG[start:]


def check_phases(fn, *args, make_args=None) -> tuple[list[tuple], list[tuple]]:
    """Eager and compiled give the same forward log, the same backward log and the same input grads;
    forward effects are never replayed in backward."""
    make_args = make_args or (lambda: tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args))
    eager_args, comp_args = make_args(), make_args()
    ef, eb, eout = phased_log(fn, *eager_args)
    cf, cb, cout = phased_log(efx.compile(fn), *comp_args)
    assert cout.grad_fn is not None
    assert torch.allclose(eout, cout, rtol=1e-5, atol=1e-6)
    assert cf == ef, f"forward effects differ:\n eager {ef}\n compiled {cf}"
    assert cb == eb, f"backward effects differ:\n eager {eb}\n compiled {cb}"
    for a, b in zip(eager_args, comp_args):
        if a.requires_grad:
            assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    return ef, eb


def graph_effects(gm: torch.fx.GraphModule) -> list[str]:
    """Labels of the effectful ops in a graph and the bodies it calls, in call order (any form)."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target, args = node.target, node.args
        if target is ops.with_effects:
            target, args = args[1], args[2:]
        if target is ops.invoke_subgraph:
            found += graph_effects(getattr(gm, args[0].target))
        elif efx.effect_of(target) is not None:
            found.append(str(target))
    return found


def only_program(cfn) -> efx.TrainingProgram:
    (prog,) = cfn.programs()
    assert isinstance(prog, efx.TrainingProgram)
    return prog


# -- scenarios ------------------------------------------------------------------------------------
@efx.region
def twice_region(x):
    R.record_memory("twice")
    R.log_tensor(x, "operand")
    return x.sin() * x


def test_region_called_twice():
    f = lambda x: twice_region(x) * twice_region(x + 1)  # noqa: E731
    x = leaf_input(4)
    check_against_eager(f, x)
    fwd, bwd = check_phases(f, x)
    assert len(fwd) == 4 and bwd == []
    cf = efx.compile(f)
    cf(x)
    prog = only_program(cf)
    assert prog.forward.region_traces == {"subgraph_0": 1}
    assert prog.backward.region_traces == {"subgraph_0": 1}
    assert graph_effects(prog.backward.graph_module) == []


def test_chained_region_keeps_grad_fn_and_both_effects():
    # torch.compile loses an effect or the grad_fn here
    f = lambda x: twice_region(twice_region(x))  # noqa: E731
    x = leaf_input(3, seed=1)
    check_against_eager(f, x)
    fwd, bwd = check_phases(f, x)
    assert [e[0] for e in fwd] == ["record_memory", "log_tensor"] * 2
    out = efx.compile(f)(x)
    assert out.requires_grad and out.grad_fn is not None


def test_loop_of_eight_layers_with_top_level_effects():
    def f(x):
        R.record_stdout("begin")
        for i in range(8):
            x = twice_region(x) + 0.1
            R.record_collective_tp(f"after layer {i}")
        R.record_memory("end")
        return x

    x = leaf_input(2, 2, seed=2)
    check_against_eager(f, x)
    fwd, bwd = check_phases(f, x)
    assert len(fwd) == 2 + 8 * 3 and bwd == []
    cf = efx.compile(f)
    cf(x)
    prog = only_program(cf)
    assert prog.forward.region_traces == prog.backward.region_traces == {"subgraph_0": 1}


@efx.region
def inner(x):
    R.record_memory("inner")
    return R.scale(torch.tanh(x), 3.0)  # backward records ("grad 3.0")


@efx.region
def outer(x):
    R.record_stdout("outer")
    return inner(x) * inner(x * 2)


def test_nested_regions():
    def f(x):
        R.record_memory("top")
        return outer(outer(x))

    x = leaf_input(3, seed=3)
    check_against_eager(f, x)
    fwd, bwd = check_phases(f, x)
    assert bwd == [("record_memory", "grad 3.0")] * 4
    cf = efx.compile(f)
    cf(x)
    prog = only_program(cf)
    # nesting is kept in both graphs: outer's body calls inner's body, forward and backward
    assert prog.forward.region_traces == {"subgraph_0": 1, "subgraph_1": 1}
    assert prog.backward.region_traces == {"subgraph_0": 1, "subgraph_1": 1}
    for half, suffix in ((prog.forward, ""), (prog.backward, "_backward")):
        outer_body = half.subgraphs()["outer_subgraph0" + suffix]
        inner_calls = [n for n in outer_body.graph.nodes if n.op == "call_function" and
                       ops.invoke_subgraph in (n.target, *n.args[1:2])]
        assert len(inner_calls) == 2, outer_body.code


@efx.region
def two_keys(x):
    R.record_memory("m")
    R.record_stdout("s")
    y = R.bump(x, "b")
    R.record_memory("m2")
    return y * x


def test_region_with_two_effect_keys():
    f = lambda x: two_keys(two_keys(x))  # noqa: E731
    x = leaf_input(3, seed=4)
    check_against_eager(f, x)
    fwd, bwd = check_phases(f, x)
    assert len(fwd) == 8 and bwd == []
    prog = efx.capture(f, x)
    assert prog.forward.region_effects == {"subgraph_0": frozenset({"memory", "stdout"})}


@efx.region
def backward_only(x):
    return R.scale(x * x, 0.5)


def test_effect_only_in_a_regions_backward():
    f = lambda x: backward_only(backward_only(x) + 1)  # noqa: E731
    x = leaf_input(3, seed=5)
    check_against_eager(f, x)
    fwd, bwd = check_phases(f, x)
    assert fwd == [] and bwd == [("record_memory", "grad 0.5")] * 2
    cf = efx.compile(f)
    cf(x)
    prog = only_program(cf)
    assert graph_effects(prog.forward.graph_module) == []
    assert graph_effects(prog.backward.graph_module) == ["efxtest.record_memory.default"] * 2
    functional = efx.capture(f, x)
    assert functional.forward.token_keys == ()
    assert functional.backward.token_keys == ("memory",)
    assert functional.backward.region_effects == {"subgraph_0": frozenset({"memory"})}


@efx.region
def effect_only(x):
    R.log_tensor(x, "effect only")
    return x * 5


def test_effect_only_region_under_autograd():
    def f(x):
        effect_only(x)  # output unused
        y = x.exp()
        effect_only(y)  # output unused
        return y * 2

    x = leaf_input(3, seed=6)
    check_against_eager(f, x)
    fwd, bwd = check_phases(f, x)
    assert [e[1] for e in fwd] == ["effect only"] * 2 and bwd == []


def test_forward_and_backward_effects_of_one_key_are_ordered():
    def f(x):
        R.record_memory("forward 1")
        y = backward_only(x)
        R.record_memory("forward 2")
        return R.scale(y, 4.0)

    x = leaf_input(2, seed=7)
    check_against_eager(f, x)
    fwd, bwd = check_phases(f, x)
    assert fwd == [("record_memory", "forward 1"), ("record_memory", "forward 2")]
    assert bwd == [("record_memory", "grad 4.0"), ("record_memory", "grad 0.5")]


def test_non_differentiable_and_integer_outputs():
    @efx.region
    def mixed(x):
        R.record_memory("mixed")
        return x * 2, x.argmax(), x.detach() + 1

    def f(x):
        a, idx, c = mixed(x)
        return a.sum() + c.sum(), idx

    x = leaf_input(4, seed=8)
    check_against_eager(f, x)
    loss, idx = efx.compile(f)(x)
    assert loss.grad_fn is not None and not idx.requires_grad


# -- modules with parameters ------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    @efx.region
    def forward(self, x):
        R.record_memory("block")
        return R.scale(torch.relu(self.lin(x)), 1.5) + x


class Stack(nn.Module):
    def __init__(self, n: int = 16, d: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_sixteen_blocks_input_requires_grad_share_one_body():
    torch.manual_seed(0)
    model = Stack(16)
    x = leaf_input(2, 4, seed=9)
    check_against_eager(model, x)
    cm = efx.compile(model)
    cm(x)
    prog = only_program(cm)
    assert prog.forward.region_traces == {"subgraph_0": 1}
    assert prog.backward.region_traces == {"subgraph_0": 1}
    assert len(prog.forward.subgraphs()) == 1 and len(prog.backward.subgraphs()) == 1
    assert graph_effects(prog.forward.graph_module) == ["efxtest.record_memory.default"] * 16
    assert graph_effects(prog.backward.graph_module) == ["efxtest.record_memory.default"] * 16


def test_sixteen_blocks_input_without_grad_one_body_per_cache_key():
    torch.manual_seed(1)
    model = Stack(16)
    x = torch.randn(2, 4)
    eager = check_against_eager(model, x)
    assert len(eager.grads) == 32  # every parameter got compared
    cm = efx.compile(model)
    cm(x)
    prog = only_program(cm)
    # block 0 sees an input that does not require grad: a different cache key, so at most two bodies
    for half in (prog.forward, prog.backward):
        assert set(half.region_traces.values()) == {1}
        assert len(half.region_traces) in (1, 2)
        assert len(half.subgraphs()) == len(half.region_traces)
    body_keys = {b.key for b in prog.forward.bodies}
    assert len(body_keys) == len(prog.forward.region_traces)


def test_parameter_gradients_match_eager():
    torch.manual_seed(2)
    model = Stack(3)
    twin = Stack(3)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(5, 4)
    check_phases_model = efx.compile(twin)
    start = len(LOG)
    model(x).pow(2).sum().backward()
    eager_log = LOG[start:]
    del LOG[start:]
    check_phases_model(x).pow(2).sum().backward()
    comp_log = LOG[start:]
    del LOG[start:]
    assert comp_log == eager_log
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert q.grad is not None, name
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("n", [1, 4])
def test_capture_gives_a_training_program_with_one_backward_body(n):
    model = Stack(n)
    x = leaf_input(2, 4)
    prog = efx.capture(model, x)
    assert isinstance(prog, efx.TrainingProgram)
    assert prog.forward.region_traces == prog.backward.region_traces == {"subgraph_0": 1}
    out = prog(x)
    assert out.grad_fn is not None


# -- gradients laid out unlike their outputs ------------------------------------------------------------
_W = torch.randn(4, 4, generator=torch.Generator().manual_seed(3)).requires_grad_()


@efx.region
def _transposed(x):
    R.record_memory("transposed")
    return (x @ _W).transpose(0, 1)  # a view: its backward views the gradient as the forward laid it out


def test_a_region_returning_a_transposed_view_takes_its_caller_s_gradient() -> None:
    """The caller's formula (mul's) hands the region a contiguous gradient for its transposed result: the
    backward graphs take contiguous gradients, and the call site makes them so (a ConvNeXt block failed
    here with a raw RuntimeError from ``aten.view`` in the region's backward)."""
    def f(x):
        return (_transposed(x) * 2).sum(), _transposed(x.flip(0)).mean(1)

    check_against_eager(f, leaf_input(2, 3, 4))
    check_against_eager(f, torch.randn(2, 3, 4))


def test_golden_a_transposed_gradient_is_made_contiguous_at_the_call_site() -> None:
    """The caller transposes the region's transposed result back: the gradient it hands the region is a
    transposed view, copied contiguous in the caller's backward graph before the region's backward call."""
    def f(x):
        return (_transposed(x).transpose(0, 1) * 2).sum()

    check_against_eager(f, leaf_input(2, 3, 4))
    root = efx.capture(f, leaf_input(2, 3, 4)).backward.code().split("\n\n# ")[0]
    assert root == textwrap.dedent("""\
        def forward(self, lifted, getitem_1, tangent_0):
            expand = torch.ops.aten.expand.default(tangent_0, [2, 3, 4])
            mul_1 = torch.ops.aten.mul.Tensor(expand, 2)
            transpose_1 = torch.ops.aten.transpose.int(mul_1, 0, 1)
            clone = torch.ops.aten.clone.default(transpose_1, memory_format = torch.contiguous_format)
            _transposed_subgraph0_backward = self._transposed_subgraph0_backward
            invoke_subgraph = effectfx.ops.invoke_subgraph(_transposed_subgraph0_backward, 'subgraph_0', lifted, getitem_1, clone)
            getitem = invoke_subgraph[0]
            getitem_2 = invoke_subgraph[1]
            return (getitem, getitem_2)""")  # noqa: E501  (golden graph text)


def test_a_transposed_output_of_the_compiled_function_takes_any_gradient() -> None:
    def f(x):
        return (x @ _W).transpose(0, 1)

    x = leaf_input(2, 3, 4)
    compiled = efx.compile(f)
    for grad in (torch.randn(3, 2, 4), torch.randn(4, 2, 3).permute(2, 1, 0)):
        want = torch.autograd.grad(f(x), [x, _W], grad)
        got = torch.autograd.grad(compiled(x), [x, _W], grad)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
