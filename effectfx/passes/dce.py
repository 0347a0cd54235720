"""Dead-code elimination that asks the effect registry: it never removes an effect.

Contract: requires any form; guarantees the same effects in the same order and the same outputs, with
pure nodes whose values nobody reads removed.
"""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from ..graph.walk import eliminate_dead_code
from ..program.program import Program
from ..program.records import Form
from .pipeline import run_passes
from .rewrite import GraphContext, GraphRewrite


class _CopyGraphs(GraphRewrite):
    """Every graph copied as is (same form, same tokens), then dead code removed from the copy."""

    form_in = (Form.CAPTURED, Form.FUNCTIONALIZED, Form.UNLIFTED, Form.TOKEN_FREE)

    def token_keys_out(self, ctx: GraphContext) -> tuple[str, ...]:
        return ctx.keys

    def done(self, gm: fx.GraphModule) -> None:
        eliminate_dead_code(gm.graph)
        gm.recompile()


def dead_code_elimination_pass(prog: Program) -> Program:
    """Any form -> same form: a new Program whose graphs lack the pure nodes nobody reads; every effect,
    effectful region call and token stays (the registry decides, via ``graph.walk.is_effectful``)."""
    rewrite = _CopyGraphs(prog.form)
    rewrite.form_out = prog.form
    keys = tuple(prog.token_keys) if prog.form is Form.FUNCTIONALIZED else ()
    return prog.replace(graph_module=rewrite.rebuild(prog.graph_module, keys))


dead_code_elimination_pass.__name__ = "dead_code_elimination"


def dead_code_elimination(prog: Any) -> Any:
    """``efx.dead_code_elimination``: a new Program (or TrainingProgram, both halves) without dead pure
    nodes, stamped in its history and verified in debug mode like every other pass."""
    return run_passes(prog, [dead_code_elimination_pass])
