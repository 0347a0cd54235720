"""Tiered compilation (``effectfx.backends.tiers``; benchmarks/README.md, "Tiered compilation"): the time to
train a GPT-2 of 12 layers for N steps (300), every compile included, for eager, effectfx tier 1, effectfx
tiered (the default: tier 2 built in the background, switched at a call boundary), effectfx tier 2 at once,
and torch.compile (inductor); the steady step after the switch; tier 2's compile time and peak memory; the
switch -- at which step, and every step's effect log against eager's.  Model and systems:
:mod:`benchmarks.tiers_systems`; summary, table and plot: :mod:`benchmarks.tiers_report`.

Each system trains in its own fresh subprocess with a fresh ``TORCHINDUCTOR_CACHE_DIR``, after the one-time
costs every process pays alike (imports; :func:`benchmarks.common_child.warm_up_inductor`: a tiny
``torch.compile`` and ``efx.compile(backend="inductor")``), reported apart.  The clock starts before the
first step: the cumulative wall time after every step is recorded (the plot), with the CPU time of the
process tree (Inductor's compile workers included) over the N steps, the tier each program runs after every
step, the RSS after every step and the peak RSS (``ru_maxrss``) of the process.  After the N steps the run
waits for any tier 2 still building (the wait reported, not counted), then times ``steady_steps`` more steps
one by one: their median is the steady step (all systems alike; for a tiered system, tier 2's step when it
was built).  Every step's loss and effect log (``effectfx.testing``'s recording ops) is compared with eager's
same step (eager trains the same N + steady_steps steps from the same seed): effects, labels and shapes
exactly, the logged loss within 1e-3.  When ``tc`` (``torch.compile`` of the effectful step) fails,
``tc_pure``, the effect-free model's step, runs in its place (its effect log is empty by design).

Run: ``python benchmarks/tiers.py [--quick] [--out DIR] [--steps N] [--layers L] [--systems a,b]``; a full
run writes ``results/tiers.json`` and ``results/tiers.png`` (``--quick``: 2 layers, 30 steps, eager / tier 1 /
at-once only, into ``results/quick/``).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common, common_child  # noqa: E402
from benchmarks.tiers_report import plot, summarize, table  # noqa: E402
from benchmarks.tiers_systems import (  # noqa: E402
    BATCH,
    FALLBACK,
    SEQ,
    SYSTEMS,
    WARM,
    System,
    batches,
    jsonable,
    tier_report,
)

LOAD_AT_START = list(os.getloadavg())
NAME = "tiers"
FULL = {"layers": 12, "steps": 300, "steady_steps": 50, "systems": ("eager", "efx_tier1", "efx_tiered",
                                                                    "efx_tiered_warm", "efx_at_once", "tc")}
QUICK = {"layers": 2, "steps": 30, "steady_steps": 10, "systems": ("eager", "efx_tier1", "efx_at_once")}


def rss_mb() -> float:
    """This process's resident memory now (MB)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):  # no /proc: the peak is what there is
        return peak_rss_mb()


def peak_rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    """The peak resident memory (MB) of this process (or of its largest finished child)."""
    return resource.getrusage(who).ru_maxrss / 1024  # kilobytes on Linux


