"""A compiled module or function called inside captured code is inlined into the outer capture; called
outside it runs its own programs; compiling a compiled one again is idempotent (Note [Nested compiles],
``effectfx.drivers.compile``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx.testing import hf, recording

log_tensor = torch.ops.efxtest.log_tensor
STEPS = 2


def test_gpt2_with_compiled_blocks_in_a_compiled_model_trains_as_eager() -> None:
    eager_model = hf.build("gpt2", seed=0)
    model = copy.deepcopy(eager_model)
    blocks = hf.layers_of(model, "gpt2")
    for i, block in enumerate(blocks):
        blocks[i] = efx.compile(block)  # a library compiles its blocks...
    compiled = efx.compile(model)  # ... and the user the model
    g = torch.Generator().manual_seed(1)
    batches = [hf.batch("gpt2", g) for _ in range(STEPS)]
    want = hf.train(eager_model, eager_model, batches)
    got = hf.train(model, compiled, batches)

    assert got.losses == pytest.approx(want.losses, rel=1e-5)
    assert got.log == want.log == [("record_memory", f"layer{i}") for i in range(hf.LAYERS)] * STEPS
    for step, (ge, gc) in enumerate(zip(want.grads, got.grads)):
        assert ge.keys() == gc.keys(), step
        for name in ge:
            torch.testing.assert_close(gc[name], ge[name], rtol=1e-5, atol=1e-6, msg=f"{step} {name}")
    # one program of the model; the blocks were inlined into it: no program, no call of their own
    assert (compiled.stats.compiles, compiled.stats.calls) == (1, STEPS)
    assert all((b.stats.compiles, b.stats.calls) == (0, 0) for b in blocks)
    # ... and their region stayed a region, with one body for its four calls
    region = efx.explain(compiled).regions["LoggedLayer.forward"]
    assert region.calls == hf.LAYERS and len(region.bodies) == 1

    # called alone, a block runs its own program, from its own cache
    x = torch.randn(2, 8, hf.HIDDEN)
    eager_block = hf.layers_of(eager_model, "gpt2")[0]
    with recording() as log:
        out = blocks[0](x)
    with recording() as eager_log:
        expected = eager_block(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out,
                               expected[0] if isinstance(expected, tuple) else expected)
    assert log == eager_log == [("record_memory", "layer0")]
    assert (blocks[0].stats.compiles, blocks[0].stats.calls) == (1, 1)
    assert (blocks[1].stats.compiles, compiled.stats.compiles) == (0, 1)


@efx.region
def _double(x: torch.Tensor) -> torch.Tensor:
    log_tensor(x, "double")
    return x * 2


def _inner(x: torch.Tensor) -> torch.Tensor:
    return _double(x).sin() + _double(x + 1)


def _outer(inner: efx.CompiledCallable, x: torch.Tensor) -> torch.Tensor:
    log_tensor(x, "outer")
    return inner(x).cos().sum() + inner(x * 3).sum()


def test_compiled_function_in_a_compiled_function_is_inlined() -> None:
    inner = efx.compile(_inner)
    outer = efx.compile(lambda x: _outer(inner, x))
    x = torch.randn(3, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    for _ in range(2):
        with recording() as log:
            out = outer(x)
            (gx,) = torch.autograd.grad(out, x)
        with recording() as eager_log:
            expected = _outer(_inner, xe)
            (ge,) = torch.autograd.grad(expected, xe)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(gx, ge)
        assert log == eager_log and len(log) == 5  # outer, then the region's effect at each of 4 calls
    assert (outer.stats.compiles, outer.stats.calls) == (1, 2)
    assert (inner.stats.compiles, inner.stats.calls) == (0, 0)  # inlined: not bumped
    # the inner function's region is a region of the outer program: one body, four calls
    region = efx.explain(outer).regions["_double"]
    assert region.calls == 4 and len(region.bodies) == 1

    # called outside any capture, the inner one captures and runs its own program
    with recording() as log:
        out = inner(x.detach())
    with recording() as eager_log:
        expected = _inner(x.detach())
    torch.testing.assert_close(out, expected)
    assert log == eager_log and len(log) == 2
    assert (inner.stats.compiles, inner.stats.calls) == (1, 1)
    assert outer.stats.compiles == 1


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def test_a_block_compiled_and_run_before_keeps_its_program() -> None:
    model = nn.Sequential(_Block(), _Block())
    model[0] = efx.compile(model[0])
    x = torch.randn(2, 4)
    model[0](x)  # its own program first
    compiled = efx.compile(model)
    expected = model[1](model[0].original(x))
    torch.testing.assert_close(compiled(x), expected)
    assert (model[0].stats.compiles, model[0].stats.calls) == (1, 1)
    assert len(model[0].programs()) == 1 and compiled.stats.compiles == 1
    torch.testing.assert_close(model[0](x), model[0].original(x))
    assert (model[0].stats.compiles, model[0].stats.calls) == (1, 2)


def test_compiling_a_compiled_module_or_function_again_is_idempotent() -> None:
    block = _Block()
    once = efx.compile(block)
    assert efx.compile(once) is once
    assert efx.compile(once.compiled) is once.compiled
    # other options: the original compiled with them, never a compile of the compiled
    other = efx.compile(once, dynamic=True)
    assert other is not once and other.original is block and other.dynamic is True
    assert type(other).__mro__[1] is _Block  # one level of compiled module, not two
    x = torch.randn(2, 4)
    torch.testing.assert_close(other(x), block(x))
    assert (other.stats.compiles, once.stats.compiles) == (1, 0)

    fn = efx.compile(_inner)
    assert efx.compile(fn) is fn
    again = efx.compile(fn, backend="eager", dynamic=False)
    assert again is not fn and again.fn is _inner


class _Flagged(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.flag = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.flag:
            y = y * 10
        return y + 1 if self.training else y


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _Flagged(), _Flagged()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_what_an_inlined_module_reads_is_guarded_by_the_outer_program() -> None:
    model = _Pair()
    model.a = efx.compile(model.a)
    compiled = efx.compile(model)
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), model.b(model.a.original(x)))
    model.a.flag = True  # read through the compiled child: a guard of the outer program
    torch.testing.assert_close(compiled(x), model.b(model.a.original(x)))
    model.eval()
    torch.testing.assert_close(compiled(x), model.b(model.a.original(x)))
    assert compiled.stats.compiles == 3 and model.a.stats.compiles == 0


class _LoggedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.record_memory("block")
        return self.lin(x).relu()


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # a library's compiled block beside a plain one
        self.a, self.b = efx.compile(_LoggedBlock()), _LoggedBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


GOLDEN_INLINED = """\
def forward(self, x, a_lin_weight, a_lin_bias, b_lin_weight, b_lin_bias):
    _logged_block_forward_subgraph0 = self._LoggedBlock_forward_subgraph0
    invoke_subgraph = effectfx.ops.invoke_subgraph(_logged_block_forward_subgraph0, 'subgraph_0', x, a_lin_weight, a_lin_bias)
    getitem = invoke_subgraph[0]
    invoke_subgraph_1 = effectfx.ops.invoke_subgraph(_logged_block_forward_subgraph0, 'subgraph_0', getitem, b_lin_weight, b_lin_bias)
    getitem_1 = invoke_subgraph_1[0]
    return (getitem_1,)

# _LoggedBlock_forward_subgraph0: 'subgraph_0'
def _LoggedBlock_forward_subgraph0(self, x, lin_weight, lin_bias):
    record_memory = torch.ops.efxtest.record_memory.default('block')
    t = torch.ops.aten.t.default(lin_weight)
    addmm = torch.ops.aten.addmm.default(lin_bias, x, t)
    relu = torch.ops.aten.relu.default(addmm)
    return (relu,)"""  # noqa: E501 (graph text as printed)


def test_golden_a_compiled_block_is_inlined_as_a_region() -> None:
    """The compiled block and the plain one are two calls of one body in the outer program."""
    torch.manual_seed(0)
    model = _Two()
    eager_a, eager_b = _LoggedBlock(), copy.deepcopy(model.b)
    eager_a.load_state_dict(model.a.state_dict())
    compiled = efx.compile(model)
    x = torch.ones(2, 3)
    with torch.no_grad(), recording() as got:
        out = compiled(x)
    with torch.no_grad(), recording() as want:
        torch.testing.assert_close(out, eager_b(eager_a(x)))
    assert got == want == [("record_memory", "block")] * 2
    assert compiled.programs()[-1].code() == GOLDEN_INLINED
