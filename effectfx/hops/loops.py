"""while_loop and scan in captured code: the loop body as a subgraph, the trip count a value of the run.

See Note [Control flow] in ``effectfx.notes`` and ``effectfx.hops.subgraphs`` for the shared parts; their
rows in ``effectfx.ops.HOPS`` give their token arguments to the token passes.
Under autograd (an input, or a tensor the functions read, requires grad) both are refused: eager's
backward of ``while_loop`` runs the body again, effects included, and eager's ``scan`` under autograd drops
the effects of its body; neither is an order effectfx can promise.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch._higher_order_ops.scan import ScanOp
from torch._higher_order_ops.while_loop import WhileLoopOp
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import ops
from ..capture.tracer import Tracer
from ..errors import UnsupportedOperatorError
from ..graph.source import user_location
from ..graph.traced import TensorMeta
from ..graph.walk import graph_effect_keys
from ..interposers.takeover import take_over
from .subgraphs import (
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

# per capture: the structures of the last scan, until eager torch's wrapper takes its flat result back
_LAST_SCAN: weakref.WeakKeyDictionary[Tracer, tuple] = weakref.WeakKeyDictionary()


def _refuse_grad(what: str, op: str) -> UnsupportedOperatorError:
    return UnsupportedOperatorError(
        f"{what} at {user_location()} runs on tensors that require grad (an operand, or a parameter or "
        f"tensor its functions read).\neffectfx captures {op} for inference only: eager's backward of {op} "
        "does not run the body's effects once each (while_loop runs the body again, scan drops them). Run it "
        "under torch.no_grad(), detach its inputs, or unroll the loop in Python.")


def capture_while_loop(tracer: Tracer, cond_fn: Any, body_fn: Any, carried_inputs: Any,
                       additional_inputs: Any) -> tuple:
    what = where(tracer, "while_loop")
    carried = flat_tensors(what, list(carried_inputs))
    additional = flat_tensors(what, list(additional_inputs))
    operands = [*carried, *additional]
    n = tracer.number("control_flow")
    with torch.no_grad():
        cond = trace_subgraph(tracer, cond_fn, operands, f"the cond_fn of {what}", "WhileCond")
        body = trace_subgraph(tracer, lambda *xs: tuple(tree_flatten(body_fn(*xs))[0]), operands,
                              f"the body_fn of {what}", "WhileBody")
    free = arrange_inputs([cond, body], len(operands))
    if needs_grad([*operands, *free]):
        raise _refuse_grad(what, "while_loop")
    pred = cond.outs
    if len(pred) != 1 or pred[0].dtype != torch.bool or pred[0].numel() != 1:
        raise UnsupportedOperatorError(
            f"{what} at {user_location()}: cond_fn must return one boolean tensor with one element, not "
            f"{[(tuple(t.shape), t.dtype) for t in pred]}.")
    keys = graph_effect_keys(cond.gm)
    if keys:
        raise UnsupportedOperatorError(
            f"{what} at {user_location()}: its cond_fn performs effects {sorted(keys)}.\nA loop's condition "
            "has no tokens to thread (its only result is the predicate); move the effect into body_fn.")
    check_same(what, carried, body.outs, ("carried inputs", "body_fn"))
    metas = [result_meta(t) for t in carried]
    outs = emit(tracer, ops.while_loop, [(cond.gm, f"while_cond_{n}"), (body.gm, f"while_body_{n}")], (),
                [carried, [*additional, *free]], metas)
    return tuple(outs)


def capture_scan(tracer: Tracer, combine_fn: Any, init: Any, xs: Any, additional_inputs: Any) -> tuple:
    what = where(tracer, "scan")
    init = flat_tensors(what, list(init))
    xs = flat_tensors(what, list(xs))
    additional = flat_tensors(what, list(additional_inputs))
    with tracer.paused():
        slices = [x.select(0, 0) for x in xs]
    operands = [*init, *slices, *additional]
    n = tracer.number("control_flow")
    structure: dict[str, Any] = {}

    def combine(*a: Any) -> tuple:
        leaves, structure["spec"] = tree_flatten(combine_fn(*a))
        return tuple(leaves)

    with torch.no_grad():
        body = trace_subgraph(tracer, combine, operands, f"the combine_fn of {what}", "ScanCombine")
    free = arrange_inputs([body], len(operands))
    if needs_grad([*init, *xs, *additional, *free]):
        raise _refuse_grad(what, "scan")
    check_same(what, init, body.outs[: len(init)], ("init", "next carry of combine_fn"))
    steps = xs[0].shape[0]
    metas = [result_meta(t) for t in init]
    for y in body.outs[len(init):]:
        shape = (steps, *y.shape)
        stride = tuple(torch.empty(shape, device="meta").stride())
        metas.append(TensorMeta(shape, stride, y.dtype, TensorMeta.of(y).device, False))
    outs = emit(tracer, ops.scan, [(body.gm, f"scan_combine_{n}")], (),
                [init, xs, [*additional, *free]], metas)
    spec = getattr(combine_fn, "keywords", {}).get("spec_init")
    _LAST_SCAN[tracer] = (spec, structure.get("spec"))
    return tuple(outs)


def restructure_scan(tracer: Tracer, flat: tuple) -> tuple:
    """What eager's ``scan`` gets back from Dynamo: ``(carry, ys)`` in the user's structures."""
    spec, inner = _LAST_SCAN.pop(tracer)  # inner: the structure combine_fn returned, (carry, ys)
    n = spec.num_leaves
    ys_spec = inner.child(1) if inner is not None and inner.num_children == 2 else None
    carry = tree_unflatten(list(flat[:n]), spec)
    ys = tree_unflatten(list(flat[n:]), ys_spec) if ys_spec is not None else list(flat[n:])
    return carry, ys


take_over(WhileLoopOp, capture_while_loop)
take_over(ScanOp, capture_scan)
skip_eager_compile("run_flattened_scan", restructure_scan)
