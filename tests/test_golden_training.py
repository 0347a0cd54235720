# ruff: noqa: E501  (golden graph text has long lines)
"""Golden tests of training programs: the forward and backward programs of a 2-block module and of a
chained function region, in the functionalized form (tokens threaded in both) and the captured form.

The structure we promise: the forward region subgraph returns ``(*tokens, *outs, *saved)``; the backward
subgraph takes ``(*tokens, *saved, *tangents)`` and returns ``(*tokens, *grads)``; one forward and one
backward body shared by every call; forward effects in the forward graph only, effects raised by autograd
formulas (``efxtest::scale``'s backward) in the backward graph, threaded by backward tokens.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx import ops
from effectfx.effects import effect_of
from effectfx.errors import CaptureError
from effectfx.testing import check_against_eager, recording

R = torch.ops.efxtest


class Block(nn.Module):
    def __init__(self, d: int = 2) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    @efx.region
    def forward(self, x):
        R.record_memory("block")
        return R.scale(torch.relu(self.lin(x)), 0.5)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        R.record_stdout("stack")
        for b in self.blocks:
            x = b(x)
        return x


@efx.region
def r(x):
    R.record_memory("fwd")
    return R.scale(x.sin(), 2.0)


def chain(x):
    return r(r(x))



STACK_FORWARD = '''
def forward(self, token_memory, token_stdout, x, blocks_0_lin_weight, blocks_0_lin_bias, blocks_1_lin_weight, blocks_1_lin_bias):
    with_effects = effectfx.ops.with_effects(token_stdout, torch.ops.efxtest.record_stdout.default, 'stack')
    getitem = with_effects[0]
    block_forward_subgraph0 = self.Block_forward_subgraph0
    invoke_subgraph = effectfx.ops.invoke_subgraph(block_forward_subgraph0, 'subgraph_0', token_memory, x, blocks_0_lin_weight, blocks_0_lin_bias)
    getitem_1 = invoke_subgraph[0]
    getitem_2 = invoke_subgraph[1]
    getitem_3 = invoke_subgraph[2]
    getitem_4 = invoke_subgraph[3]
    invoke_subgraph_1 = effectfx.ops.invoke_subgraph(block_forward_subgraph0, 'subgraph_0', getitem_1, getitem_2, blocks_1_lin_weight, blocks_1_lin_bias)
    getitem_5 = invoke_subgraph_1[0]
    getitem_6 = invoke_subgraph_1[1]
    getitem_7 = invoke_subgraph_1[2]
    getitem_8 = invoke_subgraph_1[3]
    return (getitem_5, getitem, getitem_6, x, getitem_2, getitem_3, getitem_4, getitem_7, getitem_8)

# Block_forward_subgraph0: 'subgraph_0'
def Block_forward_subgraph0(self, token, x, lin_weight, lin_bias):
    with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.record_memory.default, 'block')
    getitem = with_effects[0]
    t = torch.ops.aten.t.default(lin_weight)
    addmm = torch.ops.aten.addmm.default(lin_bias, x, t)
    relu = torch.ops.aten.relu.default(addmm)
    detach = torch.ops.aten.detach.default(relu)
    scale = torch.ops.efxtest.scale.default(relu, 0.5)
    return (getitem, scale, t, detach)
'''

STACK_BACKWARD = '''
def forward(self, token, x, getitem, getitem_1, getitem_2, getitem_4, getitem_5, tangent_0):
    block_forward_subgraph0_backward = self.Block_forward_subgraph0_backward
    invoke_subgraph = effectfx.ops.invoke_subgraph(block_forward_subgraph0_backward, 'subgraph_0', token, getitem, getitem_4, getitem_5, tangent_0)
    getitem_6 = invoke_subgraph[0]
    getitem_7 = invoke_subgraph[1]
    getitem_8 = invoke_subgraph[2]
    getitem_9 = invoke_subgraph[3]
    invoke_subgraph_1 = effectfx.ops.invoke_subgraph(block_forward_subgraph0_backward, 'subgraph_0', getitem_6, x, getitem_1, getitem_2, getitem_7)
    getitem_10 = invoke_subgraph_1[0]
    getitem_11 = invoke_subgraph_1[1]
    getitem_12 = invoke_subgraph_1[2]
    getitem_13 = invoke_subgraph_1[3]
    return (getitem_10, getitem_11, getitem_12, getitem_13, getitem_8, getitem_9)

# Block_forward_subgraph0_backward: 'subgraph_0'
def Block_forward_subgraph0_backward(self, token, x, t, detach, tangent_0):
    with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.record_memory.default, 'grad 0.5')
    getitem = with_effects[0]
    mul = torch.ops.aten.mul.Tensor(tangent_0, 0.5)
    detach_1 = torch.ops.aten.detach.default(detach)
    threshold_backward = torch.ops.aten.threshold_backward.default(mul, detach_1, 0)
    t_1 = torch.ops.aten.t.default(t)
    mm = torch.ops.aten.mm.default(threshold_backward, t_1)
    t_2 = torch.ops.aten.t.default(threshold_backward)
    mm_1 = torch.ops.aten.mm.default(t_2, x)
    t_3 = torch.ops.aten.t.default(mm_1)
    sum_1 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True)
    view = torch.ops.aten.view.default(sum_1, [2])
    t_4 = torch.ops.aten.t.default(t_3)
    return (getitem, mm, t_4, view)
'''

STACK_FORWARD_CAPTURED = '''
def forward(self, x, blocks_0_lin_weight, blocks_0_lin_bias, blocks_1_lin_weight, blocks_1_lin_bias):
    record_stdout = torch.ops.efxtest.record_stdout.default('stack')
    block_forward_subgraph0 = self.Block_forward_subgraph0
    invoke_subgraph = effectfx.ops.invoke_subgraph(block_forward_subgraph0, 'subgraph_0', x, blocks_0_lin_weight, blocks_0_lin_bias)
    getitem = invoke_subgraph[0]
    getitem_1 = invoke_subgraph[1]
    getitem_2 = invoke_subgraph[2]
    invoke_subgraph_1 = effectfx.ops.invoke_subgraph(block_forward_subgraph0, 'subgraph_0', getitem, blocks_1_lin_weight, blocks_1_lin_bias)
    getitem_3 = invoke_subgraph_1[0]
    getitem_4 = invoke_subgraph_1[1]
    getitem_5 = invoke_subgraph_1[2]
    return (getitem_3, x, getitem, getitem_1, getitem_2, getitem_4, getitem_5)

# Block_forward_subgraph0: 'subgraph_0'
def Block_forward_subgraph0(self, x, lin_weight, lin_bias):
    record_memory = torch.ops.efxtest.record_memory.default('block')
    t = torch.ops.aten.t.default(lin_weight)
    addmm = torch.ops.aten.addmm.default(lin_bias, x, t)
    relu = torch.ops.aten.relu.default(addmm)
    detach = torch.ops.aten.detach.default(relu)
    scale = torch.ops.efxtest.scale.default(relu, 0.5)
    return (scale, t, detach)
'''

STACK_BACKWARD_CAPTURED = '''
def forward(self, x, getitem, getitem_1, getitem_2, getitem_4, getitem_5, tangent_0):
    block_forward_subgraph0_backward = self.Block_forward_subgraph0_backward
    invoke_subgraph_2 = effectfx.ops.invoke_subgraph(block_forward_subgraph0_backward, 'subgraph_0', getitem, getitem_4, getitem_5, tangent_0)
    getitem_6 = invoke_subgraph_2[0]
    getitem_7 = invoke_subgraph_2[1]
    getitem_8 = invoke_subgraph_2[2]
    invoke_subgraph_3 = effectfx.ops.invoke_subgraph(block_forward_subgraph0_backward, 'subgraph_0', x, getitem_1, getitem_2, getitem_6)
    getitem_9 = invoke_subgraph_3[0]
    getitem_10 = invoke_subgraph_3[1]
    getitem_11 = invoke_subgraph_3[2]
    return (getitem_9, getitem_10, getitem_11, getitem_7, getitem_8)

# Block_forward_subgraph0_backward: 'subgraph_0'
def Block_forward_subgraph0_backward(self, x, t, detach, tangent_0):
    record_memory_1 = torch.ops.efxtest.record_memory.default('grad 0.5')
    mul = torch.ops.aten.mul.Tensor(tangent_0, 0.5)
    detach_1 = torch.ops.aten.detach.default(detach)
    threshold_backward = torch.ops.aten.threshold_backward.default(mul, detach_1, 0)
    t_1 = torch.ops.aten.t.default(t)
    mm = torch.ops.aten.mm.default(threshold_backward, t_1)
    t_2 = torch.ops.aten.t.default(threshold_backward)
    mm_1 = torch.ops.aten.mm.default(t_2, x)
    t_3 = torch.ops.aten.t.default(mm_1)
    sum_1 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True)
    view = torch.ops.aten.view.default(sum_1, [2])
    t_4 = torch.ops.aten.t.default(t_3)
    return (mm, t_4, view)
'''

CHAIN_FORWARD = '''
def forward(self, token, x):
    r_subgraph0 = self.r_subgraph0
    invoke_subgraph = effectfx.ops.invoke_subgraph(r_subgraph0, 'subgraph_0', token, x)
    getitem = invoke_subgraph[0]
    getitem_1 = invoke_subgraph[1]
    invoke_subgraph_1 = effectfx.ops.invoke_subgraph(r_subgraph0, 'subgraph_0', getitem, getitem_1)
    getitem_2 = invoke_subgraph_1[0]
    getitem_3 = invoke_subgraph_1[1]
    return (getitem_2, getitem_3, x, getitem_1)

# r_subgraph0: 'subgraph_0'
def r_subgraph0(self, token, x):
    with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.record_memory.default, 'fwd')
    getitem = with_effects[0]
    sin = torch.ops.aten.sin.default(x)
    scale = torch.ops.efxtest.scale.default(sin, 2.0)
    return (getitem, scale)
'''

CHAIN_BACKWARD = '''
def forward(self, token, x, getitem, tangent_0):
    r_subgraph0_backward = self.r_subgraph0_backward
    invoke_subgraph = effectfx.ops.invoke_subgraph(r_subgraph0_backward, 'subgraph_0', token, getitem, tangent_0)
    getitem_1 = invoke_subgraph[0]
    getitem_2 = invoke_subgraph[1]
    invoke_subgraph_1 = effectfx.ops.invoke_subgraph(r_subgraph0_backward, 'subgraph_0', getitem_1, x, getitem_2)
    getitem_3 = invoke_subgraph_1[0]
    getitem_4 = invoke_subgraph_1[1]
    return (getitem_3, getitem_4)

# r_subgraph0_backward: 'subgraph_0'
def r_subgraph0_backward(self, token, x, tangent_0):
    with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.record_memory.default, 'grad 2.0')
    getitem = with_effects[0]
    mul = torch.ops.aten.mul.Tensor(tangent_0, 2.0)
    cos = torch.ops.aten.cos.default(x)
    mul_1 = torch.ops.aten.mul.Tensor(mul, cos)
    return (getitem, mul_1)
'''


def strip(text: str) -> str:
    return text.strip("\n")


def x_grad(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).requires_grad_()


def token_keys_of(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    return tuple(gm.meta.get("effectfx_token_keys", ()))


def check_graph_tokens(gm: torch.fx.GraphModule, keys: tuple[str, ...]) -> None:
    """Per key one linear chain from the token input to the token output; no bare effectful op."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [n.name.startswith("token") for n in placeholders[: len(keys)]] == [True] * len(keys), gm.code
    current = dict(zip(keys, placeholders[: len(keys)]))
    seen = list(current.values())

    def advance(node: torch.fx.Node, index: int, key: str) -> None:
        users = [u for u in node.users if u.target is operator.getitem and u.args[1] == index]
        assert len(users) == 1, gm.code
        current[key] = users[0]
        seen.append(users[0])

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        assert effect_of(node.target) is None, gm.code
        if node.target is ops.with_effects:
            key = effect_of(node.args[1])
            assert node.args[0] is current[key], gm.code
            advance(node, 0, key)
        elif node.target is ops.invoke_subgraph:
            callee_keys = token_keys_of(getattr(gm, node.args[0].target))
            assert list(node.args[2: 2 + len(callee_keys)]) == [current[k] for k in callee_keys], gm.code
            for j, key in enumerate(callee_keys):
                advance(node, j, key)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert list(output.args[0][: len(keys)]) == [current[k] for k in keys], gm.code
    assert all(len(t.users) == 1 for t in seen), gm.code


