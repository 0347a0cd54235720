"""The Python state a captured program writes (Note [Python state], ``effectfx.capture.python_state``).

A trace that changed Python state the caller can reach -- an attribute set or deleted, a list appended to,
a dict item set -- leaves one :class:`PythonWrite` per change, in order: an operation on a ``dict`` (an
object's ``__dict__``, a module's ``_buffers``...) or a ``list``, with a value *template* whose tensors
are the graph's extra outputs (:class:`Out`).  The root's caller applies them after every run
(:meth:`PythonState.apply`), and a region's call site during the capture, into its own objects (the target
is then a path from the call's arguments).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils._pytree import tree_unflatten

from ..errors import SignatureMismatchError
from ..guards.check import GuardChecker
from ..guards.values import Path, Ref


class Op(str, enum.Enum):
    SET = "set"  # container[key] = value
    DELETE = "delete"  # del container[key] (a key already gone stays gone)
    EXTEND = "extend"  # a list: container.extend(value)
    DROP = "drop"  # a list: del container[:key] (items removed from its front)
    REPLACE = "replace"  # a list: container[:] = value


class Out:
    """A template leaf: the ``k``-th tensor the trace wrote (a graph output)."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k

    def __repr__(self) -> str:
        return f"Out({self.k})"


class Kept:
    """A template leaf: an object that existed before the trace, written as it is (by identity)."""

    __slots__ = ("ref",)

    def __init__(self, obj: Any) -> None:
        self.ref = Ref(obj)

    def __repr__(self) -> str:
        return f"Kept({self.ref!r})"


@dataclass(frozen=True)
class Tree:
    """A template: a list, tuple, dict or other pytree the trace made, made anew at each call as eager
    does (its leaves templates too)."""

    spec: Any
    leaves: tuple


def value_of(template: Any, values: Sequence[Any]) -> Any:
    kind = type(template)
    if kind is Out:
        return values[template.k]
    if kind is Kept:
        return template.ref.obj
    if kind is Tree:
        return tree_unflatten([value_of(leaf, values) for leaf in template.leaves], template.spec)
    return template  # plain data


@dataclass(frozen=True)
class PythonWrite:
    """One change of Python state, replayed with each call's values."""

    op: Op
    target: Path  # the dict or list changed: ("id", Ref) or ("leaf", i), then steps (locate)
    key: Any = None  # SET, DELETE: the key (an attribute's name); DROP: how many items
    value: Any = None  # SET, EXTEND, REPLACE: the template
    what: str = ""  # how messages name the place: "Model.last", "acts"

    def __repr__(self) -> str:
        return f"<{self.op.value} {self.what}>"


def locate(path: Path, leaves: Sequence[Any] = ()) -> Any:
    """The container at ``path``, read without reporting reads: a step is ``"__dict__"``, a table of a
    module's (``"_buffers"``...), a submodule or an attribute held in the ``__dict__``, or ``("item", k)``."""
    root = path[0]
    obj = leaves[root[1]] if root[0] == "leaf" else root[1].obj
    for step in path[1:]:
        if isinstance(step, tuple):
            obj = obj[step[1]]
        elif step == "__dict__":
            obj = vars(obj)
        else:
            d = vars(obj)
            modules = d.get("_modules")
            obj = modules[step] if modules is not None and step in modules else d[step]
    return obj


def _tables(owner: Any, step: Any) -> list[tuple[dict, Any]]:
    """Where the tensor a trace read as ``step`` of ``owner`` lives: a module's tables, an object's
    ``__dict__``, a dict's item."""
    if isinstance(step, tuple):
        return [(owner, step[1])] if isinstance(owner, dict) else []
    d = vars(owner) if hasattr(owner, "__dict__") else {}
    return [(t, step) for t in (d.get("_parameters"), d.get("_buffers"), d) if isinstance(t, dict)]


def apply_writes(writes: Sequence[PythonWrite], values: Sequence[Any], leaves: Sequence[Any] = (),
                 before: Callable[[Any, PythonWrite], None] | None = None) -> None:
    """Make each change, in order, with ``values`` for the template's outputs; ``before(container,
    write)`` is told first (a capture's journals see the state before the change)."""
    for write in writes:
        container = locate(write.target, leaves)
        if before is not None:
            before(container, write)
        op = write.op
        if op is Op.SET:
            container[write.key] = value_of(write.value, values)
        elif op is Op.DELETE:
            container.pop(write.key, None)
        elif op is Op.EXTEND:
            container.extend(value_of(write.value, values))
        elif op is Op.DROP:
            del container[:write.key]
        else:
            container[:] = value_of(write.value, values)


@dataclass(frozen=True)
class PythonState:
    """What a program writes into Python state after each run, and what it assumes of that state.

    ``guards``: the state each write depends on as the trace found it (plain data only: a counter's value,
    an empty list), by identity; efx.compile checks them with the program's other guards, a program of
    efx.capture before each run (:meth:`check`).  ``changes``: ``(path, before, after)`` of each guarded
    plain value the program changes, for efx.compile's refusal of a value that changes on every call."""

    writes: tuple[PythonWrite, ...]
    guards: tuple = ()
    changes: tuple = ()
    _checker: list = field(default_factory=list, compare=False, repr=False)
    _relift: list = field(default_factory=list, compare=False, repr=False)

    def apply(self, values: Sequence[Any]) -> None:
        apply_writes(self.writes, values)

    def lifted(self, lifted: tuple, lifted_from: tuple) -> Sequence[Any]:
        """``lifted`` (the tensors a program of efx.capture reads by identity) with those its own writes
        replace -- a buffer rebound, a tensor attribute deleted and set again by the caller -- read anew
        from where it wrote them; refused when one is gone or no longer like the one traced."""
        if not self._relift:
            slots = {(id(locate(w.target)), w.key) for w in self.writes if w.op in (Op.SET, Op.DELETE)}
            self._relift.append([(i, table, key) for i, source in enumerate(lifted_from) if source is not None
                                 for table, key in _tables(*source) if (id(table), key) in slots])
        if not self._relift[0]:
            return lifted
        current = list(lifted)
        for i, table, key in self._relift[0]:
            now, was = table.get(key), lifted[i]
            if now is None or (now.shape, now.dtype, now.stride(), now.requires_grad) != (
                    was.shape, was.dtype, was.stride(), was.requires_grad):
                raise SignatureMismatchError(
                    f"the program reads {key!r}, which its own Python writes replace (Note [Python state]), "
                    f"and it is now {'gone' if now is None else 'unlike the tensor it was captured for'}. "
                    "Use efx.compile, which captures again for it."
                )
            current[i] = now
        return current

    def check(self, name: str) -> None:
        """Refuse a run of an efx.capture program on Python state other than the state it was captured
        from: the values it writes were computed from that state."""
        if not self.guards:
            return
        if not self._checker:
            self._checker.append(GuardChecker(self.guards))
        checker = self._checker[0]
        if not checker():
            guard, found = checker.failed()[0]
            raise SignatureMismatchError(
                f"{name!r} writes Python state it computed from the state it was captured with, which has "
                f"changed since: {guard.describe()} was expected, {guard.found_text(found)} found (Note "
                "[Python state]). Use efx.compile, which captures again for the new state (and refuses a "
                "value that changes on every call), or keep that state in a tensor."
            )
