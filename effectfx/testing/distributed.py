"""Multi-process runs for the tests: ``torch.distributed`` on gloo over 127.0.0.1, a free port, a timeout.

:func:`run_ranks` runs a function in N spawned processes, each in one process group, and returns what
each rank returned; a failure on any rank raises with that rank's traceback, and a hang raises
``TimeoutError`` (every process is killed) instead of blocking the test run.  :class:`CollectiveLog`
records the collectives a rank issues -- eager's c10d calls and effectfx's recorded collectives alike --
so the two can be compared call by call.
"""

from __future__ import annotations

import datetime
import pickle
import queue as queue_module
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, results: Any,
           timeout: float) -> None:
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            # by value (plain pickle): torch's queue would share tensors through the dying process's memory
            results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent, with its traceback
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 120.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each of ``world_size`` spawned processes (``fn`` importable by
    name), inside an initialized gloo group; returns the results in rank order."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, rank, world_size, port, args, results, timeout),
                         daemon=True) for rank in range(world_size)]
    for p in procs:
        p.start()
    found: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(found) < world_size:
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(found))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s (a hang in a "
                                   "collective?)")
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue_module.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank died without reporting (exit codes {dead})") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            found[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10 if len(found) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [found[r] for r in range(world_size)]


# -- what a rank issued ------------------------------------------------------------------------------------
_KINDS = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce", "broadcast_": "broadcast",
    "broadcast": "broadcast", "_allgather_base_": "all_gather", "allgather_": "all_gather",
    "all_gather_into_tensor": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "barrier": "barrier",
}
_INPUTS = ("input", "input_tensor", "input_tensors", "tensors")


class CollectiveLog(TorchDispatchMode):
    """Under it, ``entries`` gets ``(collective, group name, fingerprint of its input)`` per collective
    issued: eager's ``c10d`` ops and effectfx's ``effectfx_c10d`` ops, named alike."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list[tuple[str, str, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "effectfx_c10d", "_c10d_functional"):
            name = func._schema.name.split("::")[1]
            kind = _KINDS.get(name.split("_group")[0] if func.namespace == "effectfx_c10d" else name)
            if kind is not None:
                bound = {a.name: (args[i] if i < len(args) else kwargs.get(a.name))
                         for i, a in enumerate(func._schema.arguments)}
                group = bound.get("process_group", bound.get("group", bound.get("group_name")))
                if isinstance(group, torch.ScriptObject):
                    group = torch._C._distributed_c10d.ProcessGroup.unbox(group).group_name
                given = next((bound[k] for k in _INPUTS if bound.get(k) is not None), [])
                inputs = [t for t in tree_flatten(given)[0] if isinstance(t, torch.Tensor)]
                if not any(isinstance(t, FakeTensor) for t in inputs):  # a capture under the log: not issued
                    total = sum(float(t.detach().double().sum()) for t in inputs)
                    self.entries.append((kind, str(group), round(total, 4)))
        return func(*args, **kwargs)
