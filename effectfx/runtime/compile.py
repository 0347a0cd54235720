"""efx.compile: a drop-in callable that captures once per input signature and runs the cached program.

The signature is what can change a trace: the structure of the arguments, every tensor's shape, dtype,
device and requires_grad, the values of non-tensor arguments, grad mode, and -- for modules -- every
submodule's ``training`` flag and every parameter's ``requires_grad``.  Parameters are read by identity
at each call, so an optimizer's in-place updates are seen without recompiling.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..capture.capture import trace_program
from ..functionalize import thread_tokens
from ..passes.pipeline import run_passes
from ..passes.remove_tokens import remove_effect_tokens_pass
from .program import Program, TrainingProgram


# The passes between capture and execution, per backend.  Kept in one table so a backend is one entry.
# "eager" runs the token-free form: no token tensors or with_effects calls at run time, node order keeps
# the effects (DESIGN §2.4).
def lower_to_inductor(prog: Program) -> Program:
    """Token-free -> Inductor segments between effects (imported lazily: Inductor is slow to import)."""
    from ..backends.inductor import lower_to_inductor as lower

    return lower(prog)


BACKEND_PASSES: dict[str, list[Callable[[Program], Program]]] = {
    "eager": [thread_tokens, remove_effect_tokens_pass],
    "inductor": [thread_tokens, remove_effect_tokens_pass, lower_to_inductor],
}


@dataclass
class CompiledEntry:
    """One compiled signature: its program and the guards on tensors it reads by identity."""

    program: Program | TrainingProgram
    tensor_positions: tuple[int, ...]
    lifted_guard: tuple[tuple[int, bool], ...]
    compile_seconds: float

    def lifted_ok(self) -> bool:
        lifted = self.forward.lifted
        return all(lifted[i].requires_grad == rg for i, rg in self.lifted_guard)

    @property
    def forward(self) -> Program:
        p = self.program
        return p.forward if isinstance(p, TrainingProgram) else p

    @property
    def backward(self) -> Program | None:
        p = self.program
        return p.backward if isinstance(p, TrainingProgram) else None


@dataclass
class CompileStats:
    compiles: int = 0
    calls: int = 0
    compile_seconds: list[float] = field(default_factory=list)


class CompiledCallable:
    """What :func:`compile` returns; call it like the original function or module."""

    def __init__(self, fn: Callable[..., Any], backend: str = "eager") -> None:
        if backend not in BACKEND_PASSES:
            from ..errors import BackendError

            raise BackendError(f"unknown backend {backend!r}; choose one of {sorted(BACKEND_PASSES)}.")
        self.fn = fn
        self.backend = backend
        self.cache: dict[Any, list[CompiledEntry]] = {}
        self.stats = CompileStats()
        self._lock = threading.Lock()
        module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
        self._module = module if isinstance(module, torch.nn.Module) else None
        self._submodules: list[torch.nn.Module] | None = None
        self._parameters: list[torch.nn.Parameter] = []
        self.__wrapped__ = fn

    def _module_key(self) -> tuple:
        if self._module is None:
            return ()
        if self._submodules is None:  # walking the module tree on every call would cost more than eager
            self._submodules = list(self._module.modules())
            self._parameters = list(self._module.parameters())
        return (tuple([sub.training for sub in self._submodules]),
                tuple([p.requires_grad for p in self._parameters]))

    def signature(self, args: tuple, kwargs: dict) -> tuple[Any, list[Any]]:
        leaves, spec = tree_flatten((args, kwargs))
        parts: list[Any] = [torch.is_grad_enabled(), spec, self._module_key()]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                parts.append((leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad))
            else:
                try:
                    hash(leaf)
                    parts.append(leaf)
                except TypeError:
                    parts.append(("object", id(leaf)))
        return tuple(parts), leaves

    def entry_for(self, args: tuple, kwargs: dict) -> tuple[CompiledEntry, list[Any]]:
        key, leaves = self.signature(args, kwargs)
        for entry in self.cache.get(key, ()):
            if entry.lifted_ok():
                return entry, leaves
        with self._lock:  # one thread compiles a signature; the others wait for it
            for entry in self.cache.get(key, ()):
                if entry.lifted_ok():
                    return entry, leaves
            entry = self._compile(args, kwargs)
            self.cache.setdefault(key, []).append(entry)
            return entry, leaves

    def _compile(self, args: tuple, kwargs: dict) -> CompiledEntry:
        start = time.perf_counter()
        program = run_passes(trace_program(self.fn, args, kwargs), BACKEND_PASSES[self.backend])
        forward = program.forward if isinstance(program, TrainingProgram) else program
        seconds = time.perf_counter() - start
        self.stats.compiles += 1
        self.stats.compile_seconds.append(seconds)
        return CompiledEntry(
            program,
            tuple(i for i, _ in forward.signature.tensor_meta),
            tuple((i, t.requires_grad) for i, t in enumerate(forward.lifted)),
            seconds,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        entry, leaves = self.entry_for(args, kwargs)
        self.stats.calls += 1
        program = entry.program
        forward = entry.forward
        inputs = [leaves[i] for i in entry.tensor_positions]
        inputs.extend(forward.lifted)
        if isinstance(program, TrainingProgram):
            return forward.unflatten(list(program.run_autograd(inputs)))
        return forward.unflatten(forward.run_flat(inputs))

    # -- inspection ------------------------------------------------------------------------------
    def programs(self) -> list[Program | TrainingProgram]:
        return [e.program for entries in self.cache.values() for e in entries]

    def __repr__(self) -> str:
        return f"<effectfx.compile of {getattr(self.fn, '__name__', type(self.fn).__name__)}: " \
               f"{self.stats.compiles} compiled signature(s), backend {self.backend!r}>"


def compile(fn: Callable[..., Any], *, backend: str = "eager") -> CompiledCallable:  # noqa: A001
    """Compile ``fn`` (a function or ``nn.Module``): autograd, caching per signature, effects in order."""
    return CompiledCallable(fn, backend=backend)
