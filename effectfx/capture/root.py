"""The capture of a compiled function's root: its arguments made fakes, its Python reads recorded as
guards (Note [Region identity]), its training step (Note [Training step]), all inside one capture session
(``capture.session``).  ``effectfx.drivers.capture`` turns the result into a Program."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import UnsupportedMutationError
from ..graph.traced import OperandSource, SourceKind, TracedGraph
from ..guards.hooks import GLOBAL
from ..guards.identity import code_reads
from ..guards.kinds import Guard, Hooks
from ..guards.reads import Reads, recording, report_read, unrecorded
from ..guards.values import plain_value
from ..interposers.collectives import refuse_parallel_wrappers
from ..interposers.tensor_hooks import recording_hooks
from ..interposers.training_step import TrainingStep, training_step
from ..program.containers import register_tensor_holders
from ..program.python_writes import PythonState
from ..program.records import InputSignature, alias_pattern
from .arguments import check_containers_unchanged, leaf_names, with_written_state
from .leaks import check_leaks, code_roots, global_hook_roots, reachable
from .python_state import Journal
from .session import CaptureSession
from .shapes import Dynamic
from .trace import Scope, trace_graph
from .tracer import Tracer


@dataclass
class RootTrace:
    """What one capture of a root found: its graphs, its arguments, and the Python state it read."""

    tracer: Tracer
    traced: TracedGraph
    leaves: list[Any]
    spec: Any
    names: list[str]
    signature: InputSignature
    guards: tuple
    step: TrainingStep
    reads: Reads
    written_args: tuple
    python: PythonState | None  # the Python state it writes (Note [Python state])
    input_hooks: tuple  # tensor hooks the code registers on inputs (interposers.tensor_hooks)
    returned_args: tuple = ()  # argument objects its result holds itself (containers.returned_objects)


def trace_root(fn: Callable[..., Any], args: tuple, kwargs: dict, call_region: Callable[..., Any],
               grad_outputs: tuple[bool, ...] | None, dynamic: Dynamic) -> RootTrace:
    """Trace ``fn(*args, **kwargs)`` (``dynamic``: a tensor leaf's index to its symbolic dimensions, Note
    [Symbolic shapes]); ``call_region`` is what a region call does (``effectfx.hops.region``)."""
    register_tensor_holders()  # before any flattening: a cache argument is a container of tensors
    tracer = Tracer(call_region, symbolic=bool(dynamic))
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
    with CaptureSession(tracer), recording(reads):
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
                    scope.add_input(names[i], OperandSource(SourceKind.ARG, i), fake)
                    new_leaves[i] = scope.writable(fake, nonleaf=not leaf.is_leaf)
        call_args, call_kwargs = tree_unflatten(new_leaves, spec)
        roots = _state_roots(target, owner, leaves, names)
        journal = Journal(tracer, reads, "the captured function", root=True)  # Note [Python state]
        journal.start(roots)
        with training_step(tracer, [owner, *leaves, *closure]) as step, recording_hooks() as hooks:
            run, written = with_written_state(fn, call_args, call_kwargs)
            input_hooks: list = []

            def run_then_take_hooks() -> Any:  # off the fakes before the capture derives the backward
                out = run()
                input_hooks.extend(hooks.take(scope.index_of, "the captured function"))
                return out

            with journal:
                traced = trace_graph(scope, step.wrap(journal.wrap(run_then_take_hooks)),
                                     "the captured function", "Root", target, grad_outputs)
                if traced.backward is not None:
                    journal.check_unchanged("while its backward is derived (a backward hook?)")
        check_containers_unchanged("the captured function", target, written.before, call_args, call_kwargs,
                                   written.positions)
        watched = [(obj, type(obj).__name__, None) for obj, _ in tracer.watcher.watched.values()]
        hook_guards = _hook_guards(owner, leaves, tracer.watcher.watched.values())
    # no fake of the trace is left where the user can reach it (Note [Python state])
    others = [*watched, *((opt, type(opt).__name__, None) for opt, _, _ in step.optimizers.values()),
              *((a, "an argument", None) for a in (*args, *kwargs.values()) if isinstance(a, (list, dict)))]
    check_leaks([*journal.found(), *reachable(others, owned=True, seen=set(journal.known))])
    _refuse_written_views(traced, leaves, names)
    tensor_meta = tuple((s.index, m) for s, m in zip(traced.sources, traced.input_meta)
                        if s.kind is SourceKind.ARG)
    signature = InputSignature(
        spec, tensor_meta,
        tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)),
        aliases=alias_pattern(leaves, tensor_meta), views=alias_pattern(leaves, tensor_meta, bases=True),
        shape_guards=shape_guards(tracer, [tracer.fake_of[id(leaves[i])] for i, _ in tensor_meta]),
    )
    guards = (*[g for g in reads.guards.values() if not step.replaces(g.path)], *hook_guards, *step.guards)
    return RootTrace(tracer, traced, leaves, spec, names, signature, guards, step, reads, written.positions,
                     journal.state(), tuple(input_hooks), written.returned)


def _state_roots(target: Any, owner: Any, leaves: list[Any], names: list[str]) -> list[tuple[Any, str, Any]]:
    """Where the Python state the code may write is found: the module (or object) it is a method of, its
    other arguments, what its closure and globals hold, what torch's global module hooks hold."""
    roots = [(leaf, f"argument {names[i]!r}", None) for i, leaf in enumerate(leaves)
             if not isinstance(leaf, torch.Tensor) and not plain_value(leaf)]
    if owner is not None:
        roots.insert(0, (owner, type(owner).__name__, None))
    return [*roots, *code_roots(target, "the captured function"), *global_hook_roots()]


def _param_names(fn: Any) -> dict[int, str]:
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if not isinstance(module, torch.nn.Module):
        return {}
    return {id(t): name for name, t in chain(module.named_parameters(), module.named_buffers())}


def _hook_guards(owner: Any, leaves: list[Any], watched: Any) -> list[Guard]:
    """Guards on the hooks of every module the program may run -- the compiled module's, the modules it
    is passed, those its code read (watched), with all their submodules -- and on torch's global module
    hooks: a hook registered or removed on any of them captures anew (Note [Region identity])."""
    roots = [owner, *leaves, *(obj for obj, _ in watched)]
    modules: dict[int, torch.nn.Module] = {}
    for root in roots:
        if isinstance(root, torch.nn.Module) and id(root) not in modules:
            with unrecorded():
                for sub in root.modules():
                    modules.setdefault(id(sub), sub)
    return [Hooks.on(m) for m in (*modules.values(), GLOBAL)]


def _refuse_written_views(traced: Any, leaves: list[Any], names: list[str]) -> None:
    """An argument updated in place while another argument is a different view of its memory: eager's
    other view sees the update, the graph's copy of it would not (Note [Mutations]), so refuse."""
    for j in traced.mutated:
        src = traced.sources[j]
        if src.kind is not SourceKind.ARG:
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
