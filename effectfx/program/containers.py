"""Containers an argument holds, written back (Note [Mutations]): lists, dicts and objects that hold tensors.

Captured code sees the tensors inside an argument's containers as graph inputs -- pytree flattens them --
and may change a container (``cache.update(k, v)`` rebinds ``cache.layers[i].keys`` to a longer tensor,
``xs.append(t)``).  The graph then also returns each changed top-level argument's new state (its tensors are
graph outputs, the rest is its spec); after a run the caller's own containers are updated in place to that
state (:func:`write_into`), as eager's code left them, at a region's call site during capture and for the
root at every run.  Objects that hold tensors are containers when pytree knows their class: transformers'
``Cache`` classes are registered (with transformers' own registration for torch.export) the first time a
capture runs with transformers imported; any other class the user registers with
``torch.utils._pytree.register_pytree_node``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten, tree_unflatten

from ..guards.check import set_at

Position = tuple[str, Any]  # ("arg", index) or ("kwarg", name): a top-level argument of a call

_REGISTERED: set[type] = set()


def register_tensor_holders() -> None:
    """Make transformers' cache classes pytree nodes, as transformers does for torch.export (once per class;
    nothing when transformers is not imported)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    if cache is None:
        return
    pending, stack = [], [cache]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls not in _REGISTERED and cls not in SUPPORTED_NODES:
            pending.append(cls)
        _REGISTERED.add(cls)
    if pending:
        from transformers.exporters.exporter_dynamo import register_pytree_node

        for cls in pending:
            register_pytree_node(cls)


def positions(args: tuple, kwargs: dict) -> list[Position]:
    return [("arg", i) for i in range(len(args))] + [("kwarg", k) for k in kwargs]


def value_at(args: tuple, kwargs: dict, where: Position) -> Any:
    return args[where[1]] if where[0] == "arg" else kwargs[where[1]]


def snapshot(args: tuple, kwargs: dict) -> dict[Position, tuple[list[Any], Any]]:
    """Each top-level argument's leaves and structure, to see afterwards which the code changed."""
    return {p: tree_flatten(value_at(args, kwargs, p)) for p in positions(args, kwargs)}


def changed(before: dict[Position, tuple[list[Any], Any]], args: tuple, kwargs: dict) -> tuple[Position, ...]:
    """The top-level arguments whose containers the code changed (a leaf rebound, the structure changed)."""
    out = []
    for p, (leaves, spec) in before.items():
        after, after_spec = tree_flatten(value_at(args, kwargs, p))
        if after_spec != spec or len(after) != len(leaves) or any(a is not b for a, b in zip(after, leaves)):
            out.append(p)
    return tuple(out)


def write_into(old: Any, new: Any) -> Any:
    """Make ``old`` hold what ``new`` holds, in place where ``old`` is mutable; returns what the caller's
    value now is (``old``, or ``new`` where nothing could be updated: a tensor, a number)."""
    if old is new or _alias(old, new):
        return old
    if isinstance(old, list) and isinstance(new, list):
        common = [write_into(a, b) for a, b in zip(old, new)]
        old[:] = common + list(new[len(common):])
        return old
    if isinstance(old, dict) and isinstance(new, dict):
        for k in [k for k in old if k not in new]:
            del old[k]
        for k, v in new.items():
            old[k] = write_into(old[k], v) if k in old else v
        return old
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        for a, b in zip(old, new):
            write_into(a, b)
        return old
    if type(old) is type(new) and hasattr(old, "__dict__") and type(old) in SUPPORTED_NODES:
        # an object pytree rebuilt: the caller's object (and the objects it holds) takes its state
        mine = old.__dict__
        for k, v in new.__dict__.items():
            mine[k] = write_into(mine[k], v) if k in mine else v
        return old
    return new


def _alias(old: Any, new: Any) -> bool:
    """``new`` is ``old`` handed back through autograd (a training program's outputs are new tensor
    objects): the caller keeps its own tensor, as eager's code left it."""
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.device.type != "meta"
            and not isinstance(old, FakeTensor)):
        return False
    try:
        same_memory = old.data_ptr() == new.data_ptr()
    except RuntimeError:  # a tensor without storage of its own (a torch.func wrapper): not an alias we know
        return False
    return same_memory and old.shape == new.shape and old.stride() == new.stride() and old.dtype == new.dtype


def view_outputs(outputs: list[Any], values: list[Any], n_mutations: int) -> tuple[tuple[int, int], ...]:
    """``(k, j)``: the user's output ``k`` shares memory with the new value of updated input ``j``: eager
    returns a view of the input (``x.add_(1); return x[:2]``).  ``outputs``: the graph's output nodes, the
    user's then the new values (Note [Mutations]); ``values``: what a run returned for them.  Read from the
    capture's fake values; a loaded program's values are meta tensors made one by one, which know nothing
    of aliasing, so there the memory of this run's values decides (the same code runs every time)."""
    n_user = len(outputs) - n_mutations
    vals = [getattr(node, "meta", {}).get("val") for node in outputs]
    fakes = all(isinstance(v, FakeTensor) for v, x in zip(vals, values) if isinstance(x, torch.Tensor))

    def memory(i: int) -> Any:
        if fakes:
            return StorageWeakRef(vals[i].untyped_storage()) if isinstance(vals[i], FakeTensor) else None
        return values[i].untyped_storage().data_ptr() if isinstance(values[i], torch.Tensor) else None

    by_memory: dict[Any, list[int]] = {}
    for j in range(n_mutations):
        by_memory.setdefault(memory(n_user + j), []).append(j)
    by_memory.pop(None, None)
    new_nodes = {id(node) for node in outputs[n_user:]}
    pairs = []
    for k in range(n_user):
        if id(outputs[k]) not in new_nodes:  # (the new value itself is the caller's tensor already)
            pairs += [(k, j) for j in by_memory.get(memory(k), [])]
    return tuple(pairs)