def check_program_tokens(prog: efx.Program) -> None:
    check_graph_tokens(prog.graph_module, tuple(prog.token_keys))
    for gm in prog.subgraphs().values():
        check_graph_tokens(gm, token_keys_of(gm))


# -- goldens ----------------------------------------------------------------------------------------
def test_two_block_training_forward_golden():
    prog = efx.capture(Stack(), x_grad(1, 2))
    assert isinstance(prog, efx.TrainingProgram)
    assert prog.forward.code() == strip(STACK_FORWARD)
    assert prog.forward.token_keys == ("memory", "stdout")
    check_program_tokens(prog.forward)


def test_two_block_training_backward_golden():
    prog = efx.capture(Stack(), x_grad(1, 2))
    assert prog.backward.code() == strip(STACK_BACKWARD)
    assert prog.backward.token_keys == ("memory",)  # stdout is a forward-only effect
    check_program_tokens(prog.backward)


def test_two_block_training_captured_form_golden():
    prog = efx.capture(Stack(), x_grad(1, 2), functionalize=False)
    assert prog.forward.code() == strip(STACK_FORWARD_CAPTURED)
    assert prog.backward.code() == strip(STACK_BACKWARD_CAPTURED)


def test_chained_region_training_golden():
    prog = efx.capture(chain, x_grad(3))
    assert prog.forward.code() == strip(CHAIN_FORWARD)
    assert prog.backward.code() == strip(CHAIN_BACKWARD)
    check_program_tokens(prog.forward)
    check_program_tokens(prog.backward)


