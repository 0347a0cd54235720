"""GraphBuilder: one FX graph under construction, and the map from traced tensors to its nodes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..graphs import Graph, graph_module


def _node_name(target: Any) -> str | None:
    # name aten nodes after the op ("add", "record_memory"), as the seed's graphs read
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    return None


class GraphBuilder:
    """Builds one graph (the root, or one region body).

    ``values`` maps ``id(fake tensor)`` to the node that produces it in *this* graph; tensors of other
    graphs are unknown here and must be lifted (Note [Region identity]).  ``lift`` is asked for a node
    when an unknown tensor shows up, and raises if the tensor may not be lifted.
    """

    def __init__(self, name: str, lift: Callable[[torch.Tensor], fx.Node]) -> None:
        self.name = name
        self.graph = Graph()
        self.values: dict[int, fx.Node] = {}
        self.keepalive: list[torch.Tensor] = []
        self.phase = "forward"
        self.lift = lift
        self.attrs: dict[int, fx.Node] = {}
        self.holder = torch.nn.Module()
        self._placeholders_end: fx.Node | None = None
        self._input_names: set[str] = set()

    def bind(self, tensor: torch.Tensor, node: fx.Node) -> None:
        self.values[id(tensor)] = node
        self.keepalive.append(tensor)
        node.meta.setdefault("val", tensor)

    def node_of(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            node = self.values.get(id(value))
            if node is None:
                node = self.lift(value)
                self.bind(value, node)
            return node
        return value

    def placeholder(self, name: str, value: Any) -> fx.Node:
        # a placeholder's target is its parameter name in the generated code: it must be unique
        base, n = name, 0
        while name in self._input_names:
            n += 1
            name = f"{base}_{n}"
        self._input_names.add(name)
        # placeholders must precede every other node, even when lifted in the middle of a trace
        if self._placeholders_end is None:
            node = self.graph.placeholder(name)
        else:
            with self.graph.inserting_after(self._placeholders_end):
                node = self.graph.placeholder(name)
        self._placeholders_end = node
        node.meta["phase"] = self.phase
        if isinstance(value, torch.Tensor):
            self.bind(value, node)
        return node

    def call(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = self.graph.create_node("call_function", target, args, kwargs or {}, name=_node_name(target))
        node.meta["phase"] = self.phase
        return node

    def get_attr(self, module: torch.nn.Module, base_name: str) -> fx.Node:
        """The get_attr node of a subgraph: one per subgraph per graph, shared by all its call sites."""
        node = self.attrs.get(id(module))
        if node is None:
            setattr(self.holder, base_name, module)
            node = self.attrs[id(module)] = self.graph.get_attr(base_name)
            node.meta["phase"] = self.phase
        return node

    def finish(self, outputs: tuple, class_name: str) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return graph_module(self.holder, self.graph, class_name)
