"""The arguments of a traced call -- the root function's, a region's, a control-flow function's: their
leaves and structure, a name per leaf, and the refusal of a Python container the call changed."""

from __future__ import annotations

import inspect
from typing import Any

from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_is_leaf

from ..errors import UnsupportedMutationError
from ..graph.source import definition


def map_structure(fn: Any, value: Any) -> Any:
    """``fn`` over the leaves of nested tuples/lists/dicts: aten arguments, without pytree's overhead."""
    if isinstance(value, (tuple, list)):
        return type(value)(map_structure(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: map_structure(fn, v) for k, v in value.items()}
    return fn(value)


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


def check_containers_unchanged(where: str, fn: Any, names: list[str], spec: Any, leaves: list[Any],
                               args: tuple, kwargs: dict) -> None:
    """A trace runs on copies of the caller's lists and dicts: one that the code changed (``z.append``)
    would leave the caller's unchanged, so it is refused rather than silently lost."""
    after, after_spec = tree_flatten((args, kwargs))
    if after_spec == spec and len(after) == len(leaves) and all(a is b for a, b in zip(after, leaves)):
        return
    changed = next((names[i] for i, (a, b) in enumerate(zip(after, leaves)) if a is not b), None)
    what = f"argument {changed!r}" if changed and after_spec == spec else "a list or dict argument"
    raise UnsupportedMutationError(
        f"{where} (defined at {definition(fn)}) changes {what} in place (append, item assignment...).\n"
        "effectfx cannot write Python containers back to the caller, so the change would be lost. Return "
        "the new values instead and update the container outside the captured code."
    )
