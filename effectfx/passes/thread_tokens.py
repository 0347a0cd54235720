"""thread_tokens: captured form -> functionalized form (see Note [Effect tokens], Note [Region identity]).

Contract: requires the captured form; gives a new Program in which every effectful op is a
``with_effects`` node, every graph with effects takes and returns one token per key (sorted), and every
region call threads the caller's current tokens.  The input Program is not modified.

Effect discovery (Note [Region identity], last paragraph): a body is functionalized with no tokens of its
own; a token appears the first time the body needs one, and the keys whose token differs after the body
from before it are the region's effects, checked against what earlier captures saw
(``effectfx.regions.effects``).
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch.fx as fx

from .. import ops
from ..effects import effect_of
from ..graph.walk import get_attr, graph_effect_keys, subgraphs
from ..program.program import Program
from ..program.records import Form, RegionEntry
from ..regions.effects import check_body_effects, commit_body_effects
from . import control_flow
from .rewrite import GraphContext, GraphRewrite, Results, returns_single_value


class ThreadTokens(GraphRewrite):
    """The rules of :func:`thread_tokens` on the shared rebuild (``passes.rewrite``): each body once."""

    form_in = (Form.CAPTURED,)
    form_out = Form.FUNCTIONALIZED

    def __init__(self) -> None:
        super().__init__(Form.CAPTURED)
        self.rules = {ops.invoke_subgraph: self.invoke_subgraph, operator.getitem: self.getitem}
        for op in ops.CONTROL_FLOW:  # Note [Control flow]
            self.rules[op] = lambda ctx, node: control_flow.thread(ctx, node, self.token, self._thread)
        self.effects: dict[str, frozenset[str]] = {}  # identifier -> keys
        self.commits: list[tuple[Any, Any, frozenset[str]]] = []

    def begin(self, ctx: GraphContext) -> None:
        ctx.start, ctx.current = {}, {}  # key -> token before the graph / latest token

    def token(self, ctx: GraphContext, key: str) -> fx.Node:
        if key not in ctx.current:  # a token appears the first time the graph needs one
            ph = ctx.graph.placeholder("token_" + re.sub(r"\W", "_", key))
            ph.meta["val"] = ops.make_token()
            ctx.start[key] = ctx.current[key] = ph
        return ctx.current[key]

    def _thread(self, ctx: GraphContext, call: fx.Node, keys: tuple[str, ...]) -> None:
        for j, key in enumerate(keys):
            ctx.current[key] = ctx.graph.call_function(operator.getitem, (call, j))

    def invoke_subgraph(self, ctx: GraphContext, node: fx.Node) -> Any:
        attr, identifier, *operands = node.args
        keys = get_attr(ctx.holder, attr.target).meta["effectfx_token_keys"]  # the rebuilt body's
        call = ctx.graph.call_function(ops.invoke_subgraph, (
            ctx.env[attr], identifier, *[self.token(ctx, k) for k in keys], *ctx.args(operands, node)))
        call.meta.update(node.meta)
        self._thread(ctx, call, keys)
        return Results(call, n_tokens=0, shift=-len(keys))

    def default(self, ctx: GraphContext, node: fx.Node) -> Any:
        key = effect_of(node.target) if node.op == "call_function" else None
        if key is None:
            return ctx.copy(node)
        call = ctx.graph.call_function(ops.with_effects, (
            self.token(ctx, key), node.target, *ctx.args(node.args, node)), ctx.args(dict(node.kwargs), node))
        call.meta.update(node.meta)
        self._thread(ctx, call, (key,))
        if returns_single_value(node.target, node):
            return ctx.graph.call_function(operator.getitem, (call, 1))
        return Results(call, n_tokens=0, shift=-1)

    def finish(self, ctx: GraphContext, node: fx.Node) -> None:
        # the graph's effects: keys whose token after the graph differs from the one before it
        keys = tuple(sorted(k for k in ctx.current if ctx.current[k] is not ctx.start[k]))
        ctx.keys_out = keys
        ctx.graph.output((*[ctx.current[k] for k in keys], *ctx.args(node.args[0], node)))
        anchor = next(n for n in ctx.graph.nodes if n.op != "placeholder" or n not in ctx.start.values())
        for key in keys:  # token placeholders first, in sorted key order
            anchor.prepend(ctx.start[key])
        if len(keys) == 1:
            ctx.start[keys[0]]._rename("token")
            ctx.start[keys[0]].target = "token"

    def token_keys_out(self, ctx: GraphContext) -> tuple[str, ...]:
        return ctx.keys_out

    def done(self, gm: fx.GraphModule) -> None:
        info = gm.meta.get("effectfx_region")
        if info is not None:
            keys = frozenset(gm.meta["effectfx_token_keys"])
            self.effects[info[2]] = keys
            check_body_effects(gm, keys, self.commits)


def thread_tokens(prog: Program) -> Program:
    """Captured form -> functionalized form (see the module docstring for the contract)."""
    rewrite = ThreadTokens()
    new = rewrite.program(prog)
    commit_body_effects(rewrite.commits)
    regions = {
        ident: RegionEntry(entry.name, entry.traces, rewrite.effects.get(ident, frozenset()))
        for ident, entry in prog.regions.items()
    }
    return new.replace(token_keys=new.graph_module.meta["effectfx_token_keys"], regions=regions)


def discover_effects(prog: Program) -> Program:
    """Captured form -> token-free form, without rebuilding a graph.

    Contract: requires the captured form; gives the same graphs labelled token-free, with every region's
    effect keys recorded and checked exactly as :func:`thread_tokens` does.  The captured form already is
    token-free (effectful ops are bare and ordered by node order, Note [Effect tokens]), so threading
    tokens and removing them again would rebuild every graph only to arrive where it started; efx.compile's
    default backend takes this shortcut, the tests check both routes agree.
    """
    commits: list = []
    effects: dict[str, frozenset[str]] = {}
    for _, identifier, body in subgraphs(prog.graph_module):
        keys = graph_effect_keys(body)
        effects[identifier] = effects.get(identifier, frozenset()) | keys
        check_body_effects(body, keys, commits)
    commit_body_effects(commits)
    regions = {ident: RegionEntry(e.name, e.traces, effects.get(ident, frozenset()))
               for ident, e in prog.regions.items()}
    return prog.replace(form=Form.TOKEN_FREE, regions=regions)
