"""efx.compile's default backend goes captured -> token-free with discover_effects; the long way round
(thread_tokens, then remove_effect_tokens) must give the same graphs: same calls in the same order."""

from __future__ import annotations

import torch
from torch import nn

import effectfx as efx
from effectfx.graph.walk import subgraphs
from effectfx.passes.pipeline import run_passes
from effectfx.passes.thread_tokens import discover_effects, thread_tokens
from effectfx.testing import check_against_eager
from effectfx.testing.models import Block

R = torch.ops.efxtest


def _calls(gm: torch.fx.GraphModule) -> list[str]:
    return [str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes
            if n.op == "call_function" and n.target.__name__ != "getitem"]


def _shape(prog: efx.Program) -> list[tuple[str, list[str]]]:
    return [("root", _calls(prog.graph_module))] + [
        (ident, _calls(body)) for _, ident, body in subgraphs(prog.graph_module)
    ]


@efx.region
def inner(x):
    R.record_memory("inner")
    return R.scale(x.sin(), 2.0)


@efx.region
def outer(x):
    R.record_stdout("outer")
    y = inner(inner(x))
    R.log_tensor(y, "outer")
    return y * 2


def program(x):
    R.record_collective_tp("start")
    y = outer(outer(x))
    inner(x)  # effect only: result unused
    return y.sum()



def _both_routes(fn, *args):
    captured = efx.capture(fn, *args, functionalize=False)
    short = run_passes(captured, [discover_effects])
    long = run_passes(captured, [thread_tokens, efx.remove_effect_tokens])
    return short, long


def test_routes_agree_for_nested_regions_with_effects() -> None:
    for requires_grad in (False, True):
        short, long = _both_routes(program, torch.randn(3, requires_grad=requires_grad))
        halves = [(short, long)] if not requires_grad else [(short.forward, long.forward),
                                                             (short.backward, long.backward)]
        for a, b in halves:
            assert a.form == b.form == "token-free"
            assert _shape(a) == _shape(b)
            assert a.region_effects == b.region_effects


def test_routes_agree_for_a_module_stack() -> None:
    model = nn.Sequential(Block(), Block(), Block())
    short, long = _both_routes(model, torch.randn(2, 4))
    assert _shape(short.forward) == _shape(long.forward)
    assert _shape(short.backward) == _shape(long.backward)
    # one body: the first block's input needs no gradient, and it shares the others' (promotion)
    assert short.forward.region_effects == {"subgraph_0": frozenset({"memory"})}


def test_compiled_default_backend_matches_eager() -> None:
    check_against_eager(program, torch.randn(3, requires_grad=True), forms=())
    check_against_eager(nn.Sequential(Block(), Block()), torch.randn(2, 4), forms=())


def test_replaced_submodule_is_seen() -> None:
    """Compiled modules read parameters from submodules: replacing one must not leave a stale program."""
    model = nn.Sequential(Block(), Block())
    cm = efx.compile(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        cm(x)
        model[1] = Block()
        torch.testing.assert_close(cm(x), model(x))
    assert cm.stats.compiles == 2
