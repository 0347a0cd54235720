"""Tracing a region's body (Note [Region identity], Note [Joint trace]): a new body for a call key, the
promoted trace that may be dropped, the backward without promoted operands' gradients, and the backward for
some outputs only (Note [Partial backward])."""

from __future__ import annotations

import re
import time
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_unflatten

from ..autograd.partition import without_gradients
from ..capture.arguments import check_containers_unchanged, leaf_names, with_written_state
from ..capture.leaks import code_roots, global_hook_roots
from ..capture.python_state import Journal
from ..capture.trace import Scope, trace_graph
from ..capture.tracer import Tracer
from ..errors import EffectfxError
from ..graph.source import definition
from ..graph.traced import (
    OperandSource,
    SourceKind,
    TensorMeta,
    TracedGraph,
    mask_text,
    same_forward,
    saved_positions,
)
from ..guards.hooks import hook_labels
from ..guards.identity import autocasting, code_reads, key_labels, leaf_of_key, module_tensors
from ..guards.labels import raw
from ..guards.reads import Reads, recording, report_read
from ..regions.cache import PartialBackward, RegionBody
from ..regions.decorator import Region
from ..regions.promotion import history_guards, refusal_after_trace
from .call_site import CallSite


def trace(tracer: Tracer, region: Region, leaves: list[Any], spec: Any, args: tuple, kwargs: dict,
           grad_outputs: tuple[bool, ...] | None = None, call: CallSite | None = None,
           key: tuple | None = None) -> tuple[TracedGraph, tuple]:
    """Trace ``region``'s body on fakes of ``leaves`` (as they were at ``call``, when retraced for it; with
    the metadata ``key`` holds, when promoted): its graph(s) and its guards."""
    module_params: dict[int, tuple[int, str]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.nn.Module):
            for name, t in module_tensors(leaf):
                module_params.setdefault(id(t), (i, name))
    scope = Scope(tracer, region.name, region, module_params)
    labels = scope.labels
    assert labels is not None
    reads = labels.reads = Reads(tracer.watcher, structural=True, on_label=labels.make)
    names = leaf_names(region.fn, args, kwargs)
    new_leaves = list(leaves)
    leafness: dict[int, bool] = {}  # per tensor argument: whether it was a leaf of autograd (no history)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if call is not None:
                meta, nonleaf = call.tensor_at_call(i)
            else:
                meta = leaf_of_key(key, i) if key is not None else TensorMeta.of(leaf)
                nonleaf = not leaf.is_leaf
            leafness[i] = not nonleaf
            fake = tracer.new_fake(meta)
            scope.add_input(names[i], OperandSource(SourceKind.ARG, i), fake)
            new_leaves[i] = scope.writable(fake, nonleaf=nonleaf)
        elif isinstance(leaf, str):  # a string argument: an operand while only effects use it
            new_leaves[i] = labels.make((("leaf", i),), raw(leaf), parent=leaf)
        else:
            reads.root(leaf, (("leaf", i),))
    body_args, body_kwargs = tree_unflatten(new_leaves, spec)
    # the Python state the body writes, replayed by each call site (Note [Python state])
    journal = Journal(tracer, reads, f"region {region.name!r}", root=False)
    journal.start([*((leaf, f"argument {names[i]!r}", (("leaf", i),)) for i, leaf in enumerate(leaves)
                     if i not in leafness and not isinstance(leaf, str)),
                   *code_roots(region.fn, f"region {region.name!r}"), *global_hook_roots()])
    # labels live only in bodies: the root's own calls (and the bookkeeping of its call sites) skip the mode
    label_mode = tracer.label_mode.entered()
    tracer.region_stack.append(region)
    grad_state_reads = tracer.label_mode.grad_state_reads
    # autocast's cached casts of weights are values of the graph that made them: a body neither reads its
    # caller's (nor an earlier trace's, a partial backward's retrace) nor leaves its own to its caller
    torch.clear_autocast_cache()
    try:
        with label_mode, recording(reads), hook_labels(leaves, labels.make):
            for holder, step, value in code_reads(region.fn):
                report_read(holder, step, value)
            run, written = with_written_state(region.fn, body_args, body_kwargs)
            with journal:
                traced = trace_graph(scope, journal.wrap(run), f"region {region.name!r}", region.name,
                                     region.fn, grad_outputs)
                if traced.backward is not None:
                    journal.check_unchanged("while its backward is derived (a backward hook?)")
            traced.written_args = written.positions
            traced.python_writes = journal.writes
        check_containers_unchanged(f"region {region.name!r}", region.fn, written.before, body_args,
                                   body_kwargs, written.positions)
    finally:
        tracer.region_stack.pop()
        torch.clear_autocast_cache()
    looked = tracer.label_mode.grad_state_reads > grad_state_reads
    for path, expect in history_guards(looked, autocasting(), leafness).items():
        reads.guards.setdefault(path, expect)
    return traced, tuple(reads.guards.values())


