"""One compiled signature of an ``efx.compile``'d callable (``CompiledEntry``): its program, where the
tensors it lifted live, the guards checked before it runs; and the parts of a call's signature that are
plain tuples (``tensor_key``, ``same_tensors``, ``shallow``), cheap to build on every call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..graph.traced import TensorMeta
from ..guards.check import GuardChecker
from ..guards.values import Path, plain_value
from ..program.program import Program
from ..program.records import alias_pattern
from ..program.training import TrainingProgram


def tensor_key(t: torch.Tensor) -> tuple:
    # a plain tuple: cheaper on every call than TensorMeta.of, same fields; a tensor that requires grad
    # and has a history is its own case (code may read ``x.is_leaf``, and the trace follows it)
    grad = t.requires_grad and (t.is_leaf or "non-leaf")
    return (t.shape, t.stride(), t.dtype, t.device, grad)


def same_tensors(leaves: Any) -> tuple:
    """The same tensor (or views of one) passed twice is one graph input (``InputSignature.aliases``): its
    own signature.  Cheap when no two leaves share a base, the usual call."""
    tensors = tuple((i, None) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor))
    bases = {id(leaves[i] if leaves[i]._base is None else leaves[i]._base) for i, _ in tensors}
    if len(bases) == len(tensors):
        return ()
    leaves = list(leaves)
    return alias_pattern(leaves, tensors), alias_pattern(leaves, tensors, bases=True)


def shallow(value: Any) -> Any:
    """A hashable snapshot of plain data (numbers, strings, and dicts/lists/tuples of them), else None."""
    if plain_value(value):
        return value
    if isinstance(value, dict):
        return ("dict", tuple((k, v) for k, v in value.items() if plain_value(k) and plain_value(v)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(v for v in value if plain_value(v)))
    return None


Slot = tuple[dict, str]  # (a module's _parameters, _buffers or __dict__, name): where a lifted tensor lives


def slot_of(tensor: torch.Tensor, source: Any) -> Slot | None:
    """Where a lifted tensor the capture read from an object (a module reached through a closure or a
    global, a global tensor) lives, to be read again at each call: a replaced one is seen."""
    if source is None:
        return None
    owner, step = source
    if isinstance(step, tuple):  # ("item", key) of a dict: a global
        return (owner, step[1]) if isinstance(owner, dict) and owner.get(step[1]) is tensor else None
    tables = (owner._parameters, owner._buffers) if isinstance(owner, torch.nn.Module) else ()
    for table in (*tables, getattr(owner, "__dict__", {})):
        if table.get(step) is tensor:
            return table, step
    return None


@dataclass
class CompiledEntry:
    """One compiled signature: its program, and where to read the tensors it lifted at each call."""

    program: Program | TrainingProgram
    tensor_positions: tuple[int, ...]
    slots: tuple[Slot | None, ...]  # per lifted tensor: its module slot, or None (read by identity)
    lifted_meta: tuple[TensorMeta, ...]
    compile_seconds: float
    guards: tuple = ()  # the capture's reads, by identity: checked before each run
    why: tuple[str, ...] = ()  # guards of earlier programs of the same signature that failed
    why_dynamic: str = ""  # why its capture made sizes symbolic (Note [Symbolic shapes])
    why_shapes: tuple = ()  # (program, its shape guards that failed) per symbolic program of the same sizes
    floats: tuple[tuple[int, Path], ...] = ()  # (input position, path) per float input (Note [Float inputs])
    float_names: dict = field(default_factory=dict)  # path -> its name, where the capture knew one
    float_paths: tuple[Path, ...] = ()  # the paths read as inputs (a tuple's: its elements are cells)
    tiers: Any = None  # backend="inductor": which tier runs, and tier 2's build (backends.tiers.TierState)

    def __post_init__(self) -> None:
        self.check = GuardChecker(self.guards)  # the same guards, as code for the hot path

    def current_lifted(self) -> list[torch.Tensor] | None:
        """The lifted tensors as of now, or None if one no longer matches what was traced."""
        current = []
        for slot, traced, meta in zip(self.slots, self.forward.lifted, self.lifted_meta):
            t = traced if slot is None else slot[0].get(slot[1])
            if t is None or t.requires_grad != meta.requires_grad or (
                t is not traced and (tuple(t.shape) != meta.shape or t.dtype != meta.dtype)
            ):
                return None
            current.append(t)
        return current

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
