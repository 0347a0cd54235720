"""Collectives as ordered effects, one effect key per process group (``"c10d:<group name>"``).

``dist.all_reduce(y)`` reaches the tracer as ``c10d::allreduce_([y], <ProcessGroup>, <ReduceOp>, ...)``:
an op that writes ``y`` in place and returns a ``Work`` handle.  A functional collective
(``torch.distributed._functional_collectives``) reaches it as ``_c10d_functional::all_reduce(y, "sum",
"<group name>")`` followed by ``wait_tensor``.  Both are recorded as one node of a *per-group* op,
``effectfx_c10d::<collective>_group<name>(group, input, ...) -> new value`` (registered on key
``"c10d:<name>"``): the effect registry is keyed by op, and collectives on different groups are unordered
with respect to each other, so each group gets its own op and its own token chain.  The process group is
the op's first argument -- a program constant read through ``get_attr`` (``_torchbind_obj0``), never code.

An in-place collective is functional in the graph (Note [Mutations]): the written tensor is rebound to the
node's result, so later reads see the reduced value and an argument or buffer is written back to the
caller.  The recorded op runs the functional collective and waits for it, so a program issues each
collective where eager issued it, in eager's order, on every rank.  Waiting is part of that call, so the
``Work`` a c10d op returns is already complete and ``wait_tensor`` records nothing.

``DistributedDataParallel`` and FSDP2 (``fully_shard``) are refused (:func:`refuse_parallel_wrappers`):
their logic lives in autograd hooks and module state that a captured program does not run again.
"""

from __future__ import annotations

import hashlib
import re
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..effects import register_effect
from ..errors import UnsupportedOperatorError, UnsupportedParallelWrapperError
from ..graph.source import user_location
from ..graph.traced import TensorMeta

aten = torch.ops.aten
_PG_TYPE = "__torch__.torch.classes.c10d.ProcessGroup"
_C10D = torch._C._distributed_c10d if dist.is_available() else None

# collective -> its arguments after the group, and its result
_SCHEMAS: dict[str, tuple[str, str]] = {
    "all_reduce": (", Tensor input, str reduce_op", "Tensor"),
    "all_gather_into_tensor": (", Tensor input, int group_size", "Tensor"),
    "reduce_scatter_tensor": (", Tensor input, str reduce_op, int group_size", "Tensor"),
    "broadcast": (", Tensor input, int src", "Tensor"),
    "all_to_all_single": (", Tensor input, int[] output_split_sizes, int[] input_split_sizes", "Tensor"),
    "barrier": ("", "()"),
}


def _fake(kind: str, group: Any, x: Any = None, *rest: Any) -> Any:
    if kind == "barrier":
        return None
    if kind == "all_gather_into_tensor":
        return x.new_empty((x.shape[0] * rest[0], *x.shape[1:]))
    if kind == "reduce_scatter_tensor":
        return x.new_empty((x.shape[0] // rest[1], *x.shape[1:]))
    if kind == "all_to_all_single" and rest[0]:
        return x.new_empty((sum(rest[0]), *x.shape[1:]))
    return torch.empty_like(x)


def _run(kind: str, group: Any, *args: Any) -> Any:
    """The recorded op at run time: the functional collective on the group, waited for."""
    pg = _C10D.ProcessGroup.unbox(group)
    if kind == "barrier":
        pg.barrier().wait()
        return None
    out = getattr(torch.ops._c10d_functional, kind)(*args, pg.group_name)
    return torch.ops._c10d_functional.wait_tensor(out)


_LIB = torch.library.Library("effectfx_c10d", "FRAGMENT")
_OPS: dict[tuple[str, str], Any] = {}


def group_op(kind: str, group_name: str) -> Any:
    """The op recording collective ``kind`` on the group named ``group_name`` (defined on first use)."""
    op = _OPS.get((kind, group_name))
    if op is None:
        plain = re.fullmatch(r"\w+", group_name) is not None
        tag = group_name if plain else hashlib.sha1(group_name.encode()).hexdigest()[:12]
        name = f"{kind}_group{tag}"
        arguments, result = _SCHEMAS[kind]
        _LIB.define(f"{name}({_PG_TYPE} group{arguments}) -> {result}")
        _LIB.impl(name, lambda *a, _k=kind: _run(_k, *a), "CompositeExplicitAutograd")
        torch.library.register_fake(f"effectfx_c10d::{name}", lambda *a, _k=kind: _fake(_k, *a), lib=_LIB)
        op = _OPS[(kind, group_name)] = getattr(torch.ops.effectfx_c10d, name).default
        register_effect(op, key="c10d:" + (group_name if plain else tag))
    return op


# -- recording: the tracer hands every op of these namespaces here ---------------------------------------
_BOXES: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], Any]] = weakref.WeakKeyDictionary()


