"""efx.capture: trace a function (or module) into a Program (the forms: Note [Effect tokens])."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import hops  # noqa: F401  (registers the capture rules of the higher-order ops)
from ..capture.root import RootTrace, trace_root
from ..capture.shapes import Dynamic, dynamic_dims
from ..graph.traced import OutputKind, OutputLeaf, SourceKind
from ..graph.walk import subgraphs
from ..guards.check import GuardChecker
from ..guards.identity import ambient_context
from ..hops.region import call_region
from ..interposers.profiler import profiled
from ..passes.pipeline import run_passes
from ..passes.thread_tokens import thread_tokens
from ..program.program import Program
from ..program.records import BodyInfo, InputSignature, PassRecord, RegionEntry
from ..program.training import TrainingProgram


def _regions_of(gm: fx.GraphModule, tracer: Any) -> dict[str, RegionEntry]:
    found = {}
    for _, identifier, body in subgraphs(gm):
        region = body.meta["effectfx_region"][0]
        found[identifier] = RegionEntry(region.name, tracer.regions.trace_counts.get(identifier, 0))
    return dict(sorted(found.items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1])))


def trace_program(fn: Callable[..., Any], args: tuple, kwargs: dict,
                  grad_outputs: tuple[bool, ...] | None = None,
                  profile_regions: bool = False, dynamic: Dynamic | None = None) -> Program | TrainingProgram:
    """Trace ``fn(*args, **kwargs)`` into the captured form (1); joint + partitioned under autograd, the
    backward for the differentiable outputs ``grad_outputs`` selects (all by default).  With
    ``profile_regions``, every region call opens a profiler range of its own (``interposers.profiler``).
    ``dynamic`` maps a tensor leaf's index to the dimensions whose sizes are symbols (Note [Symbolic
    shapes]); the others, and every leaf it does not name, are static."""
    start = time.perf_counter()
    dynamic = {i: dims for i, dims in (dynamic or {}).items() if dims}
    root = trace_root(fn, args, kwargs, profiled(call_region) if profile_regions else call_region,
                      grad_outputs, dynamic)
    record = (PassRecord("capture", time.perf_counter() - start),)
    name = getattr(fn, "__name__", type(fn).__name__)
    forward = _forward(root, record, f"{name} (forward)" if root.traced.backward else name)
    if root.traced.backward is None:
        return forward
    traced = root.traced
    backward = _backward(root, record, f"{name} (backward)", forward.bodies)
    ambient_state = ambient_context()
    # what a retrace needs of the arguments, without keeping the caller's tensors alive
    others = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in root.leaves]
    grads = {i: (leaf.requires_grad, leaf.is_leaf) for i, leaf in enumerate(root.leaves)
             if isinstance(leaf, torch.Tensor)}

    def retrace(live: tuple[bool, ...]) -> TrainingProgram:
        with ambient_state:
            args, kwargs = tree_unflatten(stand_ins(forward.signature, others, grads), root.spec)
            prog = trace_program(fn, args, kwargs, grad_outputs=live, profile_regions=profile_regions,
                                 dynamic=dynamic)
        assert isinstance(prog, TrainingProgram)
        return prog  # the caller checks it ran the same forward (TrainingProgram.partial_backward)

    return TrainingProgram(forward, backward, traced.tangent_mask, traced.grad_mask, traced.saved, retrace,
                           traced.covered_by)


def _backward(root: RootTrace, record: tuple, name: str, bodies: tuple) -> Program:
    """The program of the root's backward: saved values and tangents in, gradients out."""
    traced = root.traced
    return Program(
        traced.backward,
        InputSignature(tree_flatten([None] * (len(traced.saved_meta) + sum(traced.tangent_mask)))[1], (), ()),
        (), tree_flatten([None] * len(traced.grad_meta))[1],
        tuple(OutputLeaf(OutputKind.TENSOR, i) for i in range(len(traced.grad_meta))),
        regions=_regions_of(traced.backward, root.tracer), history=record, name=name, bodies=bodies,
    )


def _forward(root: RootTrace, record: tuple, name: str) -> Program:
    """The program of the root's forward (its only one, in inference)."""
    tracer, traced, step = root.tracer, root.traced, root.step
    cache = tracer.regions
    bodies = tuple(
        BodyInfo(b.identifier, b.region.name, b.key, b.key_labels, b.trace_seconds,
                 cache.calls.get(b.identifier, 0), b.guards, cache.unpromotable.get(b.region.fn, ""))
        for b in cache.bodies()
    )
    n_user = sum(1 for s in traced.sources if s.kind is SourceKind.ARG)
    lifted = tuple(s.tensor for s in traced.sources[n_user:])
    return Program(
        traced.forward, root.signature, lifted, traced.out_spec, tuple(traced.out_layout),
        regions=_regions_of(traced.forward, tracer), history=record,
        n_extra_outputs=len(traced.saved_meta), name=name, bodies=bodies, mutations=traced.mutated,
        guards=root.guards, lifted_from=tuple(root.reads.tensor_sources.get(id(t)) for t in lifted),
        specialized=tuple(tracer.specialized), written_args=root.written_args,
        state_writes=tuple(step.targets),
        state_holds=GuardChecker(tuple(step.guards)) if step.targets else None, python_state=root.python,
        input_hooks=root.input_hooks, returned_args=root.returned_args,
    )


def stand_ins(signature: InputSignature, others: list[Any], grads: dict[int, tuple[bool, bool]]) -> list[Any]:
    """Leaves like the captured ones: new tensors with their metadata (``grads``: requires_grad and
    is_leaf, as the call had them; the same tensor passed twice, ``signature.aliases``, stays one tensor --
    ``model(ids, labels=ids)``), the other values as they were."""
    new = list(others)
    for k, (index, meta) in enumerate(signature.tensor_meta):
        same = signature.aliases[k] if signature.aliases else index
        if same != index:
            new[index] = new[same]
            continue
        meta = meta.example()
        t = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=meta.device)
        requires_grad, is_leaf = grads[index]
        if requires_grad:
            t.requires_grad_()
            if not is_leaf:
                with torch.enable_grad():
                    t = t.clone()
        new[index] = t
    return new


def capture(fn: Callable[..., Any], *args: Any, functionalize: bool = True,
            dynamic_shapes: Any = None, **kwargs: Any) -> Program | TrainingProgram:
    """Capture ``fn(*args, **kwargs)``: the functionalized form, or the captured form if
    ``functionalize=False``.  Returns a TrainingProgram when outputs require grad.  ``dynamic_shapes``
    says which sizes are symbolic, as ``torch.export`` spells it (Note [Symbolic shapes])."""
    prog = trace_program(fn, args, kwargs, dynamic=dynamic_dims(fn, args, kwargs, dynamic_shapes))
    if not functionalize:
        return prog
    return run_passes(prog, [thread_tokens])