def returned_inputs(graph: fx.Graph, n_tokens: int, n_user: int, mutations: tuple[int, ...]
                    ) -> tuple[tuple[int, int], ...]:
    """``(k, i)``: the user's output ``k`` is input ``i`` (of ``run_flat``'s list) as it came, neither
    computed nor written.  Eager returns the caller's tensor itself (``return x``): ``out is x``, and with a
    leaf that requires grad ``out.grad`` is its gradient (a training program's autograd.Function would hand
    back a new tensor instead)."""
    placeholders = {node: i - n_tokens for i, node in enumerate(graph.find_nodes(op="placeholder"))}
    outputs = list(next(reversed(graph.nodes)).args[0])[n_tokens:n_tokens + n_user]
    return tuple((k, placeholders[node]) for k, node in enumerate(outputs)
                 if node in placeholders and placeholders[node] >= 0 and placeholders[node] not in mutations)


def onto_caller(out: Any, target: torch.Tensor, new: torch.Tensor) -> Any:
    """``out``, a view of updated input's new value ``new``, as the same view of the caller's ``target``
    (eager returns one: a later in-place update of the output reaches the input).  Where the run's code
    did not return a view of ``new`` (it copied), the two lay their elements out differently, or the view
    reads them as another dtype, ``out`` stays the run's own tensor (docs/SUPPORT.md)."""
    if (not isinstance(out, torch.Tensor) or target is new or out.dtype != new.dtype
            or target.shape != new.shape or target.stride() != new.stride()
            or out.untyped_storage().data_ptr() != new.untyped_storage().data_ptr() or not _within(out, new)):
        return out
    offset = out.storage_offset() - new.storage_offset() + target.storage_offset()
    view = target.as_strided(out.shape, out.stride(), offset)
    # a view eager detached (``x.detach()`` of the updated input) shares its memory, not its gradient
    return view.detach() if view.requires_grad and not out.requires_grad else view


def _within(out: torch.Tensor, new: torch.Tensor) -> bool:
    """Every element of ``out`` is an element of ``new`` (contiguous: its memory is one span)."""
    if not new.is_contiguous() or out.numel() == 0:
        return False
    last = out.storage_offset() + sum((n - 1) * st for n, st in zip(out.shape, out.stride()))
    return new.storage_offset() <= out.storage_offset() and last < new.storage_offset() + new.numel()


def is_object_node(value: Any) -> bool:
    """An object of a class registered by :func:`register_tensor_holders` (a transformers cache)."""
    return holder_class(type(value)) and hasattr(value, "__dict__")  # (type() first: a label records reads)


def holder_class(cls: Any) -> bool:
    return cls in SUPPORTED_NODES and cls in _REGISTERED


def same_objects(result: Any, written: list[Any]) -> Any:
    """``result`` with each object that holds exactly the tensors of one the caller's containers were
    written into replaced by the caller's own: the code returned the cache it was given, and eager's caller
    gets that very object back (``outputs.past_key_values is cache``)."""
    mine = [(w, tree_flatten(w)[0]) for w in written if is_object_node(w)]
    if not mine:
        return result
    leaves, spec = tree_flatten(result, is_leaf=is_object_node)
    for k, leaf in enumerate(leaves):
        if is_object_node(leaf):
            held = tree_flatten(leaf)[0]
            for obj, tensors in mine:
                if type(obj) is type(leaf) and len(held) == len(tensors) and all(
                        a is b for a, b in zip(held, tensors)):
                    leaves[k] = obj
                    break
    return tree_unflatten(leaves, spec)


def write_state(targets: tuple, values: list[Any]) -> None:
    """After a run of a compiled training step: every ``.grad`` and optimizer state entry the step set
    (Note [Training step]).  ``targets``: ``(path, is None)`` with ``path`` a guard's path --
    ``(("id", Ref(obj)), *steps)``, steps an attribute, ``("item", key)`` or ``("key", Ref(obj))`` --
    whose last step is set; ``values`` the new tensors in order."""
    found = iter(values)
    for path, to_none in targets:
        set_at(path, None if to_none else next(found))


def map_structure(fn: Any, value: Any) -> Any:
    """``fn`` over the leaves of nested tuples/lists/dicts: aten arguments, without pytree's overhead."""
    if isinstance(value, (tuple, list)):
        return type(value)(map_structure(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: map_structure(fn, v) for k, v in value.items()}
    return fn(value)
