"""simplify_for_runtime: what efx.compile's default backend drops, and that nothing else changes."""

from __future__ import annotations

import torch
from torch import nn

import effectfx as efx
from effectfx.passes.pipeline import run_passes
from effectfx.passes.simplify import simplify_for_runtime
from effectfx.passes.thread_tokens import discover_effects
from effectfx.testing import check_against_eager
from effectfx.testing.models import Block

R = torch.ops.efxtest



def _programs(model: nn.Module, x: torch.Tensor) -> tuple[efx.TrainingProgram, efx.TrainingProgram]:
    captured = efx.capture(model, x, functionalize=False)
    plain = run_passes(captured, [discover_effects])
    return plain, run_passes(plain, [simplify_for_runtime])


def test_backward_body_loses_detach_and_double_transposes() -> None:
    """Proves the rules: detach pairs and t(t(x)) disappear from the backward subgraph, the rest stays."""
    plain, simple = _programs(nn.Sequential(Block()), torch.randn(2, 4))
    before, after = plain.backward.code(), simple.backward.code()  # printouts name ops alike
    assert "detach_1 = torch.ops.aten.detach" in before and "aten.detach" not in after
    assert after.count("aten.t.default") == before.count("aten.t.default") - 2
    assert [line.strip() for line in efx.Program.code(simple.backward).splitlines()[-6:]] == [
        "threshold_backward = torch.ops.aten.threshold_backward.default(tangent_0, detach, 0)",
        "t_1 = torch.ops.aten.t.default(threshold_backward)",
        "mm = torch.ops.aten.mm.default(t_1, x)",
        "sum_1 = torch.ops.aten.sum.dim_IntList(threshold_backward, [0], True)",
        "view = torch.ops.aten.view.default(sum_1, [4])",
        "return (None, mm, view)",  # the input needs no gradient: the shared body's backward skips it
    ]


def test_simplified_graphs_call_operators_directly() -> None:
    _, simple = _programs(nn.Sequential(Block()), torch.randn(2, 4))
    (body,) = simple.forward.subgraphs().values()
    assert "_op" in body.code and "torch.ops.aten.addmm.default(" in simple.forward.code()


def test_effects_and_regions_survive() -> None:
    plain, simple = _programs(nn.Sequential(Block(), Block()), torch.randn(2, 4))
    assert simple.forward.region_effects == plain.forward.region_effects
    # one body for both blocks, the first one's input promoted to require grad (Note [Region identity])
    assert simple.forward.code().count("record_memory.default('block')") == 1
    assert simple.forward.history[-1].name == "simplify_for_runtime"


def test_simplified_programs_match_eager() -> None:
    # efx.compile's default backend runs simplify_for_runtime
    check_against_eager(nn.Sequential(Block(), Block(), Block()), torch.randn(2, 4, requires_grad=True),
                        forms=())
    check_against_eager(lambda x: (x.t().t().detach() * x).sum(), torch.randn(3, 3, requires_grad=True),
                        forms=())


def test_direct_op_calls_change_the_code_not_the_printout() -> None:
    """Proves direct_op_calls binds operators' C++ entry points while print(prog) reads as before."""
    from effectfx.passes.direct_calls import direct_op_calls

    plain, _ = _programs(nn.Sequential(Block()), torch.randn(2, 4))
    simple = plain.forward
    direct = run_passes(simple, [direct_op_calls])
    (body,) = direct.subgraphs().values()
    assert "_op" in body.code and "torch.ops.aten.addmm.default(" not in body.code
    assert direct.code() == simple.code()  # the printout names ops as torch.ops...
    assert "torch.ops.aten.addmm.default(" in direct.code()
    x = torch.randn(2, 4)
    torch.testing.assert_close(direct(x), simple(x))


def test_the_copying_pass_leaves_its_input_as_it_was() -> None:
    """simplify_for_runtime makes new graphs (efx.compile's in-place variant is for its own capture only):
    the program it was given still prints and runs as before."""
    model = nn.Sequential(Block(), Block())
    x = torch.randn(2, 4)
    plain, simple = _programs(model, x)
    again, _ = _programs(model, x)
    for before, after, untouched in ((plain.forward, simple.forward, again.forward),
                                     (plain.backward, simple.backward, again.backward)):
        assert after.graph_module is not before.graph_module
        assert before.code() == untouched.code() and "_op" not in before.graph_module.code
        assert all(a is not b for a, b in zip(after.subgraphs().values(), before.subgraphs().values()))
    assert "aten.detach" in plain.backward.code() and "aten.detach" not in simple.backward.code()
    expected = model(x)
    assert torch.equal(simple(x), expected) and torch.equal(plain(x), expected)