# -- the promised structure, independent of node names ------------------------------------------------
def test_region_bodies_signatures():
    prog = efx.capture(Stack(), x_grad(1, 2))
    (fwd_body,) = prog.forward.subgraphs().values()
    (bwd_body,) = prog.backward.subgraphs().values()
    fwd_in = [n.name for n in fwd_body.graph.nodes if n.op == "placeholder"]
    bwd_in = [n.name for n in bwd_body.graph.nodes if n.op == "placeholder"]
    assert fwd_in == ["token", "x", "lin_weight", "lin_bias"]
    fwd_out = next(n for n in fwd_body.graph.nodes if n.op == "output").args[0]
    n_returned = len(fwd_out) - 2  # token, the block's output, then the saved tensors it computed
    assert n_returned == 2  # of what eager saves (addmm's input and weight, relu's result), all but the input
    # backward body: token, saved (in the forward body's order, the input x first: each call site passes its
    # own operand), one tangent
    assert bwd_in[0] == "token" and bwd_in[1] == "x" and bwd_in[-1].startswith("tangent")
    assert len(bwd_in) == 1 + 3 + 1
    bwd_out = next(n for n in bwd_body.graph.nodes if n.op == "output").args[0]
    assert len(bwd_out) == 1 + 3  # token, grads of x, weight, bias
    # every call of the forward body feeds its saved tensors to the backward body of the same block
    fwd_calls = [n for n in prog.forward.graph_module.graph.nodes if n.target is ops.invoke_subgraph]
    bwd_calls = [n for n in prog.backward.graph_module.graph.nodes if n.target is ops.invoke_subgraph]
    assert len(fwd_calls) == len(bwd_calls) == 2
    assert prog.forward.region_traces == prog.backward.region_traces == {"subgraph_0": 1}


