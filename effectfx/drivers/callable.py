"""The compiled callable of efx.compile: it captures once per input signature and runs the cached program.

The signature is what every call shows: the structure of the arguments, every tensor's shape, stride,
dtype, device and requires_grad, the values of non-tensor arguments, grad mode and autocast, and the plain
values the compiled function's closure and globals hold.  Each program then has *guards*: every Python
value its capture read from an object -- ``self.training``, ``self.config.use_gate``, a region's globals --
checked again on each call (Note [Region identity]); a program whose guards fail is not run, and a new one
is captured.  Parameters and buffers are read from their module at each call, so an optimizer's in-place
updates and reassigned parameters are seen; one whose metadata differs from the traced one (shape, dtype,
requires_grad) makes a new program, and a replaced submodule drops every cached program.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..backends.tiers import Tiers, run_tiered, tiers_for
from ..capture.shapes import Dynamic, ShapeCache, erased
from ..errors import BackendError, PythonStateError, UnsupportedOperatorError
from ..graph.torch_func import FUNCTORCH, torch_func_kinds, torch_func_refusal, wrapped_or_grad
from ..graph.traced import TensorMeta
from ..guards.check import resolve
from ..guards.floats import (
    TENSOR_HYPERPARAMETERS,
    FloatInputs,
    capture_with_floats,
    changed_floats,
    current,
    float_inputs,
)
from ..guards.identity import ambient, leaf_key
from ..guards.values import Path
from ..guards.words import guard_text, path_text
from ..passes.pipeline import run_passes
from ..passes.reinplace import reinplace_in_place
from ..passes.remove_tokens import remove_effect_tokens_pass
from ..passes.simplify import simplify_in_place
from ..passes.thread_tokens import discover_effects, thread_tokens
from ..program.containers import register_tensor_holders
from ..program.program import Program
from ..program.training import TrainingProgram
from ..regions.decorator import active_tracer
from .capture import trace_program
from .eager_errors import eager_instead
from .entry import CompiledEntry, CompileStats, Slot, same_tensors, shallow, slot_of, tensor_key


def lower_to_inductor(prog: Program) -> Program:
    """Token-free -> Inductor segments between effects (imported lazily: Inductor is slow to import)."""
    from ..backends.inductor import lower_to_inductor as lower

    return lower(prog)


# The passes between capture and execution, per backend.  Kept in one table so a backend is one entry.
# "eager" goes captured -> token-free directly: discover_effects checks region effects as thread_tokens
# does, without the round trip through tokens that would rebuild every graph into the same one; and the
# capture is efx.compile's alone, so it is simplified in place.
BACKEND_PASSES: dict[str, list[Callable[[Program], Program]]] = {
    "eager": [discover_effects, simplify_in_place],
    "inductor": [thread_tokens, remove_effect_tokens_pass, lower_to_inductor],
}
# ... then, for a program without a backward (a training program's forward runs inside an autograd.Function,
# which must not update its inputs in place), per backend
INFERENCE_PASSES: dict[str, list[Callable[[Program], Program]]] = {
    "eager": [reinplace_in_place], "inductor": [],
}


_READS_GRAD = "it reads tensors that require grad (a closure's, a region's parameters)"
# why a compiled function cannot run under a torch.func transform (by kind), and what to do instead
_REFUSED = {
    "Grad": ("a compiled program is differentiated by torch.autograd (a training program is one "
             "autograd.Function, which torch.func cannot transform)", "Call it outside torch.func and use "
             "torch.autograd.grad or .backward(), or compile the code calling {transform} (without regions)"),
    "Jvp": ("a capture under it would bake its dual tensors into the graph", "Call it outside torch.func, "
            "or compile the code calling {transform} (without regions)"),
    "Functionalize": ("a capture under it would bake its functional tensors into the graph", "Call it "
                      "outside {transform}: the compiled program already is functional"),
    "Vmap": ("{}: the program would be a training program, one autograd.Function, which vmap cannot batch",
             "Call it under torch.no_grad() (an inference program runs batched, as eager does), or without "
             "efx.compile under {transform}"),
    "batched": ("its parameters are BatchedTensors (torch.func.functional_call under vmap?), which the "
                "capture would bake in", "Call the module without efx.compile under {transform}"),
}


def _raised_in_autograd_function(e: BaseException) -> bool:  # (no setup_context: torch.func refuses it)
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename == torch.autograd.function.__file__


class CompiledCallable:
    """What :func:`compile` returns; call it like the original function or module."""

    def __init__(self, fn: Callable[..., Any], backend: str = "eager", profile_regions: bool = False,
                 dynamic: bool | None = None, tiers: str | Tiers | None = None) -> None:
        if backend not in BACKEND_PASSES:
            raise BackendError(f"unknown backend {backend!r}; choose one of {sorted(BACKEND_PASSES)}.")
        if dynamic not in (None, True, False):
            raise BackendError(f"dynamic must be None (automatic), True or False, not {dynamic!r}.")
        self.fn = fn
        self.backend = backend
        self.profile_regions = profile_regions
        self.dynamic = dynamic
        self.tiers = tiers_for(backend, tiers)
        self.cache: dict[Any, list[CompiledEntry]] = {}  # signature -> its programs, in compile order
        self._last: dict[Any, CompiledEntry] = {}  # signature -> the program that served it last
        self.shapes = ShapeCache(dynamic)  # the same programs by signature without sizes
        self.stats = CompileStats()
        self._lock = threading.Lock()
        module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
        self._module = module if isinstance(module, torch.nn.Module) else None
        self._walked = False
        self._slots: dict[int, Slot] = {}
        self._children: list[tuple[dict, str, torch.nn.Module]] = []  # (parent._modules, name, child)
        self._state_readers: list[Callable[[], Any]] | None = None
        self._changes: dict[Any, tuple[list[Any], list[Any]]] = {}  # plain state programs change, by path
        self._specialized: set[Path] = set()  # floats code needs as floats (Note [Float inputs])
        self.__wrapped__ = fn

    def _tensor_slots(self) -> dict[int, Slot]:
        """Where each tensor of the compiled module lives now: parameters, buffers, tensor attributes."""
        slots: dict[int, Slot] = {}
        for sub in self._module.modules() if self._module is not None else ():
            for table in (sub._parameters, sub._buffers, vars(sub)):
                for name, t in table.items():
                    if isinstance(t, torch.Tensor) and not name.startswith("_"):
                        slots.setdefault(id(t), (table, name))
        return slots

    def _check_children(self) -> None:
        """A replaced submodule drops every program: they read the old one's parameters."""
        if self._module is None:
            return
        if self._walked and not all(d.get(n) is c for d, n, c in self._children):
            with self._lock:
                self.cache.clear()
                self._last.clear()
                self.shapes.clear()
                self._walked, self._slots = False, {}
        if not self._walked:  # walking the module tree on every call would cost more than eager
            subs = list(self._module.modules())
            self._children = [(sub._modules, n, c) for sub in subs for n, c in sub._modules.items()]
            self._slots = self._tensor_slots()
            self._walked = True

    def _object_names(self) -> dict[int, str]:
        """Names for the objects guards read from: the compiled module's submodules by path."""
        if self._module is None:
            return {}
        root = type(self._module).__name__
        return {id(m): f"{root}.{n}" if n else root for n, m in self._module.named_modules()}

    def _python_state(self) -> tuple:
        """Plain values the compiled function reads from its closure or names as globals (shallowly into
        dicts and lists): Python state a trace bakes in, like a logging flag.  Deeper reads (callees,
        object attributes) are not seen; see docs/SUPPORT.md."""
        if self._state_readers is None:
            fn = getattr(self.fn, "__func__", self.fn)
            code = getattr(fn, "__code__", None)
            readers: list[Callable[[], Any]] = []
            if code is not None and self._module is None:
                for cell in getattr(fn, "__closure__", None) or ():
                    readers.append(lambda cell=cell: shallow(cell.cell_contents))
                scope = getattr(fn, "__globals__", {})
                for name in code.co_names:
                    if name in scope and shallow(scope[name]) is not None:
                        readers.append(lambda name=name: shallow(scope.get(name)))
            self._state_readers = readers
        return tuple([read() for read in self._state_readers])

    def signature(self, args: tuple, kwargs: dict) -> tuple[Any, list[Any]]:
        self._check_children()
        if not kwargs and all(type(a) is torch.Tensor for a in args):
            # the common call, f(x, y): no pytree flattening and no TreeSpec hashing on the hot path
            return (ambient(), ("tensors", len(args)), *map(tensor_key, args), self._python_state(),
                    same_tensors(args)), list(args)
        leaves, spec = tree_flatten((args, kwargs))
        if any(type(leaf).__name__.endswith("Cache") for leaf in leaves):  # transformers' caches: containers
            register_tensor_holders()
            leaves, spec = tree_flatten((args, kwargs))
        # non-tensor values are keyed as regions key them: by type and value (1, 1.0 and True differ)
        parts = [tensor_key(leaf) if isinstance(leaf, torch.Tensor) else leaf_key(leaf, labels=False)
                 for leaf in leaves]
        return (ambient(), spec, *parts, self._python_state(), same_tensors(leaves)), leaves

    def _find(self, key: Any) -> tuple[CompiledEntry, list[torch.Tensor]] | None:
        """The program that served ``key`` last is checked first: a training step's first program (no
        optimizer state yet) fails from its second call on, and a failing program's guards stay interpreted
        (``guards.check.GuardChecker``): checked first, they would cost GPT-2's step ~7 ms a call."""
        last = self._last.get(key)
        found = self._usable((last,)) if last is not None else None
        if found is None:
            found = self._usable(e for e in self.cache.get(key, ()) if e is not last)
            memo = self.shapes.memo
            if found is None and memo:
                found = self._usable(e for e in memo.get(key, ()) if e is not last)
            if found is not None:
                self._last[key] = found[0]
        return found

    @staticmethod
    def _usable(entries: Any) -> tuple[CompiledEntry, list[torch.Tensor]] | None:
        for entry in entries:
            if entry.check():
                lifted = entry.current_lifted()
                if lifted is not None:
                    return entry, lifted
        return None

    def entry_for(self, args: tuple, kwargs: dict, vmap: bool = False
                  ) -> tuple[CompiledEntry, list[Any], list[torch.Tensor]]:
        """The program for this call, its inputs; under ``vmap`` one needing autograd is refused, not kept."""
        key, leaves = self.signature(args, kwargs)
        found = self._find(key)
        if found is None:
            with self._lock:  # one thread compiles a signature; the others wait for it
                found = self._find(key)
                group = erased(key, leaves) if found is None else None
                if found is None:  # a symbolic program whose guards hold serves it (Note [Symbolic shapes])
                    found = self._usable(self.shapes.symbolic(group, leaves))
                    if found is not None:
                        self.shapes.remember(key, found[0])
                if found is None:
                    names = self._object_names()
                    failed = [f for e in self.cache.get(key, ()) for f in e.check.failed()]
                    why = [guard_text(guard, got, names) for guard, got in failed]
                    # the floats earlier programs took as inputs, and those that changed: inputs now
                    good = frozenset(p for e in self.cache.get(key, ()) for p in e.float_paths)
                    new = [p for p in changed_floats(failed) if p not in good and p not in self._specialized]
                    if len(why) > 4:  # (a training step's optimizer state: one guard per tensor)
                        why[3:] = [f"and {len(why) - 3} more"]
                    dims, why_dynamic = self.shapes.dims_for(group, leaves)
                    try:
                        entry = capture_with_floats(lambda floats: self._compile(args, kwargs, dims, floats),
                                                    good, new, self._specialized, TENSOR_HYPERPARAMETERS
                                                    if self.dynamic else frozenset())
                    except RuntimeError as e:  # torch.func refused an autograd.Function: a region's call
                        if vmap and _raised_in_autograd_function(e):
                            raise self._torch_func_refusal("Vmap", _READS_GRAD) from e
                        raise
                    if vmap and isinstance(entry.program, TrainingProgram):  # not kept
                        raise self._torch_func_refusal("Vmap", _READS_GRAD)
                    self.stats.compiles += 1
                    self.stats.compile_seconds.append(entry.compile_seconds)
                    entry.why = tuple(why)
                    entry.why_dynamic = why_dynamic if dims else ""
                    entry.why_shapes = self.shapes.failed(group, leaves)
                    if entry.floats:
                        entry.why = (*entry.why, "float inputs: " + ", ".join(
                            entry.float_names.get(p) or path_text(p, (), names) for p in entry.float_paths))
                    self.cache.setdefault(key, []).append(entry)
                    self._last[key] = entry
                    self.shapes.add(group, entry)
                    return entry, leaves, list(entry.forward.lifted)
        if vmap and isinstance(found[0].program, TrainingProgram):
            raise self._torch_func_refusal("Vmap", _READS_GRAD)
        return found[0], leaves, found[1]

    def _compile(self, args: tuple, kwargs: dict, dynamic: Dynamic | None = None,
                 floats: FloatInputs | None = None) -> CompiledEntry:
        start = time.perf_counter()
        with float_inputs(floats or FloatInputs(frozenset())) as inputs:  # (Note [Float inputs])
            traced = trace_program(self.fn, args, kwargs, profile_regions=self.profile_regions,
                                   dynamic=dynamic)
        self._refuse_changing_state(traced.forward if isinstance(traced, TrainingProgram) else traced)
        program, tiers = run_tiered(traced, BACKEND_PASSES[self.backend], self.tiers)
        if not isinstance(program, TrainingProgram):
            program = run_passes(program, INFERENCE_PASSES[self.backend])
        forward = program.forward if isinstance(program, TrainingProgram) else program
        seconds = time.perf_counter() - start
        # a module tensor swapped in for this call (torch.func.functional_call) is read from where it
        # lives, as the module's own are: a later call must not see it once the module has its own back
        now = self._tensor_slots() if any(id(t) not in self._slots for t in forward.lifted) else {}
        positions = tuple(i for i, _ in forward.signature.tensor_meta)
        cells = {id(t): p for p, t in inputs.cells.items()}
        return CompiledEntry(
            program,
            positions,
            tuple(self._slots.get(id(t)) or now.get(id(t)) or slot_of(t, src)
                  for t, src in zip(forward.lifted, forward.lifted_from or (None,) * len(forward.lifted))),
            tuple(TensorMeta.of(t) for t in forward.lifted),
            seconds,
            forward.guards,
            floats=tuple((len(positions) + i, cells[id(t)]) for i, t in enumerate(forward.lifted)
                         if id(t) in cells),
            float_names=inputs.names,
            float_paths=tuple(inputs.read),
            tiers=tiers,
        )

    def _refuse_changing_state(self, forward: Program) -> None:
        """A plain value in Python state its programs change from the value an earlier program wrote to one
        none started from (a counter: 0 -> 1, then 1 -> 2) would make a program per call: refused at the
        second capture (Note [Python state]); a flag set once, or a value toggled, captures once more."""
        state = forward.python_state
        for path, before, after, what, line in state.changes if state is not None else ():
            befores, afters = self._changes.setdefault(path, ([], []))
            if before in afters and after not in befores and after not in afters:
                raise PythonStateError(
                    f"efx.compile'd {self._name()!r} changes {what} on every call (from {before!r} to "
                    f"{after!r} now, from {befores[afters.index(before)]!r} to {before!r} at the call "
                    f"before){f' at {line}' if line else ''}: a compiled program writes it with the value "
                    "of its capture, so each call would capture a new program (Note [Python state]).\n"
                    "Keep the value in a tensor (a buffer: `self.calls += 1` on a tensor is written back "
                    "with each call's value), or change it outside the compiled call."
                )
            befores.append(before)
            afters.append(after)

    def _name(self) -> str:
        return type(self._module).__name__ if self._module is not None else getattr(self.fn, "__name__", "fn")

    def _torch_func_refusal(self, kind: str, detail: str = "", reason: str = "") -> UnsupportedOperatorError:
        why, todo = _REFUSED[reason or kind]
        return torch_func_refusal(f"efx.compile'd {self._name()!r}", kind, why.format(detail), todo)

    def _check_torch_func(self, args: tuple, kwargs: dict) -> None:
        """Under vmap an inference program (captured on plain fakes) runs its aten ops batched, as eager
        does; another transform would be baked into the graph, and a training program is an
        autograd.Function, which torch.func cannot transform: refused before anything runs."""
        others = [k for k in torch_func_kinds() if k != "Vmap"]
        if others:
            raise self._torch_func_refusal(others[-1])
        own = [] if self._module is None else [
            (repr(n), t) for n, t in (*self._module.named_parameters(), *self._module.named_buffers())]
        leaves = tree_flatten((args, kwargs))[0]
        needs_grad = wrapped_or_grad([(f"argument {i}", t) for i, t in enumerate(leaves)] + own)[1]
        if needs_grad is not None:
            raise self._torch_func_refusal("Vmap", f"its {needs_grad} requires grad")
        if wrapped_or_grad(own)[0] is not None:  # functional_call under vmap (model ensembling)
            raise self._torch_func_refusal("Vmap", reason="batched")

    @torch._disable_dynamo  # opaque to Dynamo: a graph break (drivers/dynamo_backend.py); lazy import
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if active_tracer() is not None:  # called inside a capture: inlined (Note [Nested compiles])
            return self.fn(*args, **kwargs)
        vmap = FUNCTORCH.peek_interpreter_stack() is not None  # torch.func: one C call on the hot path
        if vmap:
            self._check_torch_func(args, kwargs)
        try:
            entry, leaves, lifted = self.entry_for(args, kwargs, vmap)
        except Exception as exc:
            failed = exc  # handled below, outside this handler: eager's own error is not chained to it
        else:
            failed = None
        if failed is not None:  # the user's error raises as eager's, after eager's effects
            return eager_instead(self.fn, args, kwargs, failed, self._name())
        self.stats.calls += 1
        program = entry.program if entry.tiers is None else entry.tiers.program(entry)  # (a call boundary)
        forward = program.forward if isinstance(program, TrainingProgram) else program
        inputs = [leaves[i] for i in entry.tensor_positions]
        inputs.extend(lifted)
        for i, path in entry.floats:  # each float input's value now (Note [Float inputs])
            inputs[i] = current(resolve(path, ()))
        if isinstance(program, TrainingProgram):
            outs = list(program.run_autograd(inputs))
            result = forward.unflatten(forward.write_back(inputs, outs), args, kwargs)
        else:
            result = forward.unflatten(forward.write_back(inputs, forward.run_flat(inputs)), args, kwargs)
        if forward.written_args or forward.state_writes or forward.python_state is not None:
            return forward.finish(result, args, kwargs)
        return result

    # -- inspection ------------------------------------------------------------------------------
    def programs(self) -> list[Program | TrainingProgram]:
        return [e.program for entries in self.cache.values() for e in entries]  # (each once: memo apart)

    def __repr__(self) -> str:
        return f"<effectfx.compile of {getattr(self.fn, '__name__', type(self.fn).__name__)}: " \
               f"{self.stats.compiles} compiled signature(s), backend {self.backend!r}>"
