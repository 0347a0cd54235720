"""What a run hands back of its arguments' objects (Note [Mutations]): the caller's own object where the code
returned the argument it was given (``outputs.past_key_values is cache``, as in eager), and an argument's new
state written into the caller's object leaf by leaf, without building a new object, where its structure is
the one the call came with (a ``DynamicCache`` whose layers' tensors grew).  Both are decided once per
program (:func:`unflatten_plan`); rebuilding the objects (transformers' pytree unflatten) cost more per
call than the rest of a decode step's glue.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten, treespec_leaf

from ..graph.traced import OutputKind
from .containers import Position, _alias, holder_class, is_object_node, positions, value_at, write_into


def returned_objects(out: Any, args: tuple, kwargs: dict) -> tuple[tuple[Position, int, int, type], ...]:
    """Where the code's result holds an argument's object itself (the cache it was given, returned):
    ``(position, first leaf, number of leaves, class)`` in the result's flattened order.  Eager's caller gets
    that very object back, so a run returns the caller's, which holds the same state by then (written
    back), instead of rebuilding one."""
    objects = {id(v): p for p in positions(args, kwargs) if is_object_node(v := value_at(args, kwargs, p))}
    if not objects:
        return ()
    found, start = [], 0
    for leaf in tree_flatten(out, is_leaf=lambda x: id(x) in objects)[0]:
        n = len(tree_flatten(leaf)[0]) if id(leaf) in objects else 1
        if id(leaf) in objects:
            found.append((objects[id(leaf)], start, n, type(leaf)))
        start += n
    return tuple(found)


class NewState:
    """A written argument's new state as its leaves (``StateSlot``), not built into an object."""

    __slots__ = ("slot", "leaves")

    def __init__(self, slot: StateSlot, leaves: list[Any]) -> None:
        self.slot, self.leaves = slot, leaves


class StateSlot:
    """A written argument's new state in a result, whose structure (spec) is the one the call came with:
    written into the caller's object where each of its leaves lives (found once, ``_leaf_paths``)."""

    def __init__(self, spec: TreeSpec, layout: tuple) -> None:
        self.spec, self.layout = spec, layout
        self.paths: list | None = None  # per leaf: (holder's steps, last step); [] where the walk failed

    def value(self, tensor_outs: list[Any]) -> NewState:
        return NewState(self, [tensor_outs[v] if kind is OutputKind.TENSOR else v for kind, v in self.layout])

    def write(self, old: Any, leaves: list[Any]) -> Any:
        if self.paths is None:
            self.paths = _leaf_paths(old)
        if not self.paths:
            return write_into(old, tree_unflatten(leaves, self.spec))
        for (steps, last), new in zip(self.paths, leaves):
            holder = old
            for kind, key in steps:
                holder = holder.__dict__[key] if kind else holder[key]
            table = holder.__dict__ if last[0] else holder
            current = table[last[1]]
            if new is not current and not _alias(current, new):  # (write_into keeps an alias too)
                table[last[1]] = new
        return old


def write_new(old: Any, new: Any) -> Any:
    """``write_into``, for a new state given as its leaves too."""
    return new.slot.write(old, new.leaves) if type(new) is NewState else write_into(old, new)


def _leaf_paths(obj: Any) -> list:
    """Where each of ``obj``'s pytree leaves lives -- ``(steps to its holder, last step)``, a step ``(True,
    attribute)`` or ``(False, list index or dict key)`` -- found by walking its attributes, lists and dicts
    as transformers' flattener does; [] unless the walk finds exactly its leaves, in order.  The same spec is
    the same structure: the paths hold for every object the program is called with."""
    found: list = []
    seen: set[int] = set()

    def walk(value: Any, steps: tuple) -> bool:
        if isinstance(value, torch.Tensor):
            found.append((steps[:-1], steps[-1]))
            return True
        if value is None or type(value) in (bool, int, float, str, torch.device, torch.dtype, torch.Size,
                                            torch.layout):
            return True
        if id(value) in seen:
            return False
        seen.add(id(value))
        if type(value) is list:
            return all(walk(v, (*steps, (False, i))) for i, v in enumerate(value))
        if type(value) is dict:
            return all(walk(v, (*steps, (False, k))) for k, v in value.items())
        if isinstance(value, (tuple, list, dict, set, frozenset, type)) or not hasattr(value, "__dict__"):
            return False  # (a tuple cannot be written into; the rest is not worth the cases)
        return all(walk(v, (*steps, (True, k))) for k, v in vars(value).items())

    if not walk(obj, ()) or not found:
        return []
    leaves = tree_flatten(obj)[0]
    holders = [_at(obj, steps, last) for steps, last in found]
    return found if len(leaves) == len(holders) and all(a is b for a, b in zip(leaves, holders)) else []


def _at(obj: Any, steps: tuple, last: tuple) -> Any:
    for kind, key in (*steps, last):
        obj = obj.__dict__[key] if kind else obj[key]
    return obj


def _arg_spec(spec: TreeSpec, where: Position) -> TreeSpec | None:
    """The spec of a top-level argument within ``(args, kwargs)``'s."""
    if where[0] == "arg":
        return spec.child(0).child(where[1])
    keys = spec.child(1).context
    return spec.child(1).child(keys.index(where[1])) if where[1] in keys else None


def unflatten_plan(spec: TreeSpec, layout: tuple, returned: tuple, written: tuple = (),
                   in_spec: TreeSpec | None = None, nesting: int = 0) -> tuple[TreeSpec, tuple, frozenset]:
    """``(spec, layout, positions)`` to build a result: the subtrees ``returned`` (:func:`returned_objects`)
    are leaves, ``layout`` holding ``(None, position)`` there (the caller's argument); a written argument's
    new state (``written``: the positions, the states following the user's result ``nesting`` tuples
    deep, Note [Mutations]) whose spec is the argument's in ``in_spec`` is a leaf with ``(StateSlot,
    None)``.  ``positions``: the arguments returned as the caller's."""
    spans: dict[int, tuple] = {}  # first leaf -> (leaves, class, layout entry)
    for p, start, n, cls in returned:
        if n == 0 or start in spans:  # (where in the spec would an empty one be?)
            return spec, layout, frozenset()
        spans[start] = (n, cls, (None, p))
    inner = spec
    for _ in range(nesting):
        inner = inner.child(0)
    if written and in_spec is not None:
        offset = inner.child(0).num_leaves
        for where, new in zip(written, inner.child(1).children()):
            if holder_class(new.type) and new.num_leaves and new == _arg_spec(in_spec, where):
                sub = layout[offset:offset + new.num_leaves]
                spans.setdefault(offset, (new.num_leaves, new.type, (StateSlot(new, sub), None)))
            offset += new.num_leaves
    if not spans:
        return spec, layout, frozenset()
    replaced: list[int] = []

    def reduce(node: TreeSpec, offset: int) -> TreeSpec:
        hit = spans.get(offset)
        if hit is not None and node.type is hit[1] and node.num_leaves == hit[0] and offset not in replaced:
            replaced.append(offset)
            return treespec_leaf()
        if node.is_leaf():
            return node
        children = []
        for child in node.children():
            children.append(reduce(child, offset))
            offset += child.num_leaves
        return TreeSpec(node.type, node.context, children)

    reduced = reduce(spec, 0)
    if len(replaced) != len(spans):
        return spec, layout, frozenset()
    kept: list = []
    k = 0
    for start in sorted(spans):
        kept.extend(layout[k:start])
        kept.append(spans[start][2])
        k = start + spans[start][0]
    kept.extend(layout[k:])
    return reduced, tuple(kept), frozenset(p for p, _, _, _ in returned)
