"""In-place ops as functional nodes: which op records a mutation, and which tensors it writes
(Note [Mutations]).

The tracer records every in-place op as a functional op whose results are the new values of what it
wrote; the written tensors are then rebound to those results.  Four shapes of op:

* ``add_`` and the like -- the *twin* ``add`` returns the new value of its first argument (``_foreach_add_``:
  ``_foreach_add`` returns the new value of each tensor of its first argument, a list);
* ops that write several arguments (``_batch_norm_with_update``) -- torch's ``*_functional`` variant
  returns the op's own results followed by the new value of each written argument;
* ``native_batch_norm`` in training, whose schema does not say that it updates ``running_mean`` and
  ``running_var`` (eager updates them all the same) -- ``_native_batch_norm_legit_functional``, same
  arguments, results then the two new statistics;
* custom ops with ``Tensor(a!)`` arguments (``torch.library.custom_op(..., mutates_args=...)``) --
  torch's ``auto_functionalized(op, **arguments by name)``, as torch.compile and torch.export record them:
  it runs the op on clones of what it writes and returns the op's results, then those clones.

An op with no functional form (``bernoulli_``) stays in place when it writes one fresh tensor nothing else
aliases and returns it; anything else is refused (:func:`functional_target`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized, can_auto_functionalize
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import UnsupportedMutationError
from ..graph.source import user_location

aten = torch.ops.aten
AUTO_FUNCTIONALIZED = auto_functionalized


@dataclass(frozen=True)
class Mutation:
    """How one in-place call is recorded: ``target`` is called with the op's arguments; ``written`` names
    each written argument and its tensor (one entry per tensor of a written list); ``paths`` says where
    each one's new value is in ``target``'s result (``()``: the result itself, ``(i,)``: its element ``i``,
    ``(i, j)``: element ``j`` of element ``i``); ``appended`` says whether the op's own results come first
    (``*_functional``, ``auto_functionalized``).  ``target`` is None when no functional form exists (the op
    then stays in place and must return what it wrote: path ``()``).  ``overlap`` names a written argument
    and another argument of the call sharing its memory (custom ops: their functional form would read the
    other one unwritten, where the op's kernel may see its own writes through it)."""

    target: Any
    written: tuple[tuple[str, torch.Tensor], ...]
    appended: bool
    paths: tuple[tuple[int, ...], ...] = ()
    overlap: tuple[str, str] | None = None


# (argument name, tensor, its position among the written arguments, its index in a written list or None)
_Written = tuple[str, torch.Tensor, int, "int | None"]


def _annotated(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[_Written]:
    written: list[_Written] = []
    k = 0
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            written.append((arg.name, value, k, None))
        elif isinstance(value, (list, tuple)):  # Tensor(a!)[]: every tensor of the list is written
            written.extend((arg.name, t, k, j) for j, t in enumerate(value) if isinstance(t, torch.Tensor))
        k += 1
    return written


def _overlap(func: torch._ops.OpOverload, args: tuple, kwargs: dict,
             written: list[_Written]) -> tuple[str, str] | None:
    tensors = []
    for name, value in by_name(func, args, kwargs).items():
        if isinstance(value, (list, tuple)):
            tensors += [(name, i, t) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
        elif isinstance(value, torch.Tensor):
            tensors.append((name, None, value))
    for name, tensor, _, j in written:
        storage = StorageWeakRef(tensor.untyped_storage())
        for other, i, value in tensors:
            if (other, i) != (name, j) and StorageWeakRef(value.untyped_storage()) == storage:
                return _label(name, j), _label(other, i)
    return None


def _label(name: str, index: int | None) -> str:
    return name if index is None else f"{name}[{index}]"


def by_name(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``func``'s arguments by schema name, what ``auto_functionalized`` takes: it looks up every argument
    the op may write, so those are there even when left to their default."""
    named = dict(kwargs)
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            named[arg.name] = args[i]
        elif arg.name not in named and arg.alias_info is not None and arg.alias_info.is_write:
            named[arg.name] = arg.default_value if arg.has_default_value() else None
    return named


def returns_written(func: torch._ops.OpOverload, name: str) -> bool:
    """Whether ``func`` writes its first argument ``name`` and returns it (``bernoulli_``): the in-place op
    can then stay, its result the tensor's new value; an op returning nothing leaves no value to rebind."""
    schema = func._schema
    first, returns = schema.arguments[0], schema.returns
    return (first.name == name and isinstance(first.type, torch.TensorType) and first.alias_info is not None
            and len(returns) >= 1
            and returns[0].alias_info is not None and returns[0].alias_info.is_write
            and set(returns[0].alias_info.before_set) == set(first.alias_info.before_set))


def _overload(packet_name: str, overload: str) -> torch._ops.OpOverload | None:
    packet = getattr(aten, packet_name, None)
    return getattr(packet, overload, None) if packet is not None else None


def _make(target: Any, written: list[_Written], appended: bool, paths: list[tuple[int, ...]],
          overlap: tuple[str, str] | None = None) -> Mutation:
    return Mutation(target, tuple((n, t) for n, t, _, _ in written), appended, tuple(paths), overlap)


def mutation_of(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Mutation | None:
    """The mutation ``func(*args, **kwargs)`` performs, or None for a call that writes nothing."""
    if func is aten.native_batch_norm.default:
        running = [(n, args[i] if i < len(args) else kwargs.get(n)) for i, n in ((3, "running_mean"),
                                                                                  (4, "running_var"))]
        training = args[5] if len(args) > 5 else kwargs.get("training")
        if not training or any(t is None for _, t in running):
            return None
        return Mutation(aten._native_batch_norm_legit_functional.default, tuple(running), True, ((3,), (4,)))
    if not func._schema.is_mutable:
        return None
    written = _annotated(func, args, kwargs)
    if not written:
        return None
    in_place = [()] * len(written)  # the tracer accepts one written tensor the op returns, no more
    if func.namespace != "aten":
        if can_auto_functionalize(func):
            # auto_functionalized returns the op's result (or its tuple's items), then every argument the
            # schema says it writes, in order (a list as a list)
            n = max(1, len(func._schema.returns))
            paths = [(n + k,) if j is None else (n + k, j) for _, _, k, j in written]
            return _make(auto_functionalized, written, True, paths, _overlap(func, args, kwargs, written))
        return _make(None, written, False, in_place)
    name, overload = func._schema.name.split("::")[1], func._overloadname
    first = func._schema.arguments[0].name
    if (all(w[0] == first for w in written) and name.endswith("_")
            and (not name.startswith("_") or name.startswith("_foreach_"))):
        twin = _overload(name[:-1], overload)  # add_ -> add; _foreach_add_ -> _foreach_add (a list)
        if twin is not None:
            # a list written twice over ([a, a]) adds twice in place, once functionally
            overlap = _overlap(func, args, kwargs, written) if written[0][3] is not None else None
            return _make(twin, written, False, [() if j is None else (j,) for _, _, _, j in written], overlap)
    functional = _overload(name + "_functional", overload)
    if functional is not None and all(j is None for _, _, _, j in written):
        n = len(func._schema.returns)
        return _make(functional, written, True, [(n + k,) for _, _, k, _ in written])
    return _make(None, written, False, in_place)


def functional_target(tracer: Any, func: Any, mutation: Mutation, key: str | None) -> Any:
    """The op to record for an in-place call (Note [Mutations]), or an UnsupportedMutationError."""
    for name, tensor in mutation.written:
        node = tracer.builder.values.get(id(tensor))
        root = tracer.base_of.get(id(tensor), tensor)
        root_node = tracer.builder.values.get(id(root))
        aliased = root is not tensor or bool(tracer.views_of.get(id(tensor)))
        an_input = any(n is not None and n.op == "placeholder" for n in (node, root_node))
        problem = None
        if key is not None:
            problem = "an effectful op that mutates its arguments"
        elif mutation.target is None and an_input:
            ph = next(n for n in (node, root_node) if n is not None and n.op == "placeholder")
            problem = (f"an in-place op ({func}) with no functional form on "
                       f"{tracer.builder.describe_input(ph)} (its argument {name!r})")
        elif mutation.target is None and id(root) in tracer.literals:
            problem = (f"an in-place op ({func}) with no functional form on a torch.tensor(...) literal "
                       f"(its argument {name!r}), which would change the literal for the next call")
        elif aliased and mutation.target is None:  # no functional form to write the aliases with
            problem = (f"an in-place op ({func}) with no functional form on a tensor that "
                       f"{'is a view of another' if root is not tensor else 'has views'} (its argument "
                       f"{name!r})")
        elif tensor._is_view() and root is tensor:
            problem = f"an in-place op ({func}) on a view whose base effectfx never saw"
        elif mutation.overlap is not None:
            problem = (f"an op ({func}) that writes into its argument {mutation.overlap[0]!r} while its "
                       f"argument {mutation.overlap[1]!r} shares that memory")
        elif mutation.target is None and (len(mutation.written) != 1 or not returns_written(func, name)):
            problem = f"an op ({func}) that writes into its argument {name!r}"
        if problem:
            raise UnsupportedMutationError(
                f"{tracer.where()} contains {problem} at {user_location()}.\n"
                "effectfx records in-place ops as functional ones (inputs and buffers are written back "
                "after the call). Use the out-of-place op (e.g. x = x + y instead of x.add_(y)), or "
                "clone() the tensor first."
            )
    # no functional form (bernoulli_ in dropout, say): the in-place op stays, on a fresh intermediate
    # nothing else aliases, so running it in graph order is indistinguishable from a functional op
    return mutation.target or func
