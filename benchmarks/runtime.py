"""Steady-state time per call: efx.compile vs eager vs torch.compile(aot_eager), and the cost per effect.

A 16-block stack (Linear + ReLU + one effect op call per block), layers 64 and 512 wide, batch 32;
inference (``torch.no_grad``) and a training step (forward + ``out.sum().backward()``).  Every system is
also measured on the same stack without the effect op; the cost per effect is
``(time with effects - time without) / 16``, compared with the op's own eager cost (16 direct calls of
``torch.ops.efxbench.record``).  All systems of one configuration are timed interleaved, in a shuffled
order each round, each sample a batch of calls lasting about a millisecond or more; reported figures are
medians over rounds (differences are medians of per-round differences).  The systems are in
:mod:`benchmarks.runtime_systems`, the analysis, table and plot in :mod:`benchmarks.runtime_report`.

Run: ``python benchmarks/runtime.py [--quick]`` or ``effectfx bench``; ``--plot-only results/runtime.json``
redraws the table and plot from a saved run.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.first_call_systems import compile_for, make_model, warmup  # noqa: E402
from benchmarks.runtime_report import analyze, plot, table  # noqa: E402
from benchmarks.runtime_systems import BATCH, LABELS, N_BLOCKS, SYSTEMS, op_step, step_of  # noqa: E402

NAME = "runtime"
FULL = {"widths": [64, 512], "budget_s": 8.0, "sample_s": 2e-3, "skip": []}
QUICK = {"widths": [64], "budget_s": 0.4, "sample_s": 1e-3, "skip": ["tc", "tc_noeffect"]}


def _prepare(width: int, train: bool, skip: list[str]) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """Compile every system for one configuration; returns the runnable steps and what was observed."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, width, generator=g)
    steps: dict[str, Callable[[], Any]] = {}
    info: dict[str, Any] = {}
    for system, (compiler, marker, effects) in SYSTEMS.items():
        if system in skip:
            continue
        model = make_model(N_BLOCKS, width, marker, effects, train)
        fn = compile_for(compiler, model)
        step = step_of(fn, x, train)
        common.LOG.clear()
        status = "ok"
        try:
            with torch.set_grad_enabled(train):
                start = time.perf_counter()
                step()
                first = time.perf_counter() - start
        except Exception as exc:  # a comparator that cannot run this configuration is a result
            status = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            first = float("nan")
        entry: dict[str, Any] = {"status": status, "first_call_s": first, "effects_per_call": len(common.LOG),
                                 "expected_effects": N_BLOCKS if effects else 0}
        if compiler == "efx" and status == "ok":
            prog = fn.programs()[0]
            entry["efx_form"] = prog.form
            entry["efx_history"] = [r.name for r in getattr(prog, "forward", prog).history]
        info[system] = entry
        if status == "ok":
            steps[system] = step
    steps["op"] = op_step()
    info["op"] = {"status": "ok", "effects_per_call": N_BLOCKS, "expected_effects": N_BLOCKS}
    common.LOG.clear()
    return steps, info


def _time_config(steps: dict[str, Callable[[], Any]], train: bool, budget_s: float,
                 sample_s: float, rng: random.Random) -> dict[str, dict[str, list[float]]]:
    """Interleaved timing: per-call seconds of each system, one sample per round, as wall-clock time
    (``perf_counter``) and as CPU time of this process (``process_time``, blind to other processes
    competing for the cores)."""
    with torch.set_grad_enabled(train):
        one: dict[str, float] = {}
        for name, step in steps.items():  # warm up, then estimate one call
            for _ in range(3):
                step()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                step()
                ts.append(time.perf_counter() - t0)
            one[name] = max(common.median(ts), 1e-7)
        inner = {name: max(1, round(sample_s / t)) for name, t in one.items()}
        per_round = sum(inner[n] * one[n] for n in steps)
        rounds = max(5, min(2000, int(budget_s / per_round)))
        wall: dict[str, list[float]] = {name: [] for name in steps}
        cpu: dict[str, list[float]] = {name: [] for name in steps}
        order = list(steps)
        for _ in range(rounds):
            rng.shuffle(order)
            for name in order:
                step, k = steps[name], inner[name]
                c0 = time.process_time()
                t0 = time.perf_counter()
                for _ in range(k):
                    step()
                t1 = time.perf_counter()
                c1 = time.process_time()
                wall[name].append((t1 - t0) / k)
                cpu[name].append((c1 - c0) / k)
                common.LOG.clear()
    return {"wall": wall, "cpu": cpu}


def run(quick: bool = False, progress: common.Progress | None = None, seed: int = 0,
        warm: bool = True) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    if warm:
        warmup()
    rng = random.Random(seed)
    configs = []
    for width in cfg["widths"]:
        for train in (False, True):
            mode = "training" if train else "inference"
            steps, info = _prepare(width, train, cfg["skip"])
            common.quiet_gc()
            samples = _time_config(steps, train, cfg["budget_s"], cfg["sample_s"], rng)
            configs.append({
                "width": width, "mode": mode, "n_blocks": N_BLOCKS, "batch": BATCH,
                "rounds": len(samples["wall"]["eager"]),
                "systems": info,
                "wall": analyze(samples["wall"]),
                "cpu": analyze(samples["cpu"]),
            })
            if progress is not None:
                progress.step(f"runtime width={width} {mode}")
    return {
        "benchmark": NAME,
        "machine": common.machine_info(),
        "config": {**cfg, "n_blocks": N_BLOCKS, "batch": BATCH, "quick": quick, "systems": LABELS,
                   "torch_compile_backend": "aot_eager",
                   "clocks": {"wall": "time.perf_counter", "cpu": "time.process_time (this process)"}},
        "results": configs,
        "targets": {"efx_over_eager_max": 1.0, "per_effect_overhead_max": "op's own cost + 2 us"},
    }


def steps_total(quick: bool) -> int:
    return len((QUICK if quick else FULL)["widths"]) * 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64-wide only, a short time budget")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    common.add_output_arguments(parser, NAME, child=False)
    args = parser.parse_args(argv)

    def measure() -> dict[str, Any]:
        torch.set_num_threads(args.threads)
        return run(args.quick, common.Progress(steps_total(args.quick), NAME))

    return common.dispatch(args, NAME, (None, table, plot), measure)


if __name__ == "__main__":
    sys.exit(main())
