"""unlift_tokens: functionalized form -> unlifted form (Note [Effect tokens]).

Contract: requires the functionalized form; gives a new Program in which no graph takes or returns a
token, each graph starts its chains with ``make_token()`` (one per key, sorted) and ends them with
``sink_tokens([...])``, and each call of an effectful region is wrapped, keeping the per-key chains.
The input Program is not modified; a region shared by many call sites stays one subgraph.

The wrapped call of a region with keys ``k1 < k2 < ...``: the token argument is the caller's current token
of ``k1`` when the region has one key, and the tuple of the current tokens of all its keys (sorted) when it
has several; element 0 of the result is that token (tuple) again, the region's outputs follow::

    with_effects(token, invoke_subgraph, body, 'subgraph_0', *operands) -> (token', *outs)
    with_effects((t_memory, t_stdout), invoke_subgraph, body, 'subgraph_0', *operands)
        -> ((t_memory', t_stdout'), *outs)

Rules, keyed by call target (``RULES``):

============================  ===========================================================================
token placeholder              ``make_token()``
``invoke_subgraph(body, id,    ``with_effects(tokens, invoke_subgraph, body', id, *ops)`` when ``n > 0``;
*tokens, *ops)``               ``getitem(c, i)`` -> token ``i`` (i < n) or ``getitem(w, i - n + 1)``
token outputs                  ``sink_tokens([...])`` before the output
anything else                  copied
============================  ===========================================================================
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch.fx as fx

from .. import ops
from ..program.program import Program
from ..program.records import Form
from . import control_flow
from .pipeline import run_passes
from .rewrite import GraphContext, GraphRewrite, boundary_keys, wrapped_results


def make_token_name(key: str, n_keys: int) -> str:
    return "token" if n_keys == 1 else "token_" + re.sub(r"\W", "_", key)


class UnliftTokens(GraphRewrite):
    form_in = (Form.FUNCTIONALIZED, Form.UNLIFTED)
    form_out = Form.UNLIFTED

    def __init__(self, form: Form) -> None:
        super().__init__(form)
        self.rules = {ops.invoke_subgraph: self.invoke_subgraph, operator.getitem: self.getitem}
        for op in ops.CONTROL_FLOW:  # Note [Control flow]
            self.rules[op] = lambda ctx, node: control_flow.unlift(ctx, node, self.form)

    def placeholder(self, ctx: GraphContext, node: fx.Node, index: int) -> Any:
        return None if index < len(ctx.keys) else ctx.copy(node)  # tokens: made in ``begin``

    def begin(self, ctx: GraphContext) -> None:
        placeholders = [n for n in ctx.old.graph.nodes if n.op == "placeholder"]
        for key, old in zip(ctx.keys, placeholders):
            token = ctx.graph.create_node("call_function", ops.make_token, (), {},
                                          name=make_token_name(key, len(ctx.keys)))
            token.meta = {**old.meta, "effectfx_token_key": key}
            ctx.env[old] = token

    def finish(self, ctx: GraphContext, node: fx.Node) -> None:
        outs = node.args[0]
        n = len(ctx.keys)
        sink = ctx.graph.call_function(ops.sink_tokens, (ctx.args(list(outs[:n]), node),))
        sink.meta["effectfx_token_keys"] = ctx.keys
        ctx.graph.output(tuple(ctx.args(list(outs[n:]), node)))

    def invoke_subgraph(self, ctx: GraphContext, node: fx.Node) -> Any:
        attr, identifier, *operands = node.args
        n = len(boundary_keys(getattr(ctx.old, attr.target), self.form))
        if n == 0:
            return self.default(ctx, node)
        tokens = ctx.args(operands[:n], node)
        token_arg = tokens[0] if n == 1 else tuple(tokens)
        call = ctx.graph.call_function(
            ops.with_effects,
            (token_arg, ops.invoke_subgraph, ctx.env[attr], identifier, *ctx.args(operands[n:], node)),
        )
        call.meta.update(node.meta)
        return wrapped_results(ctx, call, n)


def unlift_tokens_pass(prog: Program) -> Program:
    """Functionalized -> unlifted (see the module docstring for the contract and rules)."""
    return UnliftTokens(prog.form).program(prog)


unlift_tokens_pass.__name__ = "unlift_tokens"


def unlift_tokens(prog: Any) -> Any:
    """``efx.unlift_tokens``: a new unlifted Program (or TrainingProgram, both halves), stamped in its history
    and verified in debug mode."""
    return run_passes(prog, [unlift_tokens_pass])
