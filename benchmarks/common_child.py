"""Shared pieces of the studies that measure in child processes (``inductor.py``, ``dynamic.py``,
``generate.py``, ``train_step.py``): each first call runs in a fresh process with a fresh Inductor cache,
after the one-time costs every process pays alike; its CPU time counts Inductor's compile workers."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import effectfx as efx
from benchmarks import common


def run(script: str, spec: dict[str, Any], cache_dir: str, timeout: float = 3600) -> dict[str, Any]:
    """``script --child SPEC`` in a fresh process whose Inductor cache is ``cache_dir``: the last JSON line it
    prints, or its failure (a child failing or timing out is a result, reported as such)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, script, "--child", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"child timed out after {timeout:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"status": f"child failed (exit {proc.returncode}): {proc.stderr[-500:]}"}


def warm_up_inductor() -> None:
    """The one-time costs of Inductor that every system of a process pays alike (imports, the vector-ISA
    probe and precompiled header, compile workers, dynamo's first frame): one tiny ``torch.compile`` and one
    tiny ``efx.compile`` of unrelated functions; then the heap is frozen."""
    torch.compile(lambda a: torch.cos(a) * 3, backend="inductor")(torch.randn(5))
    efx.compile(lambda a: torch.sin(a) + 1, backend="inductor")(torch.randn(3))
    torch._dynamo.reset()
    common.LOG.clear()
    common.freeze_heap()


def quiet_transformers() -> None:
    """No warnings, and transformers' errors only: a child's output is its JSON line."""
    import warnings

    warnings.filterwarnings("ignore")  # before transformers' import, which warns too
    import transformers

    transformers.logging.set_verbosity_error()


def tree_cpu_s() -> float:
    """CPU seconds of this process, its finished children, and every live descendant with theirs: Inductor
    compiles C++ in worker processes (each running the compiler), which wall-clock time on a shared
    machine mixes with other users' work."""
    import resource

    total = sum(getattr(resource.getrusage(who), f) for f in ("ru_utime", "ru_stime")
                for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)], stats[int(entry)] = int(fields[1]), fields
    mine = {os.getpid()}
    for pid in sorted(parents):  # descendants: walk each chain of parents up to this process
        chain, p = [], pid
        while p in parents and p not in mine and p > 1:
            chain.append(p)
            p = parents[p]
        if p in mine:
            mine.update(chain)
    for pid in mine - {os.getpid()}:
        total += sum(int(v) for v in stats[pid][11:15]) / tick  # utime stime cutime cstime
    return total


def timed_first_calls(step: Any, data: list[Any], cpu_clock: Any
                      ) -> tuple[list[dict[str, Any]], list[float], list[list], str | None]:
    """``step(batch) -> (loss, effect log)`` on each batch, each call timed apart (wall, and ``cpu_clock``'s
    CPU) after a ``gc.collect()``, with ``step.captures()`` after it: the timed calls, losses, logs, and the
    error text of a call that raised, which ends the calls (a system failing is a result, reported so)."""

    timed: list[dict[str, Any]] = []
    losses: list[float] = []
    logs: list[list] = []
    for batch in data:
        gc.collect()
        cpu, wall = cpu_clock(), time.perf_counter()
        try:
            loss, log = step(batch)
        except Exception as e:  # noqa: BLE001
            return timed, losses, logs, common.error_text(e)
        wall, cpu = time.perf_counter() - wall, cpu_clock() - cpu
        timed.append({"wall_s": wall, "cpu_s": cpu, "captures": step.captures(), "effects": len(log)})
        losses.append(loss)
        logs.append(log)
    return timed, losses, logs, None

