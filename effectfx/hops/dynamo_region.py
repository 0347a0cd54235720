"""Dynamo's region calls in captured code: ``torch.ops.higher_order.invoke_subgraph(subgraph, identifier,
*operands)``, what a Dynamo graph runs for each call of a ``torch.compiler.nested_compile_region`` function --
the graph modules effectfx's Dynamo backend captures (``effectfx.drivers.dynamo_backend``).

Each subgraph is one effectfx region (Note [Region identity]).  Dynamo makes one subgraph per function and
passes the module's tensors as operands, so the calls of every layer are calls of one region and, its key
permitting, of one body; effects in it are threaded like any region's (Note [Effect tokens]).  The subgraph
holds its region (an attribute), so the region lives as long as Dynamo's graph.  The HOP's own name for the
subgraph (``"subgraph_0"``) is Dynamo's, per graph: the region is named after the code it came from.
"""

from __future__ import annotations

import threading
from typing import Any

import torch.fx as fx
from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

from ..capture.tracer import Tracer
from ..interposers.takeover import take_over
from ..regions.decorator import Region

_LOCK = threading.Lock()  # two threads capturing the same Dynamo graph share one region per subgraph


def _name(subgraph: fx.GraphModule, identifier: str) -> str:
    """The function Dynamo traced into the subgraph (``Block.forward``), as its nodes' stacks name it."""
    for node in subgraph.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        trace = node.meta.get("stack_trace")
        if trace:
            last = trace.strip().splitlines()[-2].strip()  # 'File "...", line 3, in forward'
            function = last.rsplit(" in ", 1)[-1]
            owner = next(reversed(stack.values()), None) if stack else None
            cls = getattr(owner[1], "__name__", None) if owner else None
            return f"{cls}.{function}" if cls and function == "forward" else function
    return identifier


def capture_invoke_subgraph(tracer: Tracer, subgraph: fx.GraphModule, identifier: str, *operands: Any) -> Any:
    region = subgraph.__dict__.get("_effectfx_region")
    if region is None:
        with _LOCK:
            region = subgraph.__dict__.get("_effectfx_region")
            if region is None:
                region = Region(subgraph, _name(subgraph, identifier))
                subgraph.__dict__["_effectfx_region"] = region
    return tracer.call_region(region, operands, {})


take_over(InvokeSubgraphHOP, capture_invoke_subgraph)
