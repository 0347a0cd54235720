"""inline_regions: token-free form -> token-free form with every region call of the root graph replaced by
its body's nodes, recursively (a body calling a body is inlined too): tier 2's input (``effectfx.backends
.tiers``), so that Inductor sees the whole program as one graph and fuses across call sites.

Contract: requires the token-free form; gives a Program with the same calling convention -- the same inputs,
the same outputs in the same order (a training program's saved values included) -- computing the same
values with the same effects in the same order.  In the token-free form a region call is one node,
``invoke_subgraph(body, identifier, *operands)`` read through ``getitem``; its body's effects run in body
order where the call stood, so copying the body's nodes in order, in place of the call, keeps every effect
in program order (Note [Effect tokens]: the tokens were removed after they had fixed that order).

What stays: the subgraphs of control flow (``cond``, loops; Note [Control flow]) are not entered -- a
region called inside a branch stays a region call there, lowered as tier 1 lowers it; an attribute a body
reads (a constant, a control-flow subgraph) is copied onto the new root under a fresh name.  Symbolic sizes
a body computes from its own inputs (``sym_size`` of a placeholder) are computed again from the root's
inputs (Note [Symbolic shapes]: every size of a graph is read from its inputs, up front), since the body's
inputs are intermediate values once inlined.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from ..errors import BackendError
from ..graph.build import Graph, graph_module
from ..graph.symbols import SYM_TYPES, MissingSize, Sizes
from ..graph.walk import get_attr
from ..program.program import Program
from ..program.records import Form


class _Inliner:
    def __init__(self, root: fx.GraphModule) -> None:
        self.root = root
        self.graph = Graph()
        self.holder = torch.nn.Module()
        self.sizes = Sizes(self.graph)
        self.attrs: dict[int, str] = {}  # id(attribute value) -> its name on the new root

    def attribute(self, owner: fx.GraphModule, node: fx.Node) -> fx.Node:
        value = get_attr(owner, node.target)
        name = self.attrs.get(id(value))
        if name is None:
            name = node.target.replace(".", "_")
            while hasattr(self.holder, name):
                name += "_"
            setattr(self.holder, name, value)
            self.attrs[id(value)] = name
        new = self.graph.get_attr(name)
        new.meta = dict(node.meta)
        return new

    def copy(self, gm: fx.GraphModule, env: dict[fx.Node, Any], top: bool) -> Any:
        """Copy ``gm``'s nodes (placeholders already in ``env``) into the new graph; returns what its output
        returns, in the new graph's terms."""
        calls: dict[fx.Node, tuple] = {}  # an inlined call -> its body's outputs, mapped
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                return fx.map_arg(node.args[0], lambda n: env[n])
            if node.op == "get_attr":
                if all(u.target is ops.invoke_subgraph and u.args[0] is node for u in node.users):
                    continue  # a region body: its calls are inlined
                env[node] = self.attribute(gm, node)
            elif node.op == "call_function" and node.target is ops.invoke_subgraph:
                body = get_attr(gm, node.args[0].target)
                inner = {p: fx.map_arg(a, lambda n: env[n]) for p, a in zip(
                    (p for p in body.graph.nodes if p.op == "placeholder"), node.args[2:])}
                calls[node] = tuple(self.copy(body, inner, top=False))
            elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in calls:
                env[node] = calls[node.args[0]][node.args[1]]
            elif node.op == "call_function" and node.target in (ops.with_effects, ops.make_token,
                                                                 ops.sink_tokens):
                raise BackendError(f"inline_regions needs the token-free form ({node.format_node()}).")
            elif not top and isinstance(node.meta.get("val"), SYM_TYPES):
                try:  # a size of the body's inputs: read it from the root's (Note [Symbolic shapes])
                    env[node] = self.sizes.node(node.meta["val"])
                except MissingSize as e:
                    raise BackendError(f"a region body's size {node.meta['val']} is no size of the "
                                       "program's inputs; the program keeps its regions.") from e
            else:
                env[node] = self.graph.node_copy(node, lambda n: env[n])
        raise BackendError("a graph without an output node")

    def run(self) -> fx.GraphModule:
        env: dict[fx.Node, Any] = {}
        for node in self.root.graph.nodes:
            if node.op == "placeholder":
                env[node] = self.graph.node_copy(node)
                self.sizes.add_input(env[node], node.meta.get("val"))
        self.graph.output(self.copy(self.root, env, top=True))
        inlined = graph_module(self.holder, self.graph, type(self.root).__name__)
        inlined.meta.update(self.root.meta)
        return inlined


def inline_regions(prog: Program) -> Program:
    """Token-free -> token-free, every region call of the root graph inlined (module docstring)."""
    if prog.form is not Form.TOKEN_FREE:
        raise BackendError(f"inline_regions needs the token-free form, got {prog.form}.")
    return prog.replace(graph_module=_Inliner(prog.graph_module).run())
