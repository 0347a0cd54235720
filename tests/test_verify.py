"""The verifier: every form of real programs passes; hand-corrupted graphs raise VerificationError naming
the problem, showing the graph around the offending node."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

import effectfx as efx
import effectfx.testing  # noqa: F401  (registers the efxtest:: effect ops)
from effectfx import ops


@efx.region
def region(x):
    torch.ops.efxtest.record_memory("N")
    return x + x


def seed(x):
    y = region(region(x))
    torch.ops.efxtest.record_stdout("end")
    return y


def private(prog):
    """A copy whose graphs a test may edit (DCE rebuilds every graph)."""
    return efx.dead_code_elimination(prog)


def nodes(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


@pytest.fixture
def functionalized():
    return private(efx.capture(seed, torch.randn(3)))


@pytest.mark.parametrize("form", ["captured", "functionalized", "unlifted", "token-free"])
def test_every_form_verifies(form: str) -> None:
    prog = efx.capture(seed, torch.randn(3), functionalize=form != "captured")
    passes = {"unlifted": efx.unlift_tokens, "token-free": efx.remove_effect_tokens}
    prog = passes.get(form, lambda p: p)(prog)
    assert prog.form == form
    efx.verify(prog)


def check(prog, *fragments: str) -> None:
    with pytest.raises(efx.VerificationError) as info:
        efx.verify(prog)
    text = str(info.value)
    assert ">>" in text and "Fix:" in text, text
    for fragment in fragments:
        assert fragment in text, text


def test_unwrapped_effect(functionalized) -> None:
    gm = functionalized.graph_module
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        gm.graph.call_function(torch.ops.efxtest.record_memory.default, ("stray",))
    check(functionalized, "efxtest.record_memory.default", "not wrapped in with_effects")


def test_token_consumed_twice(functionalized) -> None:
    gm = functionalized.graph_module
    first, second = nodes(gm, ops.invoke_subgraph)
    second.update_arg(2, first.args[2])  # the second call takes the root's input token again
    check(functionalized, "consumed twice", "the root graph")


def test_token_used_as_data(functionalized) -> None:
    gm = functionalized.graph_module
    token = next(n for n in gm.graph.nodes if n.op == "placeholder")
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        gm.graph.call_function(torch.ops.aten.add.Tensor, (token, 1))
    check(functionalized, f"token {token.name} is used as data")


def test_dropped_token_result(functionalized) -> None:
    gm = functionalized.graph_module
    wrapped = nodes(gm, ops.with_effects)[0]
    token_out = next(iter(wrapped.users))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.update_arg(0, tuple(wrapped.args[0] if a is token_out else a for a in out.args[0]))
    check(functionalized, "stdout")


def test_with_effects_in_token_free_form() -> None:
    prog = private(efx.remove_effect_tokens(efx.capture(seed, torch.randn(3))))
    gm = prog.graph_module
    effect = nodes(gm, torch.ops.efxtest.record_stdout.default)[0]
    with gm.graph.inserting_before(effect):
        token = gm.graph.call_function(ops.make_token, ())
    effect.target = ops.with_effects
    effect.args = (token, torch.ops.efxtest.record_stdout.default, *effect.args)
    check(prog, "appears in the token-free form")


def test_call_site_operand_count(functionalized) -> None:
    gm = functionalized.graph_module
    call = nodes(gm, ops.invoke_subgraph)[0]
    call.args = call.args[:-1]
    check(functionalized, "passes 1 operands", "takes 2")


def test_getitem_out_of_range() -> None:
    prog = private(efx.remove_effect_tokens(efx.capture(seed, torch.randn(3))))
    gm = prog.graph_module
    get = next(n for n in gm.graph.nodes if n.target is operator.getitem)
    get.update_arg(1, 1)  # the token-free region returns one value: index 1 was the functionalized one
    check(prog, "getitem index 1", "gives 1 results")


def test_unlifted_missing_sink() -> None:
    prog = private(efx.unlift_tokens(efx.capture(seed, torch.randn(3))))
    gm = prog.graph_module
    gm.graph.erase_node(nodes(gm, ops.sink_tokens)[0])
    check(prog, "sink_tokens")


def test_unlifted_unwrapped_region_call() -> None:
    prog = private(efx.unlift_tokens(efx.capture(seed, torch.randn(3))))
    gm = prog.graph_module
    call = nodes(gm, ops.with_effects)[0]
    call.args = call.args[2:]
    call.target = ops.invoke_subgraph
    check(prog, "its call is not wrapped")


def test_region_body_keys_disagree_with_signature(functionalized) -> None:
    body = next(iter(functionalized.subgraphs().values()))
    body.meta["effectfx_token_keys"] = ("memory", "stdout")
    check(functionalized, "takes tokens", "memory")


def test_after_names_the_pass(functionalized) -> None:
    gm = functionalized.graph_module
    first, second = nodes(gm, ops.invoke_subgraph)
    second.update_arg(2, first.args[2])
    with pytest.raises(efx.VerificationError, match="after pass 'my_pass'"):
        efx.verify(functionalized, after="my_pass")
