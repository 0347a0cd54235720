"""efx.capture: trace a function (or module) into a Program (the forms: Note [Effect tokens])."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import hops  # noqa: F401  (installs the capture rules of the higher-order ops)
from ..capture.arguments import check_containers_unchanged, leaf_names, with_written_state
from ..capture.collectives import refuse_parallel_wrappers
from ..capture.dynamic import Dynamic, dynamic_dims
from ..capture.dynamo_frames import frames_forgotten
from ..capture.profiler import capture_ranges, profiled
from ..capture.python_print import capture_prints
from ..capture.region_call import call_region
from ..capture.trace import Scope, trace_graph
from ..capture.tracer import Tracer
from ..capture.training_step import training_step
from ..errors import UnsupportedMutationError
from ..graph.meta import OperandSource
from ..graph.walk import subgraphs
from ..guards.check import GuardChecker
from ..guards.hooks import GLOBAL
from ..guards.identity import ambient_context, code_reads
from ..guards.kinds import Guard, Hooks
from ..guards.reads import Reads, recording, report_read
from ..passes.pipeline import run_passes
from ..passes.thread_tokens import thread_tokens
from ..program.containers import register_tensor_holders
from ..program.program import Program, TrainingProgram
from ..program.records import BodyInfo, InputSignature, PassRecord, RegionEntry, alias_pattern
from ..regions import decorator as _regions


@contextlib.contextmanager
def _active(tracer: Tracer) -> Iterator[None]:
    previous = _regions.active_tracer()
    _regions._ACTIVE.tracer = tracer
    # autocast caches its casts of leaf tensors (weights): a cast made by eager code must not leak into
    # the trace, nor a fake one made by the trace into the user's eager code
    torch.clear_autocast_cache()
    # under inference_mode the trace runs as under no_grad (what inference_mode is, for the graph): fake
    # views of a parameter need version counters, which inference tensors cannot have; the program runs
    # in the caller's inference_mode, so its results are inference tensors as eager's are
    inference = torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()
    grad = torch.is_grad_enabled()  # (leaving inference_mode enables grad mode)
    try:
        with inference, torch.set_grad_enabled(grad), frames_forgotten(), \
                capture_prints(tracer), capture_ranges(), tracer.fake_mode, tracer:
            yield
    finally:
        _regions._ACTIVE.tracer = previous
        tracer.watcher.restore()  # every watched object gets its class back
        torch.clear_autocast_cache()


def _param_names(fn: Any) -> dict[int, str]:
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        return {}
    return {id(t): name for name, t in chain(module.named_parameters(), module.named_buffers())}


def _regions_of(gm: fx.GraphModule, tracer: Tracer) -> dict[str, RegionEntry]:
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
    ``profile_regions``, every region call opens a profiler range of its own (``capture.profiler``).
    ``dynamic`` maps a tensor leaf's index to the dimensions whose sizes are symbols (Note [Symbolic
    shapes]); the others, and every leaf it does not name, are static."""
    start = time.perf_counter()
    register_tensor_holders()  # before any flattening: a cache argument is a container of tensors
    dynamic = {i: dims for i, dims in (dynamic or {}).items() if dims}
    tracer = Tracer(profiled(call_region) if profile_regions else call_region, symbolic=bool(dynamic))
    leaves, spec = tree_flatten((args, kwargs))
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    names = leaf_names(target, args, kwargs)
    for i, dims in dynamic.items():
        tracer.symbolic_fake(leaves[i], dims, names[i])
    scope = Scope(tracer, "root", param_names=_param_names(fn))
    # the root's reads: guards of a compiled program, by identity (Note [Region identity])
    reads = Reads(tracer.watcher, structural=False)
    refuse_parallel_wrappers(fn, leaves)  # DDP, FSDP2: before anything runs
    owner = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    with _active(tracer), recording(reads):
        for obj in (owner, *leaves):
            if obj is not None and not isinstance(obj, torch.Tensor):
                tracer.watcher.watch(obj)
        closure = []
        if owner is None:  # a function's closure and globals: guarded, and where its tensors live
            for holder, step, value in code_reads(fn):
                report_read(holder, step, value)
                closure.append(value)
        new_leaves = list(leaves)
        with tracer.graph(scope.builder):
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor):
                    fake = tracer.to_fake(leaf)
                    scope.add_input(names[i], OperandSource("arg", i), fake)
                    new_leaves[i] = scope.writable(fake, nonleaf=not leaf.is_leaf)
        call_args, call_kwargs = tree_unflatten(new_leaves, spec)
        with training_step(tracer, [owner, *leaves, *closure]) as step:  # Note [Training step]
            run, written = with_written_state(fn, call_args, call_kwargs)
            traced = trace_graph(scope, step.wrap(run), "the captured function", "Root", target, grad_outputs)
        check_containers_unchanged("the captured function", target, written.before, call_args, call_kwargs,
                                   written.positions)
        hook_guards = _hook_guards(owner, leaves, tracer.watcher.watched.values())

    cache = tracer.regions
    bodies = tuple(
        BodyInfo(b.identifier, b.region.name, b.key, b.key_labels, b.trace_seconds,
                 cache.calls.get(b.identifier, 0), b.guards, cache.unpromotable.get(b.region.fn, ""))
        for b in cache.bodies()
    )
    _refuse_written_views(traced, leaves, names)
    n_user = sum(1 for s in traced.sources if s.kind == "arg")
    tensor_meta = tuple((s.index, m) for s, m in zip(traced.sources, traced.input_meta) if s.kind == "arg")
    signature = InputSignature(
        spec, tensor_meta,
        tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)),
        aliases=alias_pattern(leaves, tensor_meta), views=alias_pattern(leaves, tensor_meta, bases=True),
        shape_guards=shape_guards(tracer, [tracer.fake_of[id(leaves[i])] for i, _ in tensor_meta]),
    )
    lifted = tuple(s.tensor for s in traced.sources[n_user:])
    record = (PassRecord("capture", time.perf_counter() - start),)
    name = getattr(fn, "__name__", type(fn).__name__)
    forward = Program(
        traced.forward, signature, lifted, traced.out_spec, tuple(traced.out_layout),
        regions=_regions_of(traced.forward, tracer), history=record,
        n_extra_outputs=len(traced.saved_meta), name=f"{name} (forward)" if traced.backward else name,
        bodies=bodies, mutations=traced.mutated,
        guards=(*[g for g in reads.guards.values() if not step.replaces(g.path)], *hook_guards, *step.guards),
        lifted_from=tuple(reads.tensor_sources.get(id(t)) for t in lifted),
        specialized=tuple(tracer.specialized), written_args=written.positions,
        state_writes=tuple(step.targets),
        state_holds=GuardChecker(tuple(step.guards)) if step.targets else None,
    )
    if traced.backward is None:
        return forward
    n_tangents = sum(traced.tangent_mask)
    backward = Program(
        traced.backward,
        InputSignature(tree_flatten([None] * (len(traced.saved_meta) + n_tangents))[1], (), ()),
        (), tree_flatten([None] * len(traced.grad_meta))[1],
        tuple(("tensor", i) for i in range(len(traced.grad_meta))),
        regions=_regions_of(traced.backward, tracer), history=record, name=f"{name} (backward)",
        bodies=bodies,
    )
    ambient_state = ambient_context()
    # what a retrace needs of the arguments, without keeping the caller's tensors alive
    others = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
    grads = {i: (leaf.requires_grad, leaf.is_leaf) for i, leaf in enumerate(leaves)
             if isinstance(leaf, torch.Tensor)}

    def retrace(live: tuple[bool, ...]) -> TrainingProgram:
        with ambient_state:
            args, kwargs = tree_unflatten(stand_ins(signature, others, grads), spec)
            prog = trace_program(fn, args, kwargs, grad_outputs=live, profile_regions=profile_regions,
                                 dynamic=dynamic)
        assert isinstance(prog, TrainingProgram)
        return prog  # the caller checks it ran the same forward (TrainingProgram.partial_backward)

    return TrainingProgram(forward, backward, traced.tangent_mask, traced.grad_mask, traced.saved, retrace,
                           traced.covered_by)


