"""``efx.compile``'s programs grouped by their signature with sizes erased (Note [Symbolic shapes]).

A call whose exact signature has no program looks here: a symbolic program of its group whose shape guards
hold on its tensors serves it (and is remembered for that exact signature, so the next such call is one
dict lookup); else the group says which sizes the next capture makes symbolic -- with ``dynamic=None``
(automatic) those in which this call differs from the group's programs, with ``dynamic=True`` all, with
``dynamic=False`` none -- plus those marked by ``mark_dynamic``.  A tensor that changed in one size is made
symbolic in all of its sizes (but those marked static).
"""

from __future__ import annotations

from typing import Any

import torch

from ..capture.dynamic import Dynamic, all_dims, changed_dims, marked_dims, union
from ..graph.symbols import is_symbolic


def erased(key: tuple, leaves: list[Any]) -> tuple:
    """``key`` (CompiledCallable.signature's) with each tensor's sizes and strides replaced by its rank."""
    parts = list(key)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            part = parts[2 + i]
            parts[2 + i] = (len(part[0]), *part[2:])
    return tuple(parts)


def symbolic_dims(entry: Any) -> Dynamic:
    """The leaf dimensions a program took as symbols (those a guard pinned to one size excepted)."""
    found: Dynamic = {}
    for index, meta in entry.forward.signature.tensor_meta:
        dims = frozenset(d for d, size in enumerate(meta.shape) if is_symbolic(size))
        if dims:
            found[index] = dims
    return found


class ShapeCache:
    """The programs of one compiled callable, by erased signature."""

    def __init__(self, dynamic: bool | None) -> None:
        self.dynamic = dynamic
        self.groups: dict[tuple, list[Any]] = {}
        self.memo: dict[tuple, list[Any]] = {}  # exact signature -> symbolic programs found to serve it

    def symbolic(self, group: tuple, leaves: list[Any]) -> list[Any]:
        """The group's symbolic programs whose shape guards hold on these tensors (newest first)."""
        out = []
        for entry in reversed(self.groups.get(group, ())):
            checks = entry.forward.signature.checks
            if checks is not None and checks.hold([leaves[i] for i in entry.tensor_positions]):
                out.append(entry)
        return out

    def dims_for(self, group: tuple, leaves: list[Any]) -> tuple[Dynamic, str]:
        """The sizes the next capture makes symbolic, and why (for ``efx.explain``)."""
        marks = marked_dims(leaves)
        if self.dynamic is False:
            return {}, ""
        if self.dynamic is True:
            return all_dims(leaves), "dynamic=True"
        earlier = self.groups.get(group, ())
        changed = union(*(changed_dims(leaves, [(i, tuple(m.example().shape)) for i, m in
                                                e.forward.signature.tensor_meta]) for e in earlier))
        # a tensor whose shape changed is symbolic in every size: a batch of padded sequences changes its
        # length each step and its batch size at the last, partial batch -- one more capture, not two
        everything = all_dims(leaves)
        changed = {i: everything.get(i, dims) for i, dims in changed.items()}
        dims = union(marks, changed, *(symbolic_dims(e) for e in earlier))
        why = "automatic dynamic: sizes changed" if changed else (
            "mark_dynamic" if marks else "")
        return dims, why

    def add(self, group: tuple, entry: Any) -> None:
        self.groups.setdefault(group, []).append(entry)

    def remember(self, key: tuple, entry: Any) -> None:
        self.memo.setdefault(key, []).append(entry)

    def clear(self) -> None:
        self.groups.clear()
        self.memo.clear()
