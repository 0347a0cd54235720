"""Making graphs and GraphModules.

``Graph`` is ``torch.fx.Graph`` without one cost: FX 2.13 walks every new node's arguments with pytree to
warn about raw SymInts, which is most of the ~40 us a node costs.  effectfx traces static shapes only (no
SymInt ever reaches a graph), and a capture creates a node per op and per region call site, so it skips
that walk (about 5x cheaper per node).  Code generation is deferred until a module is printed or run,
because most graphs of a capture are intermediate (joint graphs, forms that passes immediately rewrite).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule


class Graph(fx.Graph):
    def create_node(self, op: str, target: Any, args: tuple | None = None, kwargs: dict | None = None,
                    name: str | None = None, type_expr: Any | None = None) -> fx.Node:
        node = super().create_node(op, target, None, None, name, type_expr)
        if args or kwargs:
            node._update_args_kwargs(tuple(args or ()), dict(kwargs or {}))
        return node


def graph_module(root: torch.nn.Module, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    return _LazyGraphModule(root, graph, class_name)
