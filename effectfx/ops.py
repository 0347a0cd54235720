"""The graph vocabulary of effectfx: the call targets that appear in its FX graphs.

See Note [Effect tokens] and Note [Region identity] in ``effectfx.notes``.  These are plain Python
callables, so running a graph costs one Python call per node, as eager does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _as_tuple(out: Any) -> tuple:
    if out is None:
        return ()
    if isinstance(out, (tuple, list)):
        return tuple(out)
    return (out,)


def invoke_subgraph(subgraph: Callable[..., Any], identifier: str, *operands: Any) -> tuple:
    """Call one traced body of a region; always returns a tuple (tokens first when it has effects)."""
    return subgraph.forward(*operands)


def with_effects(token: torch.Tensor, op: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple:
    """Run ``op`` after the effects that produced ``token``: returns ``(new_token, *outs)``."""
    if op is invoke_subgraph:  # unlifted form: a region call threaded as one effect
        return (token, *op(*args, **kwargs))
    return (token, *_as_tuple(op(*args, **kwargs)))


_TOKEN = torch.empty(0)


def make_token() -> torch.Tensor:
    """A fresh token (unlifted form): the start of a key's chain inside a graph."""
    return _TOKEN


def sink_tokens(tokens: Any) -> None:
    """Keep the last tokens of a graph alive (unlifted form), so nothing after them is dead code."""
    return None


invoke_subgraph.__module__ = "effectfx.ops"
with_effects.__module__ = "effectfx.ops"
make_token.__module__ = "effectfx.ops"
sink_tokens.__module__ = "effectfx.ops"

# Nodes calling these must never be removed by dead-code elimination.
torch.fx.node._side_effectful_functions.update({with_effects, sink_tokens})
