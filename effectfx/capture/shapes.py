"""Which sizes of a capture are symbolic (Note [Symbolic shapes]): torch's marks on tensors
(``mark_dynamic`` / ``mark_static``, the attributes ``torch._dynamo`` sets, so a tensor marked by either is
marked for both), ``torch.export``-style ``dynamic_shapes`` specs, and the sizes in which two calls differ
(``efx.compile``'s automatic dynamic); and the programs of one signature with its sizes erased, of which a
symbolic one may serve a call (:class:`ShapeCache`).

A call whose exact signature has no program looks here: a symbolic program of its group whose shape guards
hold on its tensors serves it (and is remembered for that exact signature, so the next such call is one
dict lookup); else the group says which sizes the next capture makes symbolic -- with ``dynamic=None``
(automatic) those in which this call differs from the group's programs, with ``dynamic=True`` all, with
``dynamic=False`` none -- plus those marked by ``mark_dynamic``.  A tensor that changed in one size is made
symbolic in all of its sizes (but those marked static)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..errors import SignatureMismatchError
from ..graph.symbols import is_symbolic
from ..guards.words import shape_guard_text

Dynamic = dict[int, frozenset[int]]  # tensor leaf index -> its dimensions whose sizes are symbols

_DYNAMIC, _STATIC = "_dynamo_dynamic_indices", "_dynamo_static_indices"


def mark_dynamic(t: torch.Tensor, index: int | list[int] | tuple[int, ...]) -> None:
    """Make dimension ``index`` of ``t`` symbolic from the first capture that sees it (as
    ``torch._dynamo.mark_dynamic``)."""
    _mark(t, index, _DYNAMIC)


def mark_static(t: torch.Tensor, index: int | list[int] | tuple[int, ...]) -> None:
    """Keep dimension ``index`` of ``t`` static, even under ``dynamic=True`` (as
    ``torch._dynamo.mark_static``)."""
    _mark(t, index, _STATIC)


def _mark(t: torch.Tensor, index: Any, attr: str) -> None:
    indices = list(index) if isinstance(index, (list, tuple)) else [index]
    for i in indices:
        if not -t.dim() <= i < t.dim():
            raise IndexError(f"dimension {i} out of range for a tensor of {t.dim()} dimensions")
    marked = set(getattr(t, attr, ()))
    marked.update(i % t.dim() for i in indices)
    setattr(t, attr, marked)


def marked(t: torch.Tensor) -> tuple[frozenset[int], frozenset[int]]:
    """The dimensions of ``t`` marked dynamic and static."""
    return frozenset(getattr(t, _DYNAMIC, ())), frozenset(getattr(t, _STATIC, ()))


def all_dims(leaves: list[Any]) -> Dynamic:
    """``dynamic=True``: every size of every tensor argument, but those marked static."""
    return {i: frozenset(range(leaf.dim())) - marked(leaf)[1]
            for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.dim()}


def marked_dims(leaves: list[Any]) -> Dynamic:
    """The dimensions marked dynamic (``mark_dynamic``), as the first capture makes them."""
    return {i: marked(leaf)[0] - marked(leaf)[1] for i, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor) and marked(leaf)[0]}


def changed_dims(leaves: list[Any], before: list[tuple[int, tuple[int, ...]]]) -> Dynamic:
    """Automatic dynamic: the sizes in which this call's tensors differ from an earlier call's (``before``:
    (leaf index, shape) of each tensor it had), but those marked static."""
    found: Dynamic = {}
    for i, shape in before:
        leaf = leaves[i]
        changed = frozenset(d for d, (a, b) in enumerate(zip(leaf.shape, shape)) if a != b)
        changed -= marked(leaf)[1]
        if changed:
            found[i] = changed
    return found


def union(*parts: Dynamic) -> Dynamic:
    out: dict[int, frozenset[int]] = {}
    for part in parts:
        for i, dims in part.items():
            out[i] = out.get(i, frozenset()) | dims
    return out


def dynamic_dims(fn: Any, args: tuple, kwargs: dict, dynamic_shapes: Any) -> Dynamic:
    """The symbolic dimensions a ``torch.export``-style spec names, plus the tensors' marks.  The spec
    is a dict by parameter name or a tuple in parameter order; per tensor, a dict ``{dim: Dim}`` or a
    sequence with a ``Dim`` (or ``Dim.DYNAMIC``/``Dim.AUTO``) or None per dimension; nested like the
    argument itself for a list, tuple or dict of tensors."""
    leaves = tree_flatten((args, kwargs))[0]
    found = marked_dims(leaves)
    if dynamic_shapes is None:
        return found
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        bound = inspect.signature(target).bind(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        raise SignatureMismatchError(f"dynamic_shapes: cannot bind the arguments to the function ({exc})"
                                     ) from None
    names = list(bound.arguments)
    if isinstance(dynamic_shapes, (tuple, list)):
        if len(dynamic_shapes) != len(names):
            raise SignatureMismatchError(
                f"dynamic_shapes has {len(dynamic_shapes)} entries for {len(names)} arguments ({names}); "
                "give one per argument (None for an argument with no symbolic size), or a dict by name.")
        specs = dict(zip(names, dynamic_shapes))
    elif isinstance(dynamic_shapes, dict):
        unknown = sorted(set(dynamic_shapes) - set(names))
        if unknown:
            raise SignatureMismatchError(f"dynamic_shapes names {unknown}, which are not arguments of the "
                                         f"call ({names}).")
        specs = dynamic_shapes
    else:
        raise SignatureMismatchError(f"dynamic_shapes must be a dict by argument name or a tuple, not "
                                     f"{type(dynamic_shapes).__name__}.")
    ids = {id(leaf): i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
    for name, spec in specs.items():
        if spec is not None:
            _walk(bound.arguments[name], spec, name, ids, found)
    return found


def _walk(value: Any, spec: Any, where: str, ids: dict[int, int], found: dict[int, frozenset[int]]) -> None:
    if isinstance(value, torch.Tensor):
        if isinstance(spec, dict):
            dims = frozenset(d % value.dim() for d, dim in spec.items() if dim is not None)
        elif isinstance(spec, (tuple, list)):
            dims = frozenset(d for d, dim in enumerate(spec) if dim is not None)
        else:
            raise SignatureMismatchError(f"dynamic_shapes[{where}]: a tensor spec is a dict {{dim: Dim}} or "
                                         f"a sequence per dimension, not {spec!r}.")
        i = ids[id(value)]
        found[i] = found.get(i, frozenset()) | (dims - marked(value)[1])
    elif isinstance(value, dict) and isinstance(spec, dict):
        for k, v in value.items():
            if spec.get(k) is not None:
                _walk(v, spec[k], f"{where}[{k!r}]", ids, found)
    elif isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)) and len(spec) == len(value):
        for k, (v, s) in enumerate(zip(value, spec)):
            if s is not None:
                _walk(v, s, f"{where}[{k}]", ids, found)
    else:
        raise SignatureMismatchError(f"dynamic_shapes[{where}] is {spec!r}, which does not match the "
                                     f"argument (a {type(value).__name__}).")


# -- programs grouped by their signature with sizes erased -------------------------------------------------
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
        # dimensions its caller says are symbolic from the first capture, by tensor leaf (the sizes a
        # Dynamo graph takes symbolically: ``drivers.dynamo_inputs``), as ``mark_dynamic`` marks them
        self.declared: Dynamic = {}
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

    def failed(self, group: tuple, leaves: list[Any]) -> tuple[tuple[Any, tuple[str, ...]], ...]:
        """Per symbolic program of the group, the shape guards that failed on these tensors, with what
        they read now (for ``efx.explain``)."""
        out = []
        for entry in self.groups.get(group, ()):
            checks = entry.forward.signature.checks
            if checks is not None:
                tensors = [leaves[i] for i in entry.tensor_positions]
                out.append((entry, tuple(shape_guard_text(g, tensors) for g in checks.failed(tensors))))
        return tuple(out)

    def dims_for(self, group: tuple, leaves: list[Any]) -> tuple[Dynamic, str]:
        """The sizes the next capture makes symbolic, and why (for ``efx.explain``)."""
        marks = union(marked_dims(leaves), self.declared)
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
            "mark_dynamic" if marked_dims(leaves) else "symbolic in Dynamo's graph" if marks else "")
        return dims, why

    def add(self, group: tuple, entry: Any) -> None:
        self.groups.setdefault(group, []).append(entry)

    def remember(self, key: tuple, entry: Any) -> None:
        self.memo.setdefault(key, []).append(entry)

    def clear(self) -> None:
        self.groups.clear()
        self.memo.clear()