def _group(tracer: Any, group: Any) -> tuple[str, Any, Any]:
    """``(name, boxed group, ProcessGroup)`` of a group given as a name, a ProcessGroup or its box.  One
    box per group, capture and phase: a graph holds one constant per group, and the backward graph its
    own (a forward constant read in backward would be taken for a saved activation)."""
    if isinstance(group, str):
        pg = _C10D._resolve_process_group(str(group))  # str(): a label's value is used (specialized)
    elif isinstance(group, torch.ScriptObject):
        pg = _C10D.ProcessGroup.unbox(group)
    else:
        pg = group
    boxes = _BOXES.setdefault(tracer, {})
    name = pg.group_name
    key = (name, tracer.builder.phase)
    if key not in boxes:
        boxes[key] = pg.boxed()
    return name, boxes[key], pg


def _emit(tracer: Any, kind: str, group: Any, *args: Any) -> Any:
    """Record ``kind`` on ``group`` through the tracer, as any effect op is recorded; its fake result."""
    name, box, _ = _group(tracer, group)
    return tracer.__torch_dispatch__(group_op(kind, name), (), (box, *args), {})


def _rebind(tracer: Any, tensor: torch.Tensor, new: torch.Tensor) -> None:
    """``tensor`` now holds ``new``'s value (Note [Mutations]): later reads see it, its base and views too,
    and an input written this way is written back to the caller."""
    fake = tracer.to_fake(tensor)
    builder = tracer.builder
    builder.node_of(fake)  # an input gets its placeholder before it is written
    node = builder.values[id(new)]
    builder.bind(fake, node)
    tracer._write_back(fake, node)


def _alias(tracer: Any, tensor: torch.Tensor) -> torch.Tensor:
    """A fresh tensor standing for ``tensor``'s value, with no node of its own (``wait_tensor``)."""
    fake = tracer.to_fake(tensor)
    node = tracer.builder.node_of(fake)
    out = tracer.new_fake(TensorMeta.of(fake).without_grad())
    tracer.builder.bind(out, node)
    return out


