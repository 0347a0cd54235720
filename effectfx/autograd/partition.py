"""Split a joint forward+backward graph by phase (see Note [Joint trace] in effectfx.notes).

Contract: requires a graph whose nodes carry ``meta["phase"]`` and whose output is
``(*outs, *grads)``; gives a forward graph ``inputs -> (*outs, *saved)`` and a backward graph
``(*saved, *tangents) -> grads``, where ``saved`` are exactly the forward values backward nodes read.
With ``pass_inputs`` (a region body), saved values that are tensor inputs of the forward are not
returned: the caller already holds them and passes them to the backward itself (``Partition.inputs``);
so are label inputs (strings) the backward reads -- an effect its recompute performs again, as
``torch.utils.checkpoint`` does (Note [Region identity], labels).
Every effectful node survives, in the graph of its phase.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..errors import CaptureError
from ..graph.build import Graph, graph_module, node_name
from ..graph.symbols import Sizes, expr_of, is_symbolic
from ..graph.walk import effectful_nodes


@dataclass
class Partition:
    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: list[fx.Node]  # forward-phase nodes of the joint graph, in forward order
    inputs: tuple[int | None, ...] = ()  # per saved value: its input index when not returned, else None


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get("phase") == "backward" and not (
        node.op == "placeholder" and not node.meta.get("tangent")
    )


def _live(roots: list[fx.Node], inside: set[fx.Node]) -> set[fx.Node]:
    live: set[fx.Node] = set()
    stack = [n for n in roots if n in inside]
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        stack.extend(n for n in node._input_nodes if n in inside)  # the dict all_input_nodes copies
    return live


def _copy(graph: fx.Graph, nodes: list[fx.Node], env: dict[fx.Node, fx.Node]) -> None:
    """``graph.node_copy`` of each node, without FX's lookup-table update for the new node's meta."""
    for node in nodes:
        args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
        copy = env[node] = graph.create_node(node.op, node.target, args, kwargs, node.name, node.type)
        copy.meta.update(node.meta)


def without_gradients(backward: fx.GraphModule, keep: tuple[bool, ...]) -> fx.GraphModule:
    """``backward`` returning only the gradients in ``keep`` (None for the others), with only the nodes
    those and its effects read, named afresh: it reads as if traced without the others."""
    nodes = list(backward.graph.nodes)
    outs = [o if k else None for o, k in zip(nodes[-1].args[0], keep)]
    inside = set(nodes[:-1])
    live = _live([o for o in outs if o is not None] + effectful_nodes(nodes[:-1]), inside)
    graph, env = Graph(), {}
    for node in nodes[:-1]:
        if node.op == "placeholder" or node in live:
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            name = node.name if node.op in ("placeholder", "get_attr") else node_name(node.target)
            env[node] = graph.create_node(node.op, node.target, args, kwargs, name, node.type)
            env[node].meta.update(node.meta)
    graph.output(tuple(env[o] if o is not None else None for o in outs))
    module = graph_module(backward, graph, "Backward")
    module.meta.update(backward.meta)
    return module


def _size_inputs(sizes: list[fx.Node], available: list[fx.Node], inputs: list[fx.Node]) -> set[fx.Node]:
    """The forward inputs the backward must also be given to read ``sizes`` from (a ``sum``'s backward
    saves no tensor, yet expands its gradient to the input's size)."""
    have: set = set()
    for node in available:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            have.update(expr_of(d) for d in val.shape if type(d) is not int)
    table = Sizes(Graph())
    for node in inputs:
        table.add_input(node, node.meta.get("val"))
    extra = set()
    for node in sizes:
        for symbol in expr_of(node.meta["val"]).free_symbols - have:
            where = table.source(symbol)
            if where is None:
                raise CaptureError(f"the backward needs the size {symbol}, which no input of the forward has "
                                   "as a dimension (Note [Symbolic shapes]); compile with dynamic=False.")
            extra.add(where[0])
            have.update(expr_of(d) for d in where[0].meta["val"].shape if type(d) is not int)
    return extra


def partition_joint(joint: fx.GraphModule, n_outs: int, pass_inputs: bool = False) -> Partition:
    nodes = list(joint.graph.nodes)
    output = nodes[-1]
    results = list(output.args[0])
    outs, grads = results[:n_outs], results[n_outs:]
    backward = {n for n in nodes[:-1] if _is_backward(n)}
    forward = {n for n in nodes[:-1] if n not in backward}

    effectful = effectful_nodes(nodes[:-1])
    live_bwd = _live([g for g in grads if g is not None] + [n for n in effectful if n in backward], backward)
    read = {i for n in live_bwd for i in n._input_nodes if i in forward}
    # a module attribute (a subgraph, a constant) a backward node reads is fetched again by the backward
    # graph, not saved: a gradient the captured code takes itself makes the forward fetch a backward subgraph
    attrs = {i for i in read if i.op == "get_attr"}
    tangents = [n for n in nodes if n.op == "placeholder" and n.meta.get("tangent")]
    # sizes are never saved: the backward reads them from its own inputs (Note [Symbolic shapes])
    sizes = [n for n in nodes if n in read and is_symbolic(n.meta.get("val"))]
    read.difference_update(sizes)
    if sizes:
        read.update(_size_inputs(sizes, [n for n in nodes if n in read] + tangents,
                                 [n for n in nodes if n.op == "placeholder" and n in forward]))
    saved = [n for n in nodes if n in read and n not in attrs]
    live_fwd = _live(outs + saved + [n for n in effectful if n in forward], forward)

    bwd_graph = Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for node in saved:
        ph = bwd_graph.create_node("placeholder", node.name, name=node.name)
        ph.meta.update(node.meta)  # (assigning meta costs FX a lookup-table update)
        ph.meta["phase"] = "backward"
        benv[node] = ph
    _copy(bwd_graph, tangents, benv)
    if sizes:
        table = Sizes(bwd_graph, {"phase": "backward"})
        for node in (*saved, *tangents):
            table.add_input(benv[node], node.meta.get("val"))
        for node in sizes:
            benv[node] = table.node(node.meta["val"])
    _copy(bwd_graph, [n for n in nodes if (n in live_bwd or n in attrs) and n not in benv], benv)
    bwd_graph.output(tuple(benv[g] if g is not None else None for g in grads))
    bwd = graph_module(joint, bwd_graph, "Backward")

    # a body's saved tensor inputs are the call site's to pass (Partition.inputs)
    position = {n: i for i, n in enumerate(n for n in nodes if n.op == "placeholder" and n in forward)
                if pass_inputs and isinstance(n.meta.get("val"), (torch.Tensor, str))}
    inputs = tuple(position.get(n) for n in saved)
    # the joint module is ours and dies here: cut it down to the forward module in place (no copy)
    output.args = ((*outs, *[n for n, i in zip(saved, inputs) if i is None]),)
    for node in reversed(nodes[:-1]):
        if node not in live_fwd and not (node.op == "placeholder" and node in forward):
            joint.graph.erase_node(node)
            if node.op == "get_attr":
                delattr(joint, node.target)
    joint.recompile()
    return Partition(joint, bwd, saved, inputs)