def trace_body(tracer: Tracer, region: Region, key: Any, leaves: list[Any], spec: Any,
                args: tuple, kwargs: dict, promoted: bool = False) -> RegionBody:
    """A new body for ``key``; with ``promoted``, the body of a key some arguments were promoted in, or
    None when the trace shows it cannot serve them (the region cache is then as it was before)."""
    cache = tracer.regions
    state = cache.snapshot() if promoted else None
    reads = tracer.label_mode.grad_state_reads
    identifier = cache.next_identifier()
    start = time.perf_counter()
    traced: TracedGraph | None = None
    why: str | None = None
    try:
        traced, guards = trace(tracer, region, leaves, spec, args, kwargs, key=key if promoted else None)
    except (EffectfxError, RuntimeError) as exc:
        if not promoted:
            raise
        why = f"its trace failed ({type(exc).__name__})"  # an exact trace says why, if it must
    reads = tracer.label_mode.grad_state_reads - reads
    if traced is not None:
        why = refusal_after_trace(traced, reads)
    if promoted and why is not None:
        cache.restore(state)
        cache.unpromotable[region.fn] = why
        return None  # type: ignore[return-value]
    assert traced is not None
    body = RegionBody(identifier, region, key, guards, traced, "",
                      key_labels(leaf_names(region.fn, args, kwargs)), time.perf_counter() - start,
                      unpromotable=why,
                      grad_sensitive=bool(reads) or (traced.backward is not None and traced.custom_autograd))
    traced.forward.meta["effectfx_region"] = (region, body.cache_key, identifier, "forward")
    if traced.backward is not None:
        traced.backward.meta["effectfx_region"] = (region, body.cache_key, identifier, "backward")
    body.attr = re.sub(r"\W", "_", region.name) + "_" + identifier.replace("_", "")
    cache.add(body)
    return body


def restricted(body: RegionBody, backward: fx.GraphModule, attr: str, grad_meta: list,
                keep: tuple[bool, ...]) -> tuple[fx.GraphModule, list]:
    """``backward`` returning only the gradients in ``keep`` (None for the others): the gradients of
    operands a call site promoted are not computed (Note [Region identity]).  Made once per backward."""
    found = body.restricted.get((attr, keep))
    if found is None:
        found = body.restricted[(attr, keep)] = (without_gradients(backward, keep),
                                                 [m if k else None for m, k in zip(grad_meta, keep)])
    return found


def partial_backward(tracer: Tracer, body: RegionBody, call: CallSite, live: tuple[bool, ...]
                      ) -> PartialBackward:
    """The body's backward for the outputs in ``live`` only (Note [Partial backward]), traced once."""
    found = body.partial.get(live)
    if found is not None:
        return found
    leaves, spec, args, kwargs, ambient_state = call.leaves, call.spec, call.args, call.kwargs, call.ambient
    with ambient_state, tracer.regions.uncounted_calls():  # the retrace's calls are not call sites
        traced, _ = trace(tracer, body.region, leaves, spec, args, kwargs, live, call)
    assert traced.backward is not None
    where = f"region {body.region.name!r} ({body.identifier}, defined at {definition(body.region.fn)})"
    same_forward(body.traced.forward, traced.forward, where)
    found = PartialBackward(traced.backward, saved_positions(body.traced.saved, traced.saved, where),
                            traced.grad_meta, body.backward_attr + "_" + mask_text(live))
    found.backward.meta["effectfx_region"] = (body.region, body.cache_key, body.identifier, "backward")
    found.backward.meta["effectfx_grad_outputs"] = live
    body.partial[live] = found
    return found
