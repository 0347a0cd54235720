"""Making GraphModules.  Code generation is deferred until a module is printed or run, because most
graphs of a capture are intermediate (joint graphs, captured forms that passes immediately rewrite)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule


def graph_module(root: torch.nn.Module, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    return _LazyGraphModule(root, graph, class_name)
