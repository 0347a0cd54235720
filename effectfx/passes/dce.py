"""Dead-code elimination that asks the effect registry: it never removes an effect.

Contract: requires any form; guarantees the same effects in the same order and the same outputs, with
pure nodes whose values nobody reads removed.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from .. import ops
from ..effects import node_effect_keys
from ..runtime.program import Program
from .pipeline import run_passes
from .rewrite import GraphContext, GraphRewrite

_ALWAYS_LIVE = {ops.sink_tokens, ops.with_effects}


def is_effectful(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    return node.target in _ALWAYS_LIVE or bool(node_effect_keys(node))


def eliminate_dead_code(graph: fx.Graph) -> fx.Graph:
    """Remove, in place, every pure node whose value is unused; returns the graph."""
    for node in reversed(list(graph.nodes)):
        if not node.users and not is_effectful(node):
            graph.erase_node(node)
    return graph


class _CopyGraphs(GraphRewrite):
    """Every graph copied as is (same form, same tokens), then dead code removed from the copy."""

    form_in = ("captured", "functionalized", "unlifted", "token-free")

    def token_keys_out(self, ctx: GraphContext) -> tuple[str, ...]:
        return ctx.keys

    def done(self, gm: fx.GraphModule) -> None:
        eliminate_dead_code(gm.graph)
        gm.recompile()


def dead_code_elimination_pass(prog: Program) -> Program:
    """Any form -> same form: a new Program whose graphs lack the pure nodes nobody reads; every effect,
    effectful region call and token stays (the registry decides, via :func:`is_effectful`)."""
    rewrite = _CopyGraphs(prog.form)
    rewrite.form_out = prog.form
    keys = tuple(prog.token_keys) if prog.form == "functionalized" else ()
    return prog.replace(graph_module=rewrite.rebuild(prog.graph_module, keys))


dead_code_elimination_pass.__name__ = "dead_code_elimination"


def dead_code_elimination(prog: Any) -> Any:
    """``efx.dead_code_elimination``: a new Program (or TrainingProgram, both halves) without dead pure
    nodes, stamped in its history and verified in debug mode like every other pass."""
    return run_passes(prog, [dead_code_elimination_pass])
