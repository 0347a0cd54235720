"""Dead-code elimination that asks the effect registry: it never removes an effect.

Contract: requires any form; guarantees the same effects in the same order and the same outputs, with
pure nodes whose values nobody reads removed.
"""

from __future__ import annotations

import torch.fx as fx

from .. import ops
from ..effects import node_effect_keys

_ALWAYS_LIVE = {ops.sink_tokens, ops.with_effects}


def is_effectful(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    return node.target in _ALWAYS_LIVE or bool(node_effect_keys(node))


def eliminate_dead_code(graph: fx.Graph) -> fx.Graph:
    """Remove, in place, every pure node whose value is unused; returns the graph."""
    for node in reversed(list(graph.nodes)):
        if not node.users and not is_effectful(node):
            graph.erase_node(node)
    return graph
