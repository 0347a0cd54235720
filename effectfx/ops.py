"""The graph vocabulary of effectfx: the call targets that appear in its FX graphs, and the table of its
higher-order ops.

See Note [Effect tokens] and Note [Region identity] in ``effectfx.notes``.  These are plain Python
callables, so running a graph costs one Python call per node, as eager does.  :data:`HOPS` is the one
table of the targets that run subgraphs (Note [Higher-order ops]): printing, serialization, the rewrites,
the token passes and the effect walks read it; each family's capture and autograd rules live in
``effectfx.hops``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class HopSpec:
    """One row of :data:`HOPS`: a graph target that runs subgraphs held by its calling graph."""

    target: Callable[..., Any]
    # the argument tokens lead, a tuple (Note [Control flow]); None: tokens lead the operands themselves,
    # after the subgraph and its identifier (a region call, Note [Effect tokens])
    token_arg: int | None
    note: str  # the Note that defines its calling convention
    rules: str  # the module holding its capture and autograd rules

    @property
    def name(self) -> str:
        """How graphs print it and program files name it (``effectfx.ops.cond``)."""
        return f"effectfx.ops.{self.target.__name__}"


HOPS: dict[Callable[..., Any], HopSpec] = {spec.target: spec for spec in (
    HopSpec(invoke_subgraph, None, "Region identity", "effectfx.hops.region"),
    HopSpec(cond, 3, "Control flow", "effectfx.hops.cond"),
    HopSpec(while_loop, 2, "Control flow", "effectfx.hops.loops"),
    HopSpec(scan, 1, "Control flow", "effectfx.hops.loops"),
)}
# the higher-order ops whose tokens lead a tuple argument (their token rules: effectfx.passes.control_flow)
CONTROL_FLOW = tuple(t for t, spec in HOPS.items() if spec.token_arg is not None)
# every Python function a graph may call, by its printed name
TOKEN_OPS = (with_effects, make_token, sink_tokens)
TARGETS: dict[str, Callable[..., Any]] = {f"effectfx.ops.{f.__name__}": f for f in (*TOKEN_OPS, *HOPS)}

for _f in TARGETS.values():
    _f.__module__ = "effectfx.ops"
