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


# -- control flow (Note [Control flow]): the subgraphs are GraphModules; tokens lead the carried values --
def cond(pred: Any, true_graph: Any, false_graph: Any, operands: Any) -> tuple:
    """Run one branch, chosen at run time by ``pred`` (a one-element tensor)."""
    return tuple((true_graph if pred else false_graph).forward(*operands))


def while_loop(cond_graph: Any, body_graph: Any, carried: Any, additional: Any) -> tuple:
    """``while cond_graph(*carried, *additional)[-1]: carried = body_graph(*carried, *additional)``; with no
    iteration the carried tensors come back as copies, as eager's while_loop returns them."""
    values, ran = tuple(carried), False
    while cond_graph.forward(*values, *additional)[-1]:
        values, ran = tuple(body_graph.forward(*values, *additional)), True
    return values if ran else tuple(v.clone() if isinstance(v, torch.Tensor) else v for v in values)


def scan(combine_graph: Any, init: Any, xs: Any, additional: Any) -> tuple:
    """``combine_graph(*carry, *slices, *additional) -> (*carry, *ys)`` along dim 0 of ``xs``; returns the
    last carry and the ``ys`` stacked."""
    carry, n_carry, steps = tuple(init), len(init), []
    for i in range(xs[0].shape[0]):
        out = combine_graph.forward(*carry, *[x[i] for x in xs], *additional)
        carry = tuple(out[:n_carry])
        steps.append(out[n_carry:])
    return (*carry, *(torch.stack([s[j] for s in steps]) for j in range(len(steps[0]))))


CONTROL_FLOW = (cond, while_loop, scan)

for _f in (cond, while_loop, scan):
    _f.__module__ = "effectfx.ops"
invoke_subgraph.__module__ = "effectfx.ops"
with_effects.__module__ = "effectfx.ops"
make_token.__module__ = "effectfx.ops"
sink_tokens.__module__ = "effectfx.ops"

# Nodes calling these must never be removed by dead-code elimination.
torch.fx.node._side_effectful_functions.update({with_effects, sink_tokens})
