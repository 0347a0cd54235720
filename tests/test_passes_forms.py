"""The token passes on the cases PyTorch's versions got wrong: mutation of the input, effect-only regions,
tokenless subgraphs, nesting, shared regions, several keys, and the training programs of efx.compile."""

from __future__ import annotations

import pytest
import torch

import effectfx as efx
from effectfx import ops
from effectfx.graph.traced import OutputKind
from effectfx.graph.walk import subgraphs
from effectfx.passes.dce import dead_code_elimination_pass
from effectfx.passes.pipeline import run_passes
from effectfx.program.records import Form
from effectfx.testing import check_against_eager, recording


@efx.region
def effect_only(x):
    torch.ops.efxtest.record_memory("only")
    return x * 2


def calls_effect_only(x):
    effect_only(x)  # result unused: the region is called only for its effect
    return x + 1


@efx.region
def pure(x):
    return x.sin()


@efx.region
def inner(x):
    torch.ops.efxtest.record_stdout("inner")
    return pure(x) + 1


@efx.region
def middle(x):
    torch.ops.efxtest.record_memory("middle")
    return inner(x) * inner(x)


@efx.region
def outer(x):
    y = middle(x)
    torch.ops.efxtest.log_tensor(y, "outer")
    return middle(y)


def nested(x):
    return pure(outer(x)) + outer(x)


@efx.region
def two_keys(x):
    torch.ops.efxtest.record_memory("a")
    y = torch.ops.efxtest.bump(x, "b")
    torch.ops.efxtest.record_collective_tp("c")
    return y * 3


def several_keys(x):
    torch.ops.efxtest.record_collective_tp("start")
    y = two_keys(two_keys(x))
    torch.ops.efxtest.log_tensor(y, "end")
    return y


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @efx.region
    def forward(self, x):
        torch.ops.efxtest.record_memory("block")
        return torch.ops.efxtest.scale(torch.tanh(self.lin(x)), 0.5)  # effect in backward too


