"""The token rules of control flow: the higher-order ops of ``effectfx.ops.HOPS`` whose tokens lead a
tuple argument, in the token passes and the verifier (Note [Control flow]).

A control-flow node is ``effectfx.ops.cond(pred, true_graph, false_graph, operands)``,
``while_loop(cond_graph, body_graph, carried, additional)`` or ``scan(combine_graph, init, xs, additional)``.
Tokens lead one tuple argument (``TOKEN_ARG``: the operands, the carried values, the initial carry) and
the results; every subgraph of the node takes and returns the tokens of every key any of them performs
(``gm.meta["effectfx_control_flow"]``, kept by every rebuild), passing through those it does not use.
"""

from __future__ import annotations

import re
from typing import Any

import torch.fx as fx

from .. import ops
from ..graph.walk import control_flow_graphs, get_attr, set_attr
from ..program.records import Form
from .rewrite import GraphContext, Results, wrapped_results

TOKEN_ARG = {op: ops.HOPS[op].token_arg for op in ops.CONTROL_FLOW}  # the table's, by target
META = "effectfx_control_flow"  # a subgraph of control flow: the token keys at its boundary


def cf_target(node: fx.Node) -> Any:
    """The control-flow op ``node`` calls (directly, or wrapped by the unlifted form's with_effects)."""
    if node.op != "call_function":
        return None
    target = node.target
    if target is ops.with_effects and len(node.args) > 1:
        target = node.args[1]
    return target if target in TOKEN_ARG else None


def subgraph_keys(gm: fx.GraphModule, form: Form) -> tuple[str, ...]:
    """The token keys at a control-flow subgraph's boundary in ``form``."""
    return tuple(gm.meta.get(META, ())) if form is Form.FUNCTIONALIZED else ()


def with_token_keys(gm: fx.GraphModule, keys: tuple[str, ...]) -> fx.GraphModule:
    """``gm`` (functionalized, taking and returning ``gm.meta['effectfx_token_keys']``) made to take and
    return the tokens of ``keys`` (a superset, sorted): the others pass through.  Changes ``gm`` in place:
    each control-flow subgraph belongs to one node."""
    have = tuple(gm.meta.get("effectfx_token_keys", ()))
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tokens = dict(zip(have, placeholders[: len(have)]))
    first = placeholders[len(have)] if len(placeholders) > len(have) else next(
        n for n in graph.nodes if n.op != "placeholder")
    for key in keys:
        node = tokens.get(key)
        if node is None:
            with graph.inserting_before(first):
                node = tokens[key] = graph.placeholder("token_" + re.sub(r"\W", "_", key))
            node.meta["val"] = ops.make_token()
        first.prepend(node)
        name = "token" if len(keys) == 1 else "token_" + re.sub(r"\W", "_", key)  # as thread_tokens names
        if node.name != name:
            node._rename(name)
            node.target = node.name
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(output.args[0])
    finals = dict(zip(have, outs[: len(have)]))
    output.args = ((*[finals.get(k, tokens[k]) for k in keys], *outs[len(have):]),)
    gm.meta["effectfx_token_keys"] = keys
    gm.meta[META] = keys
    gm.recompile()
    return gm


def thread(ctx: GraphContext, node: fx.Node, token: Any, thread_keys: Any) -> Results:
    """thread_tokens' rule: the node takes the current tokens of every key its subgraphs perform."""
    attrs = control_flow_graphs(node)
    bodies = [get_attr(ctx.holder, a.target) for a in attrs]  # already rebuilt, with their own keys
    keys = tuple(sorted(set().union(*(b.meta["effectfx_token_keys"] for b in bodies))))
    for attr, body in zip(attrs, bodies):
        set_attr(ctx.holder, attr.target, with_token_keys(body, keys))
    args = list(ctx.args(node.args, node))
    i = TOKEN_ARG[node.target]
    args[i] = (*[token(ctx, k) for k in keys], *args[i])
    call = ctx.graph.call_function(node.target, tuple(args))
    call.meta.update(node.meta)
    thread_keys(ctx, call, keys)
    return Results(call, n_tokens=0, shift=-len(keys))


