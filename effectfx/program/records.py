"""The records a Program carries besides its graphs: its form, its input signature, its region entries,
how each body came to be (for ``efx.explain``) and the passes that made it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten

from ..errors import SignatureMismatchError
from ..graph.symbols import ShapeGuards
from ..graph.traced import Kind, TensorMeta


class Form(Kind):
    """How a Program's graphs order their effects (Note [Effect tokens]): ``Program.form``.  Passes go
    captured -> functionalized -> unlifted -> token-free; a user may name a form by its value."""

    CAPTURED = "captured"  # as traced: no tokens, node order only
    FUNCTIONALIZED = "functionalized"  # tokens thread every effect and cross each graph's boundary
    UNLIFTED = "unlifted"  # each graph makes and sinks its own tokens
    TOKEN_FREE = "token-free"  # tokens dropped again: node order and the effectful nodes' impurity


@dataclass(frozen=True)
class InputSignature:
    """What a program was captured for: the structure of (args, kwargs) and every leaf's identity."""

    spec: TreeSpec
    tensor_meta: tuple[tuple[int, TensorMeta], ...]  # (leaf index, metadata) of each tensor leaf
    constants: tuple[tuple[int, Any], ...]  # (leaf index, value) of each non-tensor leaf
    # the same tensor passed twice is one input of the graph: per tensor leaf, the leaf index of the first
    # leaf that is the same tensor (() when all differ); a call must pass the same pattern
    aliases: tuple[int, ...] = ()
    views: tuple[int, ...] = ()  # the same for views of one tensor (by ``_base``), which updates cross
    # a symbolic program's guards on its tensors' sizes (Note [Symbolic shapes]); () when static
    shape_guards: tuple[str, ...] = ()
    checks: ShapeGuards | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.shape_guards and self.checks is None:
            object.__setattr__(self, "checks", ShapeGuards(self.shape_guards))

    def guard_text(self, guard: str, names: list[str] | None = None) -> str:
        """A guard with ``L['t<k>']`` spelled as the k-th tensor argument's name (or ``input k``)."""
        def name(match: re.Match) -> str:
            k = int(match.group(1))
            return names[k] if names is not None and k < len(names) else f"input{self.tensor_meta[k][0]}"
        return re.sub(r"L\['t(\d+)'\]", name, guard)

    def bind(self, args: tuple, kwargs: dict, name: str) -> list[torch.Tensor]:
        leaves, spec = tree_flatten((args, kwargs))
        if spec != self.spec:
            raise SignatureMismatchError(
                f"{name} was captured for arguments shaped like {self.spec}, got {spec}. Capture again "
                "for these arguments, or use effectfx.compile, which re-captures when inputs change."
            )
        tensors = []
        for index, meta in self.tensor_meta:
            leaf = leaves[index]
            if not isinstance(leaf, torch.Tensor) or (
                not _same_shape(leaf, meta) or leaf.dtype != meta.dtype or leaf.device != meta.device
                # captured without a gradient for it: its gradient would silently be missing (a torch.func
                # transform's tensors are refused by the program, naming the transform)
                or (leaf.requires_grad and not meta.requires_grad and torch.is_grad_enabled()
                    and not torch._C._functorch.is_functorch_wrapped_tensor(leaf))
            ):
                got = TensorMeta.of(leaf).short() if isinstance(leaf, torch.Tensor) else repr(leaf)
                raise SignatureMismatchError(
                    f"{name}: input {index} was captured as {meta.short()} but got {got}. Capture again "
                    "for these inputs, or use effectfx.compile, which re-captures when inputs change."
                )
            tensors.append(leaf)
        if self.checks is not None and not self.checks.hold(tensors):
            failed = ", ".join(self.guard_text(g) for g in self.checks.failed(tensors))
            raise SignatureMismatchError(
                f"{name}: the inputs' sizes break what its symbolic capture assumed ({failed}). Capture "
                "again for these inputs, or use effectfx.compile, which re-captures when a guard fails."
            )
        if (alias_pattern(leaves, self.tensor_meta) != self.aliases
                or alias_pattern(leaves, self.tensor_meta, bases=True) != self.views):
            raise SignatureMismatchError(
                f"{name} was captured with {_aliasing(self.views, self.tensor_meta)}, and is called with "
                f"{_aliasing(alias_pattern(leaves, self.tensor_meta, True), self.tensor_meta)}: the graph "
                "reads each tensor once, and an update through one is seen through the others, "
                "so it cannot serve both. Capture again for these inputs, or use effectfx.compile, which "
                "captures each pattern apart."
            )
        for index, value in self.constants:
            if leaves[index] is not value and leaves[index] != value:
                raise SignatureMismatchError(
                    f"{name}: argument {index} was {value!r} when captured but is {leaves[index]!r} now; "
                    "non-tensor arguments are baked into the graph. Capture again for the new value."
                )
        return tensors


def _same_shape(leaf: torch.Tensor, meta: TensorMeta) -> bool:
    """The static sizes and strides of ``meta`` (a symbolic one is the shape guards' to check)."""
    if not meta.symbolic:  # views are traced per layout
        return tuple(leaf.shape) == meta.shape and (leaf.numel() <= 1 or tuple(leaf.stride()) == meta.stride)
    return leaf.dim() == len(meta.shape) and all(
        type(m) is not int or a == m for a, m in zip(leaf.shape, meta.shape))


def alias_pattern(leaves: list[Any], tensor_meta: tuple[tuple[int, Any], ...], bases: bool = False
                  ) -> tuple[int, ...]:
    """Per tensor leaf, the index of the first leaf that is the same tensor (``bases``: a view of the same
    tensor); () when all differ."""
    first: dict[int, int] = {}
    pattern = tuple(first.setdefault(id(_base(leaves[i]) if bases else leaves[i]), i) for i, _ in tensor_meta)
    return pattern if len(first) < len(pattern) else ()


def _base(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _aliasing(pattern: tuple[int, ...], tensor_meta: tuple[tuple[int, Any], ...]) -> str:
    same = [f"{j} and {i}" for (i, _), j in zip(tensor_meta, pattern) if i != j]
    return (f"the same tensor (or views of it) as inputs {', '.join(same)}" if same
            else "a different tensor for each input")


@dataclass(frozen=True)
class RegionEntry:
    """The region cache entry of one identifier: which region, how often traced, its effect keys."""

    name: str
    traces: int
    effects: frozenset[str] | None = None  # known once the program has been functionalized


@dataclass(frozen=True)
class BodyInfo:
    """How one region body came to be (for ``efx.explain``): its cache key, labelled, and its cost."""

    identifier: str
    region: str
    key: tuple
    key_labels: tuple[str, ...]
    trace_seconds: float
    calls: int
    guards: tuple = ()  # what its trace read: guards (effectfx.guards.kinds)
    unshared: str = ""  # why calls promoted to require grad could not share its region's body


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
