"""In-place ops as functional nodes: which op records a mutation, and which tensors it writes
(Note [Mutations]).

The tracer records every in-place op as a functional op whose results are the new values of what it
wrote; the written tensors are then rebound to those results.  Three shapes of op:

* ``add_`` and the like -- the *twin* ``add`` returns the new value of its first argument;
* ops that write several arguments (``_batch_norm_with_update``) -- torch's ``*_functional`` variant
  returns the op's own results followed by the new value of each written argument;
* ``native_batch_norm`` in training, whose schema does not say that it updates ``running_mean`` and
  ``running_var`` (eager updates them all the same) -- ``_native_batch_norm_legit_functional``, same
  arguments, results then the two new statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class Mutation:
    """How one in-place call is recorded: ``target`` is called with the op's arguments; ``written`` names
    each written argument and its tensor; ``appended`` says whether ``target`` returns the op's results
    followed by the new values (``*_functional``) rather than the new value of ``written[0]`` (a twin).
    ``target`` is None when no functional form exists."""

    target: Any
    written: tuple[tuple[str, torch.Tensor], ...]
    appended: bool


def _annotated(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            written.append((arg.name, value))
    return written


def _overload(packet_name: str, overload: str) -> torch._ops.OpOverload | None:
    packet = getattr(aten, packet_name, None)
    return getattr(packet, overload, None) if packet is not None else None


def mutation_of(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Mutation | None:
    """The mutation ``func(*args, **kwargs)`` performs, or None for a call that writes nothing."""
    if func is aten.native_batch_norm.default:
        running = [(n, args[i] if i < len(args) else kwargs.get(n)) for i, n in ((3, "running_mean"),
                                                                                  (4, "running_var"))]
        training = args[5] if len(args) > 5 else kwargs.get("training")
        if not training or any(t is None for _, t in running):
            return None
        return Mutation(aten._native_batch_norm_legit_functional.default, tuple(running), True)
    if not func._schema.is_mutable:
        return None
    written = _annotated(func, args, kwargs)
    if not written:
        return None
    if func.namespace != "aten":
        return Mutation(None, tuple(written), False)
    name, overload = func._schema.name.split("::")[1], func._overloadname
    first = func._schema.arguments[0].name
    if len(written) == 1 and written[0][0] == first and name.endswith("_") and not name.startswith("_"):
        twin = _overload(name[:-1], overload)
        if twin is not None:
            return Mutation(twin, tuple(written), False)
    functional = _overload(name + "_functional", overload)
    if functional is not None:
        return Mutation(functional, tuple(written), True)
    return Mutation(None, tuple(written), False)
