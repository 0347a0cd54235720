"""The arguments of a traced call -- the root function's, a region's, a control-flow function's: their
leaves and structure, a name per leaf, and the refusal of a Python container the call changed."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_is_leaf

from ..errors import UnsupportedMutationError
from ..graph.source import definition
from ..program.containers import changed, snapshot, value_at
from ..program.returned import returned_objects

# what a graph returns besides tensors
PLAIN_LEAVES = (int, float, bool, str, complex, torch.dtype, torch.device, type(None))


_FLAT_SPECS: dict[int, Any] = {}


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """``tree_flatten((args, kwargs))``, without pytree's walk for the usual call site: positional
    arguments that are all leaves (a module, tensors)."""
    if kwargs or not all(tree_is_leaf(a) for a in args):
        return tree_flatten((args, kwargs))
    spec = _FLAT_SPECS.get(len(args))
    if spec is None:  # the spec of n leaves: pytree's own, made once
        spec = _FLAT_SPECS[len(args)] = tree_flatten((tuple(range(len(args))), {}))[1]
    return list(args), spec


def leaf_names(fn: Any, args: tuple, kwargs: dict, nested: str = "{base}_{rest}") -> list[str]:
    """A name per leaf of ``(args, kwargs)`` from ``fn``'s parameters: ``x``, ``args_0``, ``cfg_1``."""
    try:
        positional = [
            p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        positional = []
    names = []
    for path, _ in tree_flatten_with_path((args, kwargs))[0]:
        head = path[1]
        if path[0].idx == 0:
            base = positional[head.idx] if head.idx < len(positional) else f"arg{head.idx}"
        else:
            base = str(head.key)
        rest = "_".join(str(getattr(p, "idx", getattr(p, "key", ""))) for p in path[2:])
        names.append(nested.format(base=base, rest=rest) if rest else base)
    return names


def check_containers_unchanged(where: str, fn: Any, before: dict, args: tuple, kwargs: dict,
                               written: tuple = ()) -> None:
    """A trace runs on copies of the caller's containers: one the code changed is written back when its
    new state is tensors and plain values (``written``: Note [Mutations], ``program.containers``); any
    other change (a module put into a list) would leave the caller's unchanged, so it is refused rather
    than silently lost.  ``before``: ``containers.snapshot`` of the arguments."""
    lost = [p for p in changed(before, args, kwargs) if p not in written]
    if not lost:
        return
    kind, name = lost[0]
    what = f"argument {name!r}" if kind == "kwarg" else f"argument {name}"
    raise UnsupportedMutationError(
        f"{where} (defined at {definition(fn)}) changes {what} in place (append, item assignment...) to "
        "hold something other than tensors and plain values.\neffectfx writes back containers of tensors "
        "only, so the change would be lost. Return the new values instead and update the container outside "
        "the captured code."
    )


def written_state(before: dict, args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """The changed top-level arguments that can be written back (containers of tensors and plain values),
    and their new values: what a traced graph returns after its own outputs (Note [Mutations])."""
    def writable(p: Any) -> bool:
        leaves = tree_flatten(value_at(args, kwargs, p))[0]
        return all(isinstance(leaf, (torch.Tensor, *PLAIN_LEAVES)) for leaf in leaves)

    moved = tuple(p for p in changed(before, args, kwargs) if writable(p))
    return moved, tuple(value_at(args, kwargs, p) for p in moved)


class WrittenState:
    """What :func:`with_written_state`'s run found: the arguments before, and those it writes back."""

    def __init__(self, before: dict) -> None:
        self.before = before
        self.positions: tuple = ()
        self.returned: tuple = ()  # argument objects the result holds itself (containers.returned_objects)


def with_written_state(fn: Any, args: tuple, kwargs: dict) -> tuple[Any, WrittenState]:
    """``fn(*args, **kwargs)`` to trace, returning ``(out, new states)`` when the code changed containers of
    its arguments that can be written back (Note [Mutations]); ``WrittenState.positions`` says which."""
    state = WrittenState(snapshot(args, kwargs))

    def run() -> Any:
        out = fn(*args, **kwargs)
        state.positions, values = written_state(state.before, args, kwargs)
        state.returned = returned_objects(out, args, kwargs)
        return (out, values) if state.positions else out

    return run, state