# -- one system, in a subprocess ----------------------------------------------------------------------------
def train(system: str, layers: int, steps: int, steady_steps: int, threads: int) -> dict[str, Any]:
    """``steps`` timed steps of ``system`` from a fresh model, then ``steady_steps`` more timed one by one."""
    common_child.quiet_transformers()
    torch.set_num_threads(threads)
    start = time.perf_counter()
    common_child.warm_up_inductor()
    warmup_s = time.perf_counter() - start
    s = System(system, layers)
    data = batches(steps + steady_steps)
    result: dict[str, Any] = {"warmup_s": warmup_s, "rss_start_mb": rss_mb(),
                              "peak_rss_start_mb": peak_rss_mb()}
    cumulative, losses, logs, tiers, rss = [], [], [], [], []
    cpu = common_child.tree_cpu_s()
    start = time.perf_counter()
    try:
        for batch in data[:steps]:
            loss, log = s(batch)
            cumulative.append(time.perf_counter() - start)
            losses.append(loss)
            logs.append(jsonable(log))
            tiers.append(s.tiers())
            rss.append(rss_mb())
    except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
        result.update(status=common.error_text(e), cumulative_s=cumulative)
        return result
    result["cpu_s"] = common_child.tree_cpu_s() - cpu
    result["waited_s"] = s.wait()  # a tier 2 still building: its figures, and the steady step's tier
    result["tiers_after_wait"] = s.tiers()
    steady = []
    for batch in data[steps:]:
        t = time.perf_counter()
        loss, log = s(batch)
        steady.append(time.perf_counter() - t)
        losses.append(loss)
        logs.append(jsonable(log))
        tiers.append(s.tiers())
    result.update(status="ok", cumulative_s=cumulative, steady_s=steady, losses=losses, logs=logs,
                  tiers=tiers, rss_mb=rss, peak_rss_mb=peak_rss_mb(),
                  peak_rss_children_mb=peak_rss_mb(resource.RUSAGE_CHILDREN),
                  tier_states=[tier_report(x) for x in s.tier_states()])
    return result


# -- the whole run -------------------------------------------------------------------------------------------
def run(quick: bool, layers: int | None, steps: int | None, systems: list[str] | None, threads: int,
        progress: bool = True, label: str | None = None) -> dict[str, Any]:
    cfg = dict(QUICK if quick else FULL)
    cfg.update({k: v for k, v in (("layers", layers), ("steps", steps)) if v is not None})
    chosen = list(systems or cfg["systems"])
    if "eager" in chosen:  # the reference first
        chosen.remove("eager")
        chosen.insert(0, "eager")
    bar = common.Progress(len(chosen), NAME, enabled=progress)
    started = time.time()
    runs: dict[str, dict[str, Any]] = {}
    caches: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="efx-tiers-bench-") as tmp:
        for system in chosen:
            for name in (system, FALLBACK.get(system)):
                if name is None:
                    continue
                spec = {"system": name, "layers": cfg["layers"], "steps": cfg["steps"],
                        "steady_steps": cfg["steady_steps"], "threads": threads}
                if name in WARM and WARM[name] not in caches:
                    runs[name] = {"status": f"not run: needs {WARM[name]}'s run first"}
                    break
                # a fresh cache, or (warm) the one WARM's system filled
                caches[name] = caches[WARM[name]] if name in WARM else tempfile.mkdtemp(dir=tmp)
                runs[name] = common_child.run(__file__, spec, caches[name])
                if runs[name].get("status") == "ok" or name not in FALLBACK:
                    break
            bar.step(f"{system}: {runs[name].get('status', '?')[:60]}")
    machine = common.machine_info()
    machine.update(load_average_start=LOAD_AT_START, duration_s=time.time() - started,
                   **common.effectfx_source())
    return {"benchmark": NAME, "machine": machine, "label": label,
            "config": {"quick": quick, "layers": cfg["layers"], "steps": cfg["steps"],
                       "steady_steps": cfg["steady_steps"], "threads": threads, "batch": [BATCH, SEQ],
                       "systems": chosen, "systems_run": list(runs),
                       "definitions": {k: SYSTEMS[k] for k in runs}},
            "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 30 steps, eager / tier 1 / at-once")
    parser.add_argument("--layers", type=int, default=None, help="GPT-2 layers (default 12; --quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps to train (default 300; --quick 30)")
    parser.add_argument("--systems", default=None, help=f"comma-separated, of {', '.join(SYSTEMS)}")
    common.add_output_arguments(parser, NAME)
    common.add_run_arguments(parser, budget=False)
    args = parser.parse_args(argv)
    systems = args.systems.split(",") if args.systems else None
    for system in systems or ():
        if system not in SYSTEMS:
            parser.error(f"unknown system {system!r}")

    def child(spec: dict[str, Any]) -> dict[str, Any]:
        return train(spec["system"], spec["layers"], spec["steps"], spec["steady_steps"], spec["threads"])

    return common.dispatch(args, NAME, (summarize, table, plot), lambda: run(
        args.quick, args.layers, args.steps, systems, args.threads, not args.no_progress, args.label), child)


if __name__ == "__main__":
    sys.exit(main())