def _done_work() -> Any:
    """A completed ``Work``: the recorded op waits for its collective; ``work.wait()`` has nothing to do."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(None)
    return _C10D._create_work_from_future(future).boxed()


def _reduce_op(func: Any, op: Any) -> str:
    value = op.op() if isinstance(op, torch.ScriptObject) else int(op)
    name = _C10D.ReduceOp.RedOpType(value).name.lower()
    if name == "premul_sum":
        _refuse(func, "a PREMUL_SUM reduction (its factor is not recorded)")
    return name


def _refuse(func: Any, what: str) -> None:
    raise UnsupportedOperatorError(
        f"{func} ({what}) at {user_location()}.\neffectfx records all_reduce, all_gather_into_tensor / "
        "all_gather, reduce_scatter_tensor / reduce_scatter, broadcast, all_to_all_single and barrier (c10d "
        "or functional collectives, one tensor each) as ordered effects. Use one of those, or run this "
        "collective outside the captured function."
    )


def _arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    found = {}
    for i, arg in enumerate(func._schema.arguments):
        found[arg.name] = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value)
    return found


def _one(func: Any, tensors: list) -> torch.Tensor:
    if len(tensors) != 1:
        _refuse(func, f"a list of {len(tensors)} tensors")
    return tensors[0]


def _c10d(tracer: Any, func: Any, a: dict[str, Any]) -> Any:
    """``c10d::*_``: in-place collectives returning a ``Work``; the written tensors are rebound."""
    name = func._schema.name.split("::")[1]
    pg = a["process_group"]
    if name == "allreduce_":
        if a["sparse_indices"] is not None:
            _refuse(func, "a sparse all_reduce")
        x = _one(func, a["tensors"])
        _rebind(tracer, x, _emit(tracer, "all_reduce", pg, x, _reduce_op(func, a["reduce_op"])))
        return [x], _done_work()
    if name == "broadcast_":
        x = _one(func, a["tensors"])
        _rebind(tracer, x, _emit(tracer, "broadcast", pg, x, a["root_rank"]))
        return [x], _done_work()
    size = _group(tracer, pg)[2].size()
    if name == "_allgather_base_":
        gathered = _emit(tracer, "all_gather_into_tensor", pg, a["input_tensor"], size)
        _rebind(tracer, a["output_tensor"], gathered)
        return a["output_tensor"], _done_work()
    if name == "allgather_":
        outs, x = _one(func, a["output_tensors"]), _one(func, a["input_tensors"])
        gathered = _emit(tracer, "all_gather_into_tensor", pg, x, size)
        n = x.shape[0]
        for i, out in enumerate(outs):
            piece = tracer.__torch_dispatch__(aten.slice.Tensor, (), (gathered, 0, i * n, i * n + n))
            _rebind(tracer, out, piece)
        return a["output_tensors"], _done_work()
    if name in ("_reduce_scatter_base_", "reduce_scatter_"):
        op = _reduce_op(func, a["reduce_op"])
        if name == "_reduce_scatter_base_":
            out, x = a["output_tensor"], a["input_tensor"]
        else:
            out = _one(func, a["output_tensors"])
            x = tracer.__torch_dispatch__(aten.cat.default, (), (_one(func, a["input_tensors"]),))
        _rebind(tracer, out, _emit(tracer, "reduce_scatter_tensor", pg, x, op, size))
        return (out if name == "_reduce_scatter_base_" else [out]), _done_work()
    if name == "alltoall_base_":
        _rebind(tracer, a["output"], _emit(tracer, "all_to_all_single", pg, a["input"],
                                           a["output_split_sizes"], a["input_split_sizes"]))
        return _done_work()
    if name == "barrier":
        _emit(tracer, "barrier", pg)
        return _done_work()
    _refuse(func, "this collective")


def _functional(tracer: Any, func: Any, a: dict[str, Any]) -> Any:
    """``_c10d_functional::*``: collectives returning a new tensor (``*_`` and ``*_out``: written back)."""
    name = func._schema.name.split("::")[1]
    if name in ("wait_tensor", "_wrap_tensor_autograd"):
        return _alias(tracer, a["tensor"] if "tensor" in a else a["input"])
    kind, inplace = name.rstrip("_"), name.endswith("_")
    extra = {
        "all_reduce": ("reduce_op",),
        "all_gather_into_tensor": ("group_size",),
        "all_gather_into_tensor_out": ("group_size",),
        "reduce_scatter_tensor": ("reduce_op", "group_size"),
        "broadcast": ("src",),
        "all_to_all_single": ("output_split_sizes", "input_split_sizes"),
    }.get(kind)
    if extra is None:
        _refuse(func, "this functional collective")
    out = _emit(tracer, kind.removesuffix("_out"), a["group_name"], a["input"], *(a[k] for k in extra))
    written = a["input"] if inplace else a.get("out")
    if written is None:
        return out
    _rebind(tracer, written, out)
    return written


def parallel_wrapper_range(name: str) -> str | None:
    """The parallel wrapper whose forward opens a ``record_function`` range of this name, else None."""
    if name == "DistributedDataParallel.forward":
        return "DistributedDataParallel"
    return "fully_shard" if name.startswith("FSDP::") else None


def _record_function(tracer: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """``record_function`` scopes: DDP's and FSDP2's forward name themselves this way before any state
    changes, wherever in the captured code their module is called."""
    wrapper = parallel_wrapper_range(str(args[0]) if args else "")
    if wrapper is not None:
        _refuse_wrapper(wrapper)
    return NotImplemented  # recorded (or not) as the tracer records any op


COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd", "profiler"})


def record_collective(tracer: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """The tracer's rule for the ops of :data:`COLLECTIVE_NAMESPACES`; ``NotImplemented`` leaves the op to
    the tracer's usual recording."""
    ns = func.namespace
    if ns == "profiler":
        if func._opname.startswith("_record_function_enter"):
            return _record_function(tracer, func, args, kwargs)
        return NotImplemented
    if func is torch.ops.c10d.monitored_barrier_.default:
        return NotImplemented  # no tensor written: the tracer records it as an "ordered" effect
    a = _arguments(func, args, kwargs)
    return _c10d(tracer, func, a) if ns == "c10d" else _functional(tracer, func, a)


# -- DistributedDataParallel and FSDP2 --------------------------------------------------------------------
_ADVICE = {
    "DistributedDataParallel": (
        "DDP does its work outside forward: its reducer, prepared anew by every forward, all-reduces the "
        "gradients from autograd hooks, and it broadcasts buffers before forward; a captured program would "
        "run none of that from the second step on (each rank would keep its own gradients). Compile the "
        "inner module instead and wrap that in DDP: DistributedDataParallel(model) with model.forward "
        "calling an efx.compile'd function (or efx.compile(ddp.module) called from your own DDP wrapper's "
        "module)"),
    "fully_shard": (
        "FSDP2 all-gathers parameters in forward pre-hooks, frees them after, and reduce-scatters "
        "gradients from backward hooks, swapping the module's parameters between sharded and unsharded "
        "tensors; a captured program would freeze one step of that. Capture or compile a function of the "
        "unsharded parameters called from the sharded module's forward, or run the sharded model eagerly"),
}


def _refuse_wrapper(what: str) -> None:
    raise UnsupportedParallelWrapperError(
        f"effectfx cannot capture a module wrapped by {what} (called at {user_location()}).\n"
        f"{_ADVICE[what]}."
    )


def refuse_parallel_wrappers(fn: Any, leaves: list[Any]) -> None:
    """Refuse, before anything runs, a captured module that is (or holds) a DDP or FSDP2 module."""
    if not dist.is_available():
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    owner = getattr(fn, "__self__", None)
    for obj in (fn, owner, *leaves):
        if isinstance(obj, torch.nn.Module):
            for module in obj.modules():
                if isinstance(module, DistributedDataParallel):
                    _refuse_wrapper("DistributedDataParallel")
                if isinstance(module, FSDPModule):
                    _refuse_wrapper("fully_shard")
