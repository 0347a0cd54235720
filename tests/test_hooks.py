"""Module hooks are part of what a body does (Note [Region identity], ``effectfx.guards.hooks``): each call
site runs its own hooks, a body is shared only by call sites whose hooks do the same, and a hook registered
or removed after a compiled call is seen.  Also: a tensor attribute replaced on an object the compiled code
reaches through a closure or a global is read anew."""

from __future__ import annotations

import functools

import pytest
import torch

import effectfx as efx
from effectfx.testing import check_against_eager, hf
from effectfx.testing.effect_ops import recording

log_tensor = torch.ops.efxtest.log_tensor
record = torch.ops.efxtest.record_memory


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Stack(torch.nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def logged(name: str):  # a hook that logs its layer's name: a closure over a per-layer string
    return lambda module, args, out: log_tensor(out, name)


def bodies(compiled: efx.CompiledCallable) -> int:
    (prog,) = compiled.programs()
    forward = prog.forward if isinstance(prog, efx.TrainingProgram) else prog
    return len(forward.bodies)


def logs(fn, x: torch.Tensor) -> list:
    with recording() as log:
        fn(x)
    return log


@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_hook_inside_a_region_is_each_layers_own(requires_grad: bool) -> None:
    """Eager logs lin0, lin1, lin2; a body traced once for all layers logged lin0 three times."""
    model = Stack()
    for i, block in enumerate(model.blocks):
        block.lin.register_forward_hook(logged(f"lin{i}"))
    eager = check_against_eager(model, torch.randn(2, 4, requires_grad=requires_grad))
    assert [e[1] for e in eager.log] == ["lin0", "lin1", "lin2"]


GOLDEN_SHARED_HOOK = """\
# Block_forward_subgraph0: 'subgraph_0'
def Block_forward_subgraph0(self, token, x, lin_weight, lin_bias):
    t = torch.ops.aten.t.default(lin_weight)
    addmm = torch.ops.aten.addmm.default(lin_bias, x, t)
    with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.log_tensor.default, addmm, 'lin')
    getitem = with_effects[0]
    relu = torch.ops.aten.relu.default(addmm)
    return (getitem, relu)"""


def test_golden_a_hook_inside_a_region_is_part_of_its_body() -> None:
    """One hook function on every layer's submodule: one body, its effect between the Linear and the ReLU,
    where nn.Module's call runs it; two call sites of it."""
    model = Stack(2)
    shared = lambda module, args, out: log_tensor(out, "lin")  # noqa: E731
    for block in model.blocks:
        block.lin.register_forward_hook(shared)
    with torch.no_grad():
        text = efx.capture(model, torch.randn(2, 4)).code()
    assert text.strip().endswith(GOLDEN_SHARED_HOOK)
    assert text.count("effectfx.ops.invoke_subgraph(block_forward_subgraph0, 'subgraph_0'") == 2


def test_equal_hooks_share_a_body_and_different_ones_do_not() -> None:
    same, named = Stack(), Stack()
    shared = functools.partial(log_tensor, label="lin")  # one object for every layer
    for i, (a, b) in enumerate(zip(same.blocks, named.blocks)):
        a.lin.register_forward_hook(lambda module, args, out: shared(out))
        b.lin.register_forward_hook(logged(f"lin{i}"))
    x = torch.randn(2, 4)
    compiled_same, compiled_named = efx.compile(same), efx.compile(named)
    assert logs(compiled_same, x) == logs(same, x)
    assert logs(compiled_named, x) == logs(named, x)
    assert bodies(compiled_same) == 1  # the same code, closing over the same object
    assert bodies(compiled_named) == 3  # a per-layer name it logs: its own body
    text = str(efx.explain(compiled_named))
    assert "self.lin: hooks 1 hook -> 1 hook (other functions, or other values they close over or name)" \
        in text


def test_a_pre_hook_that_changes_the_input() -> None:
    model = Stack()
    for i, block in enumerate(model.blocks):
        block.lin.register_forward_pre_hook(lambda module, args, s=float(i + 1): (args[0] * s,))
    check_against_eager(model, torch.randn(2, 4, requires_grad=True))


def test_a_hook_on_the_region_module_itself() -> None:
    model = Stack()
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(logged(f"block{i}"))
    check_against_eager(model, torch.randn(2, 4, requires_grad=True))


@pytest.mark.parametrize("where", ["submodule", "region module"])
def test_a_hook_registered_or_removed_after_a_compiled_call_is_seen(where: str) -> None:
    model, x = Stack(), torch.randn(2, 4)
    compiled = efx.compile(model)
    assert logs(compiled, x) == logs(model, x) == []
    target = model.blocks[1].lin if where == "submodule" else model.blocks[1]
    handle = target.register_forward_hook(logged("late"))
    assert [e[1] for e in logs(compiled, x)] == [e[1] for e in logs(model, x)] == ["late"]
    handle.remove()
    assert logs(compiled, x) == logs(model, x) == []
    assert compiled.stats.compiles == 2  # without the hook, the first program's guards hold again
    name = "Stack.blocks.1.lin" if where == "submodule" else "Stack.blocks.1"
    assert f"why: {name} hooks: 0 hooks -> 1 hook" in str(efx.explain(compiled))


def test_a_global_module_hook_registered_after_a_compiled_call() -> None:
    """torch's global hooks run on every module call (and on no module of effectfx's own graphs)."""
    model, x = Stack(), torch.randn(2, 4)
    compiled = efx.compile(model)
    assert logs(compiled, x) == []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: log_tensor(out, type(module).__name__))
    try:
        eager = logs(model, x)
        assert [e[1] for e in eager] == ["Linear", "Block", "Linear", "Block", "Linear", "Block", "Stack"]
        for _ in range(3):  # the capture, the interpreted runs, the generated code
            assert logs(compiled, x) == eager
    finally:
        handle.remove()
    assert logs(compiled, x) == []


