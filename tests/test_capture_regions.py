"""Capture with regions and effect tokens, differentially against eager.

Every scenario runs through ``check_against_eager`` (eager vs every registered form vs efx.compile: same
outputs, same effect log, capture runs no effect) and additionally asserts the structure that makes it
right: how many bodies were traced, how many calls were emitted, which keys each region has.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx import ops
from effectfx.testing import check_against_eager, recording

R = torch.ops.efxtest


def n_calls(gm: torch.fx.GraphModule) -> int:
    """invoke_subgraph calls in ``gm`` and, recursively, in the bodies it calls (per call site)."""
    total = 0
    for node in gm.graph.nodes:
        if node.target is ops.invoke_subgraph:
            total += 1 + n_calls(getattr(gm, node.args[0].target))
    return total


def root_calls(gm: torch.fx.GraphModule) -> list[str]:
    return [n.args[1] for n in gm.graph.nodes if n.target is ops.invoke_subgraph]


def eager_log(fn, *args, **kwargs) -> list[tuple]:
    with recording() as log:
        fn(*args, **kwargs)
    return list(log)


@efx.region
def rep(x):
    R.record_memory("rep")
    return x * 2 + 1


@efx.region
def rep_logged(x):
    R.log_tensor(x, "rep_logged")  # logs a fingerprint of the operand: a wrong operand shows in the log
    return x.cos() + x


# -- point 5 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 10])
def test_region_called_many_times(n):
    def f(x):
        return [rep_logged(x * i) for i in range(n)]

    x = torch.randn(3)
    eager = check_against_eager(f, x)
    assert len(eager.log) == n
    prog = efx.capture(f, x)
    assert prog.region_traces == {"subgraph_0": 1}
    assert root_calls(prog.graph_module) == ["subgraph_0"] * n
    assert len(prog.subgraphs()) == 1


def test_chained_calls():
    f = lambda x: rep_logged(rep_logged(rep_logged(x)))  # noqa: E731
    x = torch.randn(4)
    eager = check_against_eager(f, x)
    assert [e[0] for e in eager.log] == ["log_tensor"] * 3
    assert len({e[3] for e in eager.log}) == 3  # three different operands were logged
    prog = efx.capture(f, x)
    assert prog.region_traces == {"subgraph_0": 1}
    assert root_calls(prog.graph_module) == ["subgraph_0"] * 3


@pytest.mark.parametrize("n", [1, 6])
def test_loop_with_top_level_effects_before_and_after(n):
    def f(x):
        R.record_stdout("start")
        R.log_tensor(x, "in")
        for i in range(n):
            x = rep(x)
            R.record_collective_tp(f"between {i}")
        R.record_memory("end")
        return x

    x = torch.randn(2, 2)
    eager = check_against_eager(f, x)
    assert len(eager.log) == 3 + 2 * n
    assert eager.log[-1] == ("record_memory", "end")
    prog = efx.capture(f, x)
    assert prog.token_keys == ("collective:tp", "memory", "stdout")
    assert prog.region_traces == {"subgraph_0": 1}
    assert root_calls(prog.graph_module) == ["subgraph_0"] * n


@efx.region
def leaf(x):
    R.record_memory("leaf")
    R.log_tensor(x, "leaf")
    return x.sin()


@efx.region
def middle(x):
    R.record_stdout("middle in")
    y = leaf(x) + leaf(x * 3)
    R.record_stdout("middle out")
    return y


@efx.region
def top(x):
    R.record_collective_tp("top")
    return middle(middle(x)) - 1


def test_nested_regions_with_effects_at_every_level():
    def f(x):
        R.record_memory("root before")
        y = top(x) + top(x + 1)
        R.record_memory("root after")
        return y

    x = torch.randn(3)
    eager = check_against_eager(f, x)
    assert len(eager.log) == 2 + 2 * (1 + 2 * (2 + 2 * 2))
    prog = efx.capture(f, x)
    assert prog.region_traces == {"subgraph_0": 1, "subgraph_1": 1, "subgraph_2": 1}
    assert n_calls(prog.graph_module) == 2 + 2 * 2 + 2 * 2 * 2
    assert prog.region_effects == {
        "subgraph_0": frozenset({"collective:tp", "memory", "stdout"}),  # top
        "subgraph_1": frozenset({"memory", "stdout"}),  # middle
        "subgraph_2": frozenset({"memory", "stdout"}),  # leaf (log_tensor is on stdout)
    }


@efx.region
def every_key(x):
    R.record_memory("a")
    R.record_stdout("b")
    y = R.bump(x, "c")  # memory, returns a tensor
    R.record_collective_tp("d")
    R.log_tensor(y, "e")  # stdout
    R.record_memory("f")
    return y * 2


def test_several_keys_in_one_region():
    f = lambda x: every_key(every_key(x))  # noqa: E731
    x = torch.randn(3)
    eager = check_against_eager(f, x)
    assert len(eager.log) == 12
    prog = efx.capture(f, x)
    assert prog.region_effects == {"subgraph_0": frozenset({"memory", "stdout", "collective:tp"})}
    assert prog.token_keys == ("collective:tp", "memory", "stdout")


@efx.region
def effect_only(x, label: str):
    R.log_tensor(x, label)
    return x * 100


@efx.region
def returns_nothing(x):
    R.log_tensor(x, "nothing")


def test_region_whose_outputs_are_unused():
    def f(x):
        effect_only(x, "a")  # unused
        y = x + 1
        effect_only(y, "b")  # unused
        returns_nothing(y)
        return y * 2

    x = torch.randn(3)
    eager = check_against_eager(f, x)
    assert [e[1] for e in eager.log] == ["a", "b", "nothing"]
    for functionalize in (False, True):
        prog = efx.capture(f, x, functionalize=functionalize)
        assert len(root_calls(prog.graph_module)) == 3
        with recording() as log:
            prog(x)
        assert log == eager.log


def test_region_effects_run_every_time_the_program_runs():
    prog = efx.capture(lambda x: rep(rep(x)), torch.randn(2))
    with recording() as log:
        for _ in range(3):
            prog(torch.randn(2))
    assert log == [("record_memory", "rep")] * 6


# -- modules ---------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("shift", torch.randn(d))

    @efx.region
    def forward(self, x):
        R.log_tensor(self.lin.weight, "weight")  # proves each call gets its own block's weights
        return torch.tanh(self.lin(x)) + self.shift


class Stack(nn.Module):
    def __init__(self, n: int = 16, d: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        R.record_memory("stack")
        for b in self.blocks:
            x = b(x)
        return x


def test_sixteen_blocks_share_one_subgraph_under_no_grad():
    torch.manual_seed(0)
    model = Stack(16)
    x = torch.randn(2, 4)
    with torch.no_grad():
        eager = check_against_eager(model, x)
        prog = efx.capture(model, x)
    assert len(eager.log) == 17
    assert len({e[3] for e in eager.log[1:]}) == 16  # 16 different weights
    assert prog.region_traces == {"subgraph_0": 1}
    assert len(prog.subgraphs()) == 1
    assert root_calls(prog.graph_module) == ["subgraph_0"] * 16
    assert not isinstance(prog, efx.TrainingProgram)
    # parameters and buffers are lifted to operands: the body reads only its placeholders
    (body,) = prog.subgraphs().values()
    assert [n.name for n in body.graph.nodes if n.op == "placeholder"] == [
        "token", "x", "lin_weight", "lin_bias", "shift"]


def test_sixteen_blocks_with_frozen_parameters():
    torch.manual_seed(1)
    model = Stack(16).requires_grad_(False)
    x = torch.randn(3, 4)
    check_against_eager(model, x)
    prog = efx.capture(model, x)
    assert prog.region_traces == {"subgraph_0": 1}
    assert root_calls(prog.graph_module) == ["subgraph_0"] * 16


def test_module_parameters_are_read_at_run_time():
    torch.manual_seed(2)
    model = Stack(2).requires_grad_(False)
    x = torch.randn(2, 4)
    prog = efx.capture(model, x)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    with recording():
        assert torch.allclose(prog(x), model(x))


class Scaled(nn.Module):
    def __init__(self, factor: int) -> None:
        super().__init__()
        self.factor = factor

    @efx.region
    def forward(self, x):
        R.record_memory(f"scaled {self.factor}")
        return x * self.factor


def test_module_plain_attributes_are_part_of_the_cache_key():
    mods = nn.ModuleList([Scaled(2), Scaled(3), Scaled(2)])

    def f(x):
        for m in mods:
            x = m(x)
        return x

    x = torch.randn(2)
    eager = check_against_eager(f, x)
    assert [e[1] for e in eager.log] == ["scaled 2", "scaled 3", "scaled 2"]
    prog = efx.capture(f, x)
    assert prog.region_traces == {"subgraph_0": 1, "subgraph_1": 1}
    assert root_calls(prog.graph_module) == ["subgraph_0", "subgraph_1", "subgraph_0"]


# -- naming and marking ------------------------------------------------------------------------------
@efx.region(name="my_block")
def named(x):
    R.record_stdout("named")
    return x - 1


def test_region_with_a_name():
    f = lambda x: named(named(x))  # noqa: E731
    x = torch.randn(2)
    check_against_eager(f, x)
    prog = efx.capture(f, x)
    assert list(prog.subgraphs()) == ["my_block_subgraph0"]
    assert prog.regions["subgraph_0"].name == "my_block"
    assert "def my_block_subgraph0(self, token, x):" in prog.code()
    assert named(torch.ones(1)).item() == 0.0  # a plain call in eager


@torch.compiler.nested_compile_region
def ncr(x):
    R.record_memory("ncr")
    return x.exp()


def test_nested_compile_region_functions_are_regions():
    f = lambda x: ncr(ncr(x) + 1)  # noqa: E731
    x = torch.randn(3)
    eager = check_against_eager(f, x)
    assert eager.log == [("record_memory", "ncr")] * 2
    prog = efx.capture(f, x)
    assert prog.region_traces == {"subgraph_0": 1}
    assert root_calls(prog.graph_module) == ["subgraph_0", "subgraph_0"]
    assert prog.region_effects == {"subgraph_0": frozenset({"memory"})}


# -- cache keys ------------------------------------------------------------------------------------
@efx.region
def with_int(x, k: int):
    R.record_memory(f"k={k}")
    return x * k


def test_non_tensor_arguments_are_part_of_the_cache_key():
    def f(x):
        return with_int(x, 2) + with_int(x, 3) + with_int(x, 2) + with_int(x, k=3)

    x = torch.randn(2)
    eager = check_against_eager(f, x)
    assert [e[1] for e in eager.log] == ["k=2", "k=3", "k=2", "k=3"]
    prog = efx.capture(f, x)
    calls = root_calls(prog.graph_module)
    # positional and keyword calls may or may not share a body, but equal keys must share one
    assert calls[0] == calls[2] and calls[0] != calls[1]
    assert len(set(calls)) in (2, 3)
    assert set(prog.region_traces.values()) == {1}


def test_tensor_metadata_is_part_of_the_cache_key():
    def f(x):
        return rep(x).sum() + rep(x[:2]).sum() + rep(x.double()).sum().float() + rep(x).sum()

    x = torch.randn(4)
    check_against_eager(f, x)
    prog = efx.capture(f, x)
    assert prog.region_traces == {"subgraph_0": 1, "subgraph_1": 1, "subgraph_2": 1}
    assert root_calls(prog.graph_module) == ["subgraph_0", "subgraph_1", "subgraph_2", "subgraph_0"]


def test_each_capture_traces_again_from_scratch():
    x = torch.randn(2)
    for _ in range(2):
        prog = efx.capture(lambda x: rep(rep(x)), x)
        assert prog.region_traces == {"subgraph_0": 1}


# -- what bodies may read ----------------------------------------------------------------------------
CONSTANT = torch.arange(3.0)


@efx.region
def reads_global(x):
    R.log_tensor(CONSTANT, "const")
    return x + CONSTANT


def test_global_tensors_are_lifted():
    f = lambda x: reads_global(reads_global(x))  # noqa: E731
    x = torch.randn(3)
    check_against_eager(f, x)
    prog = efx.capture(f, x)
    assert prog.region_traces == {"subgraph_0": 1}


@efx.region
def pytree_out(x, scale: float = 1.0):
    R.record_memory("pytree")
    return {"a": x * scale, "b": (x + 1, 7, "s")}


def test_pytree_outputs_and_kwargs():
    def f(x):
        out = pytree_out(x, scale=2.0)
        again = pytree_out(out["a"], scale=2.0)
        return again["a"] + out["b"][0], out["b"][1:]

    x = torch.randn(2)
    check_against_eager(f, x)
    prog = efx.capture(f, x)
    assert prog.region_traces == {"subgraph_0": 1}
    result = prog(x)
    assert result[1] == (7, "s")


# -- functionalization of in-place ops ----------------------------------------------------------------
@efx.region
def inplace_region(x):
    y = x * 2
    y.add_(1)
    R.log_tensor(y, "after add_")
    y.relu_()
    return y


def test_inplace_ops_on_intermediates():
    def f(x):
        z = x.clone()
        z.mul_(3)
        return inplace_region(z) + inplace_region(z - 1)

    x = torch.randn(5)
    eager = check_against_eager(f, x)
    assert len(eager.log) == 2
    for functionalize in (False, True):
        prog = efx.capture(f, x, functionalize=functionalize)
        for gm in (prog.graph_module, *prog.subgraphs().values()):
            mutating = [n for n in gm.graph.nodes
                        if isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable]
            assert mutating == [], gm.code


# -- aten._print --------------------------------------------------------------------------------------
@efx.region
def printing(x):
    torch.ops.aten._print("in region")
    return x + 1


def test_aten_print_order(capfd):
    def f(x):
        torch.ops.aten._print("first")
        y = printing(printing(x))
        torch.ops.aten._print("last")
        return y

    x = torch.randn(2)
    f(x)
    expected = capfd.readouterr().out
    assert expected == "first\nin region\nin region\nlast\n"
    for functionalize in (False, True):
        prog = efx.capture(f, x, functionalize=functionalize)
        assert capfd.readouterr().out == ""  # capture prints nothing
        assert torch.equal(prog(x), x + 2)
        assert capfd.readouterr().out == expected
    prog = efx.capture(f, x)
    assert prog.token_keys == ("ordered",)
    assert prog.region_effects == {"subgraph_0": frozenset({"ordered"})}
    compiled = efx.compile(f)
    compiled(x)
    assert capfd.readouterr().out == expected


# -- printing -----------------------------------------------------------------------------------------
def test_print_shows_root_and_every_subgraph(capsys):
    def f(x):
        R.record_memory("root")
        return top(named(x))

    prog = efx.capture(f, torch.randn(3))
    print(prog)
    text = capsys.readouterr().out
    assert text.count("def forward(") == 1
    for attr, gm in prog.subgraphs().items():
        assert f"def {attr}(" in text
        assert text.count(f"def {attr}(") == 1
        assert gm.code  # every subgraph is a runnable GraphModule
    assert len(prog.subgraphs()) == 4  # named, top, middle, leaf
    for ident in prog.region_traces:
        assert f"'{ident}'" in text