class Blocks(torch.nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(n)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        torch.ops.efxtest.record_stdout("done")
        return x


SCENARIOS = {
    "effect_only": (calls_effect_only, lambda: (torch.randn(3),)),
    "nested": (nested, lambda: (torch.randn(3),)),
    "several_keys": (several_keys, lambda: (torch.randn(3),)),
    "blocks_inference": (Blocks().requires_grad_(False), lambda: (torch.randn(2, 4),)),
    "blocks_training": (Blocks(), lambda: (torch.randn(2, 4, requires_grad=True),)),
}
PASSES = {
    "unlift_tokens": efx.unlift_tokens,
    "remove_effect_tokens": efx.remove_effect_tokens,
    "unlift_then_remove": lambda p: efx.remove_effect_tokens(efx.unlift_tokens(p)),
    "dead_code_elimination": efx.dead_code_elimination,
}


def halves(prog):
    return [prog.forward, prog.backward] if isinstance(prog, efx.TrainingProgram) else [prog]


def run_logged(prog, args):
    with recording() as log:
        out = prog(*args)
    return out, log


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_form_matches_eager(scenario: str) -> None:
    """Outputs, gradients and effect logs of every registered form and of efx.compile equal eager's."""
    fn, args = SCENARIOS[scenario]
    check_against_eager(fn, *args())


@pytest.mark.parametrize("name", list(PASSES))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_pass_does_not_mutate_its_input(scenario: str, name: str) -> None:
    """The input program prints identically afterwards and still runs with eager's effects."""
    fn, make_args = SCENARIOS[scenario]
    args = make_args()
    prog = efx.capture(fn, *args)
    before = str(prog).split("\n", 1)[1]
    out_before, log_before = run_logged(prog, args)
    new = PASSES[name](prog)
    assert new is not prog
    efx.verify(new)
    assert str(prog).split("\n", 1)[1] == before
    efx.verify(prog)
    out_after, log_after = run_logged(prog, args)
    torch.testing.assert_close(out_after, out_before)
    assert log_after == log_before
    out_new, log_new = run_logged(new, args)
    torch.testing.assert_close(out_new, out_before)
    assert log_new == log_before
    for old_half, new_half in zip(halves(prog), halves(new)):  # no graph module is shared with the input
        old_ids = {id(old_half.graph_module)} | {id(gm) for _, _, gm in subgraphs(old_half.graph_module)}
        assert id(new_half.graph_module) not in old_ids
        assert not old_ids & {id(gm) for _, _, gm in subgraphs(new_half.graph_module)}


@pytest.mark.parametrize("name", list(PASSES))
def test_effect_only_region_survives(name: str) -> None:
    """A region called only for its effect is never dead code, in any form."""
    args = (torch.randn(3),)
    prog = PASSES[name](efx.capture(calls_effect_only, *args))
    prog = efx.dead_code_elimination(prog)
    calls = [n for n in prog.graph_module.graph.nodes if n.op == "call_function"
             and (n.target is ops.invoke_subgraph or n.target is ops.with_effects)]
    assert calls, prog
    _, log = run_logged(prog, args)
    assert log == [("record_memory", "only")]


def test_dce_removes_pure_dead_code_but_not_effects() -> None:
    """The registry decides: dead pure nodes and pure region calls go, a dead effectful region call stays."""
    def fn(x):
        effect_only(x)
        return pure(x) * 3

    prog = efx.remove_effect_tokens(efx.capture(fn, torch.randn(3)))
    gm = efx.dead_code_elimination(prog).graph_module  # a private copy we may edit
    call = next(n for n in gm.graph.nodes if n.target is ops.invoke_subgraph and n.args[1] == "subgraph_1")
    with gm.graph.inserting_after(call):
        gm.graph.call_function(ops.invoke_subgraph, call.args)  # a dead call of the pure region
        gm.graph.call_function(torch.ops.aten.cos.default, (call.args[2],))  # a dead pure op
    edited = prog.replace(graph_module=gm)
    dce = efx.dead_code_elimination(edited)
    calls = [(n.target, n.args[1]) for n in dce.graph_module.graph.nodes if n.op == "call_function"]
    assert (ops.invoke_subgraph, "subgraph_0") in calls  # effect-only region, result unused
    assert [c for c in calls if c[0] is ops.invoke_subgraph].count((ops.invoke_subgraph, "subgraph_1")) == 1
    assert torch.ops.aten.cos.default not in [c[0] for c in calls]
    assert len(list(gm.graph.nodes)) == len(list(dce.graph_module.graph.nodes)) + 2  # input untouched


@pytest.mark.parametrize("name", ["unlift_tokens", "remove_effect_tokens"])
def test_shared_regions_stay_shared(name: str) -> None:
    """Every call of one body reaches one subgraph object, at every nesting depth."""
    args = (torch.randn(3),)
    prog = PASSES[name](efx.capture(nested, *args))
    seen: dict[str, int] = {}

    def visit(gm):
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                body = getattr(gm, node.target)
                ident = next(u for u in node.users).args
                ident = ident[3] if ident[1] is ops.invoke_subgraph else ident[1]
                assert seen.setdefault(ident, id(body)) == id(body)
                visit(body)

    visit(prog.graph_module)
    assert len(seen) == len(prog.regions) >= 4


def test_unlifted_multi_key_region_call() -> None:
    """A region with several keys is wrapped with a tuple of tokens, one per key in sorted order."""
    prog = efx.unlift_tokens(efx.capture(several_keys, torch.randn(3)))
    wrapped = [n for n in prog.graph_module.graph.nodes
               if n.target is ops.with_effects and n.args[1] is ops.invoke_subgraph]
    assert len(wrapped) == 2
    assert all(isinstance(n.args[0], tuple) and len(n.args[0]) == 2 for n in wrapped)
    body = getattr(prog.graph_module, wrapped[0].args[2].target)
    assert [n.target for n in body.graph.nodes if n.op == "call_function"].count(ops.make_token) == 2
    assert not [n for n in body.graph.nodes if n.op == "placeholder" and n.name.startswith("token")]


def test_dead_code_elimination_is_in_the_history() -> None:
    """Like every pass, DCE stamps its name into ``prog.history`` (what ``print(prog)`` shows), on both
    halves of a training program too."""
    prog = efx.dead_code_elimination(efx.capture(several_keys, torch.randn(3)))
    assert [r.name for r in prog.history][-1] == "dead_code_elimination"
    assert "dead_code_elimination (" in str(prog).splitlines()[0]
    training = efx.dead_code_elimination(efx.capture(Blocks(4), torch.randn(2, 4, requires_grad=True)))
    assert training.forward.history[-1].name == training.backward.history[-1].name == "dead_code_elimination"


@pytest.mark.parametrize("form", ["unlifted", "token-free"])
def test_forms_of_training_programs(form: str) -> None:
    """Both halves of a TrainingProgram are rewritten; backward effects keep their order."""
    model = Blocks(4)
    x = torch.randn(2, 4, requires_grad=True)
    prog = efx.capture(model, x)
    assert isinstance(prog, efx.TrainingProgram) and prog.backward.token_keys
    new = efx.unlift_tokens(prog) if form == "unlifted" else efx.remove_effect_tokens(prog)
    assert new.forward.form == new.backward.form == form
    assert new.forward.token_keys == new.backward.token_keys == ()
    assert new.forward.history[-1].name == ("unlift_tokens" if form == "unlifted" else "remove_effect_tokens")
    efx.verify(new)
    with recording() as eager_log:
        model(x).sum().backward()
    eager_grad = x.grad.clone()
    x.grad = None
    with recording() as log:
        new(x).sum().backward()
    assert log == eager_log
    torch.testing.assert_close(x.grad, eager_grad)


def test_run_flat_every_form() -> None:
    """Program.run_flat takes the same tensors in every form (tokens are not the caller's business)."""
    x = torch.randn(3)
    prog = efx.capture(several_keys, x)
    expected = prog.run_flat([x])
    for other in (efx.unlift_tokens(prog), efx.remove_effect_tokens(prog),
                  efx.capture(several_keys, x, functionalize=False)):
        torch.testing.assert_close(other.run_flat([x]), expected)


def test_compile_runs_token_free() -> None:
    """The default efx.compile backend runs the token-free form."""
    cfn = efx.compile(several_keys)
    x = torch.randn(3)
    with recording() as log:
        out = cfn(x)
    with recording() as eager_log:
        expected = several_keys(x)
    torch.testing.assert_close(out, expected)
    assert log == eager_log
    assert [p.form for p in cfn.programs()] == ["token-free"]


def test_debug_mode_verifies_after_each_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """EFFECTFX_DEBUG=1: a pass that breaks the chain is named in the error."""
    monkeypatch.setenv("EFFECTFX_DEBUG", "1")
    prog = efx.capture(several_keys, torch.randn(3))

    def drop_first_effect(p):
        gm = efx.remove_effect_tokens(p).graph_module  # a token-free graph, labelled functionalized
        return p.replace(graph_module=gm)

    with pytest.raises(efx.VerificationError, match="after pass 'drop_first_effect'"):
        run_passes(prog, [drop_first_effect])
    run_passes(prog, [dead_code_elimination_pass])


def test_forms_are_enums_named_by_their_strings() -> None:
    """``Program.form`` is a ``Form`` that compares with, prints as and is given by its name (program text,
    messages and saved files read as before); its output leaves' kinds are ``OutputKind``."""
    prog = efx.capture(lambda x: (torch.ops.efxtest.bump(x, "k"), "tag"), torch.randn(3))
    assert prog.form is Form.FUNCTIONALIZED and prog.form == "functionalized"
    assert f"{prog.form}" == str(prog.form) == "functionalized"
    assert str(prog).startswith("# effectfx <lambda>, functionalized form; made by: capture")
    assert prog.replace(form="token-free").form is Form.TOKEN_FREE
    kinds = [leaf.kind for leaf in prog.out_layout]
    assert kinds == [OutputKind.TENSOR, OutputKind.CONST] == ["tensor", "const"]
    assert efx.remove_effect_tokens(prog).form is Form.TOKEN_FREE


def test_passes_reject_wrong_forms() -> None:
    x = torch.randn(3)
    with pytest.raises(efx.EffectfxError, match="functionalized"):
        efx.unlift_tokens(efx.capture(several_keys, x, functionalize=False))
    with pytest.raises(efx.EffectfxError, match="token-free"):
        efx.unlift_tokens(efx.remove_effect_tokens(efx.capture(several_keys, x)))