@pytest.mark.parametrize("kind", ["full backward", "backward pre"])
def test_backward_hooks_inside_a_region_are_each_layers_own(kind: str) -> None:
    """A backward hook runs in the backward graph, where eager's engine runs it: bw2, bw1, bw0."""
    model = Stack()
    for i, block in enumerate(model.blocks):
        if kind == "full backward":
            block.lin.register_full_backward_hook(lambda m, gin, gout, n=f"bw{i}": log_tensor(gout[0], n))
        else:
            block.lin.register_full_backward_pre_hook(lambda m, gout, n=f"bw{i}": log_tensor(gout[0], n))
    eager = check_against_eager(model, torch.randn(2, 4, requires_grad=True))
    assert [e[1] for e in eager.log] == ["bw2", "bw1", "bw0"]


def test_a_tensor_hook_inside_a_region() -> None:
    @efx.region
    def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x * w
        y.register_hook(lambda g: log_tensor(g, "y.grad"))
        return y.sum()

    eager = check_against_eager(lambda x, w: product(x, w) * 2, torch.randn(3, requires_grad=True),
                                torch.randn(3, requires_grad=True))
    assert [e[1] for e in eager.log] == ["y.grad"]


def test_gpt2_attention_hooks_log_each_layer() -> None:
    model = hf.build("gpt2")
    for i, layer in enumerate(hf.layers_of(model, "gpt2")):
        layer.layer.attn.register_forward_hook(lambda module, args, out, n=f"attn{i}": log_tensor(out[0], n))
    batch = hf.batch("gpt2", torch.Generator().manual_seed(0))
    with recording() as eager_log:
        eager = model(**batch).loss
    compiled = efx.compile(model)
    for _ in range(2):
        with recording() as log:
            got = compiled(**batch).loss
        assert [e[:2] for e in log] == [e[:2] for e in eager_log]
        torch.testing.assert_close(got, eager)
    assert [e[1] for e in eager_log if e[0] == "log_tensor"] == [f"attn{i}" for i in range(hf.LAYERS)]


# -- a tensor attribute replaced on an object reached through a closure or a global ----------------------
class Holder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.zeros(8)


HOLDER = Holder()


@efx.region
def _adds_the_global(x: torch.Tensor) -> torch.Tensor:
    return x + HOLDER.a


@pytest.mark.parametrize("reached", ["global, in a region", "closure, in the root"])
def test_a_replaced_tensor_attribute_is_read_anew(reached: str) -> None:
    holder = Holder()
    if reached.startswith("global"):
        holder = HOLDER

        def fn(x: torch.Tensor) -> torch.Tensor:
            return _adds_the_global(x) * 2
    else:
        def fn(x: torch.Tensor) -> torch.Tensor:
            return x * 2 + holder.a

    compiled, x = efx.compile(fn), torch.randn(8)
    torch.testing.assert_close(compiled(x), fn(x))
    holder.a = torch.ones(8)  # a new tensor object, same metadata: eager reads the new one
    try:
        torch.testing.assert_close(compiled(x), fn(x))
        holder.a = torch.full((8,), 3.0, dtype=torch.float64)  # other metadata: a new capture
        torch.testing.assert_close(compiled(x), fn(x))
    finally:
        HOLDER.a = torch.zeros(8)