def n_tokens(ctx: GraphContext, node: fx.Node, form: Form, offset: int = 0) -> int:
    attrs = control_flow_graphs(node)
    return len(subgraph_keys(get_attr(ctx.old, attrs[0].target), form)) if attrs else 0


def strip(ctx: GraphContext, node: fx.Node, form: Form) -> tuple[Any, list, int]:
    """(op, new args without the tokens, number of tokens) of a functionalized control-flow node."""
    n = n_tokens(ctx, node, form)
    args = list(node.args)
    i = TOKEN_ARG[node.target]
    tokens, args[i] = list(args[i][:n]), tuple(args[i][n:])
    return tokens, args, n


def remove(ctx: GraphContext, node: fx.Node, form: Form) -> Results:
    """remove_effect_tokens' rule for a functionalized node: its tokens dropped, results shifted."""
    _, args, n = strip(ctx, node, form)
    call = ctx.graph.call_function(node.target, tuple(ctx.args(args, node)))
    call.meta.update(node.meta)
    return Results(call, n_tokens=n, shift=n)


def unlift(ctx: GraphContext, node: fx.Node, form: Form) -> Any:
    """unlift_tokens' rule: ``with_effects(token(s), op, *args without tokens)``, as a region call is."""
    tokens, args, n = strip(ctx, node, form)
    if n == 0:
        return ctx.copy(node)
    new_tokens = ctx.args(tokens, node)
    call = ctx.graph.call_function(ops.with_effects, (
        new_tokens[0] if n == 1 else tuple(new_tokens), node.target, *ctx.args(args, node)))
    call.meta.update(node.meta)
    return wrapped_results(ctx, call, n)


def verify_node(verifier: Any, check: Any, gm: fx.GraphModule, node: fx.Node, wrapped: bool) -> tuple:
    """The verifier's rule: every subgraph of the node has the same token boundary, the union of their
    keys (sorted); the node consumes the current token of each (functionalized: leading the token
    argument; unlifted: wrapped in with_effects) and its first results are the new tokens."""
    form = verifier.form
    args = node.args[2:] if wrapped else node.args
    target = node.args[1] if wrapped else node.target
    bodies = [get_attr(gm, a.target) for a in args if isinstance(a, fx.Node) and a.op == "get_attr"]
    keys = tuple(sorted(set().union(*(verifier.keys_of(b) for b in bodies))))
    for body in bodies:
        if form is Form.FUNCTIONALIZED and subgraph_keys(body, form) != keys:
            check.fail(node, f"a subgraph of this {target.__name__} takes tokens "
                             f"{list(subgraph_keys(body, form))} but its subgraphs perform {list(keys)}.",
                       "every subgraph of a control-flow op takes and returns the tokens of every key "
                       "any of them performs (Note [Control flow])")
    if form is Form.FUNCTIONALIZED and not wrapped:
        tokens = args[TOKEN_ARG[target]][: len(keys)]
        for j, (key, t) in enumerate(zip(keys, tokens)):
            check.consume(t, key, node)
            check.expect(node, j, key)
    elif form is Form.UNLIFTED and keys and not wrapped:
        check.fail(node, f"{target.__name__} has effects {list(keys)} but its call is not wrapped.",
                   "wrap it in with_effects, as an effectful region call is")
    where = f"a subgraph of {node.name} ({target.__name__})"
    for body in bodies:
        if id(body) not in verifier.done:
            verifier.graph(body, where, subgraph_keys(body, form), subgraph=True)
    return keys


def allowed_tokens(node: fx.Node, gm: fx.GraphModule, form: Form) -> list:
    """The token operands a functionalized control-flow node may read (the verifier's ``uses``)."""
    attrs = control_flow_graphs(node)
    if form is not Form.FUNCTIONALIZED or not attrs or node.target is ops.with_effects:
        return []
    n = len(subgraph_keys(get_attr(gm, attrs[0].target), form))
    return list(node.args[TOKEN_ARG[node.target]][:n])