def _hook_guards(owner: Any, leaves: list[Any], watched: Any) -> list[Guard]:
    """Guards on the hooks of every module the program may run -- the compiled module's, the modules it
    is passed, those its code read (watched), with all their submodules -- and on torch's global module
    hooks: a hook registered or removed on any of them captures anew (Note [Region identity])."""
    roots = [owner, *leaves, *(obj for obj, _ in watched)]
    modules: dict[int, torch.nn.Module] = {}
    for root in roots:
        if isinstance(root, torch.nn.Module) and id(root) not in modules:
            for sub in root.modules():
                modules.setdefault(id(sub), sub)
    return [Hooks.on(m) for m in (*modules.values(), GLOBAL)]


def _refuse_written_views(traced: Any, leaves: list[Any], names: list[str]) -> None:
    """An argument updated in place while another argument is a different view of its memory: eager's
    other view sees the update, the graph's copy of it would not (Note [Mutations]), so refuse."""
    for j in traced.mutated:
        src = traced.sources[j]
        if src.kind != "arg":
            continue
        written = leaves[src.index]
        memory = _memory(written)
        other = next((i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
                      and leaf is not written and _memory(leaf) == memory), None)
        if other is not None:
            raise UnsupportedMutationError(
                f"the captured function updates its argument {names[src.index]!r} in place, and argument "
                f"{names[other]!r} is another view of the same memory; the graph would not show the update "
                "through it as eager does.\nPass separate tensors (a clone), or pass one tensor and take "
                "the view inside the function."
            )


def _memory(t: torch.Tensor) -> int:
    """Where a tensor's data lives; a torch.func wrapper (vmap's BatchedTensor) has none of its own."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t.untyped_storage().data_ptr()


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


def shape_guards(tracer: Tracer, fakes: list[torch.Tensor]) -> tuple[str, ...]:
    """What a symbolic program's trace assumed of its arguments' sizes and strides, as Python expressions
    over ``L['t<k>']`` (the k-th tensor argument): torch's ShapeEnv guards (Note [Symbolic shapes])."""
    if tracer.shape_env is None:
        return ()
    return tuple(tracer.shape_env.produce_guards(fakes, [_local(k) for k in range(len(fakes))],
                                                 ignore_static=False))


def _local(k: int) -> Any:
    from torch._dynamo.source import LocalSource  # (a symbolic capture has imported it already)

    return LocalSource(f"t{k}")


def capture(fn: Callable[..., Any], *args: Any, functionalize: bool = True,
            dynamic_shapes: Any = None, **kwargs: Any) -> Program | TrainingProgram:
    """Capture ``fn(*args, **kwargs)``: the functionalized form, or the captured form if
    ``functionalize=False``.  Returns a TrainingProgram when outputs require grad.  ``dynamic_shapes``
    says which sizes are symbolic, as ``torch.export`` spells it (Note [Symbolic shapes])."""
    prog = trace_program(fn, args, kwargs, dynamic=dynamic_dims(fn, args, kwargs, dynamic_shapes))
    if not functionalize:
        return prog
    return run_passes(prog, [thread_tokens])
