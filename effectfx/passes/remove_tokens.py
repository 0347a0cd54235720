"""remove_effect_tokens: functionalized or unlifted form -> token-free form (Note [Effect tokens]).

Contract: requires the functionalized, unlifted (or captured) form; gives a new Program with no token in
any graph or signature, each ``with_effects(t, op, *args)`` replaced by ``op(*args)`` and ``getitem``
indices shifted past the tokens; effects stay in node order and are kept alive by their impurity (the
registry, Note [Effect tokens]).  The input Program is not modified; shared regions stay shared.

Rules, keyed by call target (``RULES``):

============================  ===========================================================================
``with_effects(t, op, *a)``    ``op(*a)``; ``getitem(w, 0)`` is the token, ``getitem(w, i)`` becomes
                               ``op(*a)`` itself (single result) or ``getitem(op(*a), i - 1)``
``with_effects(t, invoke_      ``invoke_subgraph(body', id, *ops)``; ``getitem(w, 0)`` is the token(s),
subgraph, body, id, *ops)``    ``getitem(w, i)`` -> ``getitem(call, i - 1)``                    (unlifted)
``invoke_subgraph(body, id,    ``invoke_subgraph(body', id, *ops)`` without the body's ``n`` tokens;
*tokens, *ops)``               ``getitem(c, i)`` -> ``getitem(call, i - n)``              (functionalized)
``make_token()``               the token (no node)
``sink_tokens([...])``         dropped
token placeholder / output     dropped from the signature
============================  ===========================================================================
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from .. import ops
from ..program.program import Program
from ..program.records import Form
from . import control_flow
from .pipeline import run_passes
from .rewrite import TOKEN, GraphContext, GraphRewrite, Results, boundary_keys, returns_single_value


class RemoveTokens(GraphRewrite):
    form_in = (Form.FUNCTIONALIZED, Form.UNLIFTED, Form.CAPTURED)
    form_out = Form.TOKEN_FREE

    def __init__(self, form: Form) -> None:
        super().__init__(form)
        self.rules = {
            ops.with_effects: self.with_effects,
            ops.invoke_subgraph: self.invoke_subgraph,
            ops.make_token: lambda ctx, node: TOKEN,
            ops.sink_tokens: lambda ctx, node: None,
            operator.getitem: self.getitem,
        }
        for op in ops.CONTROL_FLOW:  # Note [Control flow]
            self.rules[op] = lambda ctx, node: control_flow.remove(ctx, node, self.form)

    def placeholder(self, ctx: GraphContext, node: fx.Node, index: int) -> Any:
        return TOKEN if index < len(ctx.keys) else ctx.copy(node)

    def finish(self, ctx: GraphContext, node: fx.Node) -> None:
        outs = [o for o in node.args[0] if not (isinstance(o, fx.Node) and ctx.env[o] is TOKEN)]
        ctx.graph.output(tuple(ctx.args(outs, node)))

    def with_effects(self, ctx: GraphContext, node: fx.Node) -> Any:
        _token, op, *args = node.args
        if op is ops.invoke_subgraph:
            attr, identifier, *operands = args
            call = self._call(ctx, node, attr, identifier, operands)
            return Results(call, n_tokens=1, shift=1)
        call = ctx.graph.call_function(op, tuple(ctx.args(args, node)), ctx.args(dict(node.kwargs), node))
        call.meta.update(node.meta)
        return Results(call, n_tokens=1, shift=1, single=returns_single_value(op, node))

    def invoke_subgraph(self, ctx: GraphContext, node: fx.Node) -> Any:
        attr, identifier, *operands = node.args
        n = len(boundary_keys(getattr(ctx.old, attr.target), self.form))
        return Results(self._call(ctx, node, attr, identifier, operands[n:]), n_tokens=n, shift=n)

    def _call(self, ctx: GraphContext, node: fx.Node, attr: fx.Node, identifier: str,
              operands: list) -> fx.Node:
        call = ctx.graph.call_function(ops.invoke_subgraph,
                                       (ctx.env[attr], identifier, *ctx.args(operands, node)))
        call.meta.update(node.meta)
        return call


def remove_effect_tokens_pass(prog: Program) -> Program:
    """Functionalized/unlifted -> token-free (see the module docstring for the contract and rules)."""
    return RemoveTokens(prog.form).program(prog)


remove_effect_tokens_pass.__name__ = "remove_effect_tokens"


def remove_effect_tokens(prog: Any) -> Any:
    """``efx.remove_effect_tokens``: a new token-free Program (or TrainingProgram, both halves), stamped in
    its history and verified in debug mode."""
    return run_passes(prog, [remove_effect_tokens_pass])
