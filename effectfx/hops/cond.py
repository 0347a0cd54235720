"""torch.cond in captured code: one ``effectfx.ops.cond`` node holding both branches (Note [Control flow]).

Its capture rule traces each branch into a subgraph (``effectfx.hops.subgraphs``); its autograd rule,
:class:`CondCall`, makes the backward a second cond over backward branches that recompute their forward,
as eager's cond does (its effects run again, in backward).  Its row in ``effectfx.ops.HOPS`` gives its
token argument to the token passes (``effectfx.passes.control_flow``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._higher_order_ops.cond import CondOp
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import ops
from ..capture.arguments import leaf_names
from ..capture.tracer import Tracer
from ..errors import UnsupportedOperatorError
from ..graph.source import user_location
from ..graph.traced import TensorMeta
from ..interposers.takeover import take_over
from .subgraphs import (
    SubgraphScope,
    arrange_inputs,
    check_same,
    emit,
    flat_tensors,
    needs_grad,
    result_meta,
    skip_eager_compile,
    trace_subgraph,
    where,
)


class _Grads:
    """The backward of one branch: the branch again (eager's cond recomputes it), then autograd; one
    gradient per input that requires grad (zeros where the branch does not use it)."""

    def __init__(self, tangent_meta: list[TensorMeta], diff: list[bool], free: list[torch.Tensor]) -> None:
        self.tangent_meta = tangent_meta
        self.diff = diff  # per output: whether it gets a tangent
        self.free = free  # the lifted tensors of both forward branches

    def run(self, fakes: list[torch.Tensor], scope: SubgraphScope, outs: list[torch.Tensor],
            tangents: list[torch.Tensor]) -> list[torch.Tensor]:
        wrt = [t for t in [*fakes, *self.free] if t.requires_grad]
        it = iter(tangents)
        pairs = [(o, next(it)) for o, d in zip(outs, self.diff) if d]
        pairs = [(o, g) for o, g in pairs if o.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
            if pairs and wrt else [None] * len(wrt)
        return [g if g is not None else torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                for g, t in zip(got, wrt)]


class CondCall(torch.autograd.Function):
    """A cond under autograd: forward emits the forward branches, backward the backward branches."""

    @staticmethod
    def forward(ctx: Any, tracer: Tracer, plan: dict, pred: torch.Tensor, *inputs: Any) -> tuple:  # type: ignore[override]
        outs = emit(tracer, ops.cond, plan["forward"], (pred,), [list(inputs)], plan["out_meta"])
        ctx.tracer, ctx.plan, ctx.pred, ctx.inputs = tracer, plan, pred, inputs
        ctx.mark_non_differentiable(*[o for o, m in zip(outs, plan["diff"]) if not m])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:  # type: ignore[override]
        plan = ctx.plan
        tangents = [g for g, m in zip(grads, plan["diff"]) if m]
        results = iter(emit(ctx.tracer, ops.cond, plan["backward"], (ctx.pred,),
                            [[*ctx.inputs, *tangents]], plan["grad_meta"]))
        return (None, None, None, *[next(results) if t.requires_grad else None for t in ctx.inputs])


def capture_cond(tracer: Tracer, pred: Any, true_fn: Any, false_fn: Any, operands: Any) -> Any:
    what = where(tracer, "torch.cond")
    if not isinstance(pred, torch.Tensor):  # a Python bool: torch.cond itself runs one branch
        return true_fn(*operands) if pred else false_fn(*operands)
    if pred.numel() != 1:
        raise UnsupportedOperatorError(f"{what} at {user_location()}: the predicate must have one element.")
    flat, spec = tree_flatten(operands)
    flat = flat_tensors(what, flat)

    def branch(fn: Any) -> Any:
        return lambda *xs: fn(*tree_unflatten(list(xs), spec))

    def param_names(fn: Any) -> list[str]:
        return leaf_names(fn, tuple(operands), {})

    n = tracer.number("control_flow")
    names = (f"cond_true_{n}", f"cond_false_{n}")
    with torch.no_grad():
        fw = [trace_subgraph(tracer, branch(f), flat, f"the {side} branch of {what}", f"Cond{side.title()}",
                             names=param_names(f))
              for f, side in ((true_fn, "true"), (false_fn, "false"))]
    check_same(what, fw[0].outs, fw[1].outs, ("true branch", "false branch"))
    if fw[0].spec != fw[1].spec:
        raise UnsupportedOperatorError(f"{what} at {user_location()}: the branches return different "
                                       f"structures ({fw[0].spec} and {fw[1].spec}).")
    free = arrange_inputs(fw, len(flat))
    inputs = [*flat, *free]
    out_meta = [result_meta(t) for t in fw[0].outs]
    if not needs_grad(inputs):
        outs = emit(tracer, ops.cond, list(zip([t.gm for t in fw], names)), (pred,), [inputs], out_meta)
        return tree_unflatten(outs, fw[0].spec)
    # training: each backward branch recomputes its forward, as eager's cond backward does (its effects too)
    diff = [m.dtype.is_floating_point or m.dtype.is_complex for m in out_meta]
    grads = _Grads([m for m, d in zip(out_meta, diff) if d], diff, free)
    with torch.enable_grad():
        bw = [trace_subgraph(tracer, branch(f), flat, f"the {side} branch of {what} (backward)",
                             f"Cond{side.title()}Backward", tangents=sum(diff), grads=grads,
                             names=param_names(f))
              for f, side in ((true_fn, "true"), (false_fn, "false"))]
    arrange_inputs(bw, len(flat), sum(diff), free)
    plan = {
        "forward": list(zip([t.gm for t in fw], names)),
        "backward": list(zip([t.gm for t in bw], [f"{x}_backward" for x in names])),
        "out_meta": out_meta, "diff": diff,
        "grad_meta": [result_meta(t) for t in inputs if t.requires_grad],
    }
    outs = CondCall.apply(tracer, plan, pred, *inputs)
    return tree_unflatten(list(outs), fw[0].spec)


take_over(CondOp, capture_cond)
skip_eager_compile()