def test_effects_live_in_the_graph_of_their_phase():
    prog = efx.capture(Stack(), x_grad(1, 2))

    def labels(p: efx.Program) -> list:
        found = []
        for gm in (p.graph_module, *p.subgraphs().values()):
            found += [n.args[2:] for n in gm.graph.nodes if n.target is ops.with_effects]
        return found

    assert sorted(labels(prog.forward)) == [("block",), ("stack",)]
    assert labels(prog.backward) == [("grad 0.5",)]


def test_golden_programs_run_like_eager():
    torch.manual_seed(3)
    model = Stack()
    x = x_grad(4, 2)
    check_against_eager(model, x)
    check_against_eager(chain, x_grad(3))
    # the functionalized TrainingProgram itself, run through autograd
    twin = copy.deepcopy(model)
    prog = efx.capture(twin, x)
    with recording() as elog:
        model(x).sum().backward()
    expected_x_grad = x.grad.clone()
    x.grad = None
    with recording() as log:
        prog(x).sum().backward()
    assert log == elog
    assert torch.allclose(x.grad, expected_x_grad)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class _GradInside(nn.Module):
    """Two blocks sharing one body, and a gradient the captured code takes itself, before the program's
    own backward: the backward calls it makes belong to that gradient only."""

    def __init__(self, keep: bool = False) -> None:
        super().__init__()
        self.b0, self.b1 = Block(), Block()
        self.keep = keep

    def forward(self, x):
        y = self.b1(self.b0(x))
        if not self.keep:
            (gx,) = torch.autograd.grad(y.sum(), [x])
            return gx + x
        # the program's own backward later goes through the same call sites: it fetches the backward
        # subgraph the forward fetched for this gradient, rather than saving the attribute (was a KeyError)
        (gx,) = torch.autograd.grad(y.sum(), [x], retain_graph=True)
        return gx.detach() + y


@pytest.mark.parametrize("keep", [False, True])
def test_a_gradient_the_captured_code_takes_itself(keep: bool):
    torch.manual_seed(0)
    check_against_eager(_GradInside(keep), torch.randn(3, 2, requires_grad=True))


@efx.region
def _smooth(x):
    return torch.tanh(x) * x


def test_a_gradient_of_a_region_gradient_is_refused():
    """create_graph=True through a region (a gradient penalty): the region's backward is not differentiated,
    so the second derivative would be silently lost; the capture refuses, naming the region and the line."""
    def penalty(x):
        (gx,) = torch.autograd.grad(_smooth(x).sum(), [x], create_graph=True)
        return gx.pow(2).sum()

    with pytest.raises(CaptureError, match=r"differentiates the gradient of region '_smooth'.*test_golden_training.py"):
        efx.capture(penalty, torch.randn(5, requires_grad=True))
