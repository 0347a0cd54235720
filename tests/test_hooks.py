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
    same, named, formatted = Stack(), Stack(), Stack()
    shared = functools.partial(log_tensor, label="lin")  # one object for every layer
    for i, (a, b, c) in enumerate(zip(same.blocks, named.blocks, formatted.blocks)):
        a.lin.register_forward_hook(lambda module, args, out: shared(out))
        b.lin.register_forward_hook(logged(f"lin{i}"))
        c.lin.register_forward_hook(lambda module, args, out, n=f"lin{i}": log_tensor(out, n.upper()))
    x = torch.randn(2, 4)
    compiled_same, compiled_named = efx.compile(same), efx.compile(named)
    compiled_formatted = efx.compile(formatted)
    assert logs(compiled_same, x) == logs(same, x)
    assert logs(compiled_named, x) == logs(named, x)
    assert logs(compiled_formatted, x) == logs(formatted, x)
    assert bodies(compiled_same) == 1  # the same code, closing over the same object
    assert bodies(compiled_named) == 1  # a per-layer name it only logs: a label, the body's operand
    assert bodies(compiled_formatted) == 3  # a per-layer name it formats: its value is the body's
    text = str(efx.explain(compiled_formatted))
    assert "why: self.lin forward hook 0's n: 'lin0' -> 'lin1' (vs subgraph_0)" in text


GOLDEN_HOOK_LABEL = """\
# Block_forward_subgraph0: 'subgraph_0'
def Block_forward_subgraph0(self, token, x, lin_weight, lin_bias, label):
    t = torch.ops.aten.t.default(lin_weight)
    addmm = torch.ops.aten.addmm.default(lin_bias, x, t)
    with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.log_tensor.default, addmm, label)
    getitem = with_effects[0]
    relu = torch.ops.aten.relu.default(addmm)
    return (getitem, relu)"""


@pytest.mark.parametrize("held", ["closure", "default"])
def test_golden_a_name_a_hook_closes_over_is_an_operand(held: str) -> None:
    """A hook that closes over its layer's name (or has it as a default) and only logs it: one body, whose
    label operand each call site passes (Note [Region identity], ``guards.hooks.hook_labels``)."""
    model = Stack()
    for i, block in enumerate(model.blocks):
        block.lin.register_forward_hook(logged(f"lin{i}") if held == "closure" else
                                        lambda module, args, out, n=f"lin{i}": log_tensor(out, n))
    with torch.no_grad():
        text = efx.capture(model, torch.randn(2, 4)).code()
    assert text.strip().endswith(GOLDEN_HOOK_LABEL)
    for i in range(3):
        assert f"blocks_{i}_lin_weight, blocks_{i}_lin_bias, 'lin{i}')" in text  # each call site's own name
    check_against_eager(model, torch.randn(2, 4, requires_grad=True))


class Pair(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Block(), Block()

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


@pytest.mark.parametrize("use", ["logged", "formatted"])
def test_a_name_a_hook_closes_over_in_nested_regions(use: str) -> None:
    """Logged only, the name is an operand of the inner body and, passed on, of the outer one (2 bodies);
    formatted, each inner call is its own body, and so is each outer one that calls them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Pair(), Pair())
    blocks = [block for pair in model for block in (pair.first, pair.second)]
    for i, block in enumerate(blocks):
        block.lin.register_forward_hook(
            logged(f"lin{i}") if use == "logged" else lambda m, a, o, n=f"lin{i}": log_tensor(o, n + "!"))
    eager = check_against_eager(model, torch.randn(2, 4, requires_grad=True))
    assert [e[1] for e in eager.log] == [f"lin{i}" + ("" if use == "logged" else "!") for i in range(4)]
    compiled = efx.compile(model)
    compiled(torch.randn(2, 4))
    assert bodies(compiled) == (2 if use == "logged" else 2 + 4)


@efx.region
def _both(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return block.lin(x), x * 2.0  # (its caller uses the first only: a partial backward)


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = _both(self, x)
        return torch.relu(h)


@pytest.mark.parametrize("held", ["closure", "default"])
def test_a_name_a_hook_closes_over_in_a_partial_backward_of_a_nested_region(held: str) -> None:
    """The inner region's backward for some of its outputs is traced anew while the outer body's backward
    is derived (Note [Partial backward]); the retrace takes the hook's name as a label too, so it runs the
    forward the first trace ran (with the name baked in, it was refused as another forward).  One body
    each for every layer (found by effectfx fuzz --seed 0)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Outer(), Outer(), Outer())
    for i, outer in enumerate(model):
        outer.lin.register_forward_hook(logged(f"lin{i}") if held == "closure" else
                                        lambda module, args, out, n=f"lin{i}": log_tensor(out, n))
    eager = check_against_eager(model, torch.randn(2, 4, requires_grad=True))
    assert [e[1] for e in eager.log] == ["lin0", "lin1", "lin2"]
    compiled = efx.compile(model)
    compiled(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert bodies(compiled) == 2


def test_a_name_a_hook_closes_over_rebound_after_a_compiled_call() -> None:
    """The compiled program passes each layer's name; a name rebound (a cell, a default) captures anew."""
    model, x = Stack(), torch.randn(2, 4)
    hooks = [logged(f"lin{i}") for i in range(3)]
    for block, hook in zip(model.blocks, hooks):
        block.lin.register_forward_hook(hook)
    compiled = efx.compile(model)
    assert logs(compiled, x) == logs(model, x)
    hooks[1].__closure__[0].cell_contents = "renamed"
    assert [e[1] for e in logs(compiled, x)] == [e[1] for e in logs(model, x)] == ["lin0", "renamed", "lin2"]
    hooks[1].__closure__[0].cell_contents = "lin1"
    assert logs(compiled, x) == logs(model, x)
    assert compiled.stats.compiles == 2
    assert [len(p.forward.bodies) for p in compiled.programs()] == [1, 1]


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


def _recorded(name: str):  # a hook closing over its layer's name (a cell), recording it
    def hook(module: torch.nn.Module, args: tuple, out: tuple) -> None:
        record(name)
        log_tensor(out[0], name)

    return hook


@pytest.mark.parametrize("held", ["closure", "default"])
def test_gpt2_attention_hooks_record_each_layer(held: str) -> None:
    """A per-layer attention hook recording its layer's name (in a default, or a closure cell) inside each
    layer's region: one body for every layer, each call site passing its name; outputs, every gradient and
    the effect log as eager's."""
    model = hf.build("gpt2")
    for i, layer in enumerate(hf.layers_of(model, "gpt2")):
        def hook(module: torch.nn.Module, args: tuple, out: tuple, n: str = f"attn{i}") -> None:
            record(n)
            log_tensor(out[0], n)

        layer.layer.attn.register_forward_hook(hook if held == "default" else _recorded(f"attn{i}"))
    batch = hf.batch("gpt2", torch.Generator().manual_seed(0))
    eager = check_against_eager(model, forms=(), **batch)
    names = [e[1] for e in eager.log if e[0] == "record_memory" and e[1].startswith("attn")]
    assert names == [f"attn{i}" for i in range(hf.LAYERS)]
    compiled = efx.compile(model)
    compiled(**batch).loss.backward()
    assert bodies(compiled) == 1  # was one per layer: each layer's hook name a constant of its own body


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
