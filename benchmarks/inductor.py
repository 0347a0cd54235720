"""effectfx's Inductor backend beside torch.compile and eager: first call (fresh and warm Inductor caches)
and the steady-state training and inference steps, for a stack of N transformer-style blocks (N = 2, 16),
GPT-2 and Llama (12 layers each); the models and systems are in :mod:`benchmarks.inductor_systems`, the
summary, tables, targets (benchmarks/README.md, "Inductor backend") and plot in
:mod:`benchmarks.inductor_report`.

First call = capture + compile + first forward and backward (then the second call's wall time apart:
effectfx compiles its root graph's segments on their second run), each measured in its own subprocess whose
``TORCHINDUCTOR_CACHE_DIR`` is a fresh temporary directory ("fresh"), or the directory a fresh ``efx`` /
``tc`` run just filled ("warm": a second process starting; not run when the fresh call failed).  Before
measuring, every subprocess pays the one-time costs every system pays alike (imports, Inductor's vector-ISA
probe and precompiled header, compile workers, dynamo's first frame): one tiny ``torch.compile`` and one
tiny ``efx.compile`` of an unrelated function; that warm-up is reported apart.  Each first call is checked
against eager (outputs, gradients, effect count); effectfx's also records every segment it compiled
(the ``effectfx.inductor`` log).  Steady state: every system warmed up in one process, its training step
and its inference step (``torch.no_grad()``, compiled apart) each checked against eager, then all timed
interleaved in shuffled order (samples of >= 20 ms, ~budget seconds per model), medians of wall and CPU
time; that in 3 processes per configuration (``--quick``: 1), each building and compiling every system anew,
whose ratios the summary takes the median of.  A system whose every first call failed is not trained again
there (its inference step still is).

Run: ``python benchmarks/inductor.py [--quick] [--out DIR] [--reps R] [--hop]``; ``--hop`` adds effectfx's
capture through torch's ``invoke_subgraph`` lowering (``efx_hop``, left out by default).  A full run writes
``results/inductor.json`` (``--quick``: ``results/quick/``, never the committed figures).
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common, common_child  # noqa: E402
from benchmarks import inductor_systems as defs  # noqa: E402
from benchmarks.inductor_report import plot, summarize, table  # noqa: E402
from benchmarks.inductor_systems import (  # noqa: E402
    SYSTEMS,
    build,
    check,
    check_inference,
    compiled,
    register_hop_backend,
)

LOAD_AT_START = list(os.getloadavg())

NAME = "inductor"
FIRST_CALL = ("efx", "tc", "tc_ncr", "tc_pure", "tc_ncr_pure")  # efx_hop too with --hop
WARM = ("efx", "tc", "tc_pure")  # also measured in a second process on the cache the first filled
STEADY = ("eager", "eager_pure", "efx", "efx_pure", "efx_twin", "efx_t2", "tc", "tc_ncr", "tc_pure",
          "tc_ncr_pure")
MODES = ("training", "inference")
# the 12-layer models' first calls: 2 repetitions (the stack's 3), for a full run of about an hour
# steady state: 3 processes per configuration, each building and compiling every system anew (two builds of
# one system differ by up to ~7 % between processes, while they agree to ~2 % within one)
FULL = {"configs": [("stack", 2), ("stack", 16), *((m, n) for m, n in defs.HF_LAYERS.items())],
        "reps": {"stack": 3, "gpt2": 2, "llama": 2}, "budget_s": 20.0, "systems": FIRST_CALL,
        "steady": STEADY, "steady_processes": 3}
QUICK = {"configs": [("stack", 2)], "reps": {"stack": 1}, "budget_s": 2.0, "systems": ("efx", "tc_pure"),
         "steady": ("eager", "efx", "efx_twin", "tc_pure"), "steady_processes": 1}


# -- one first call, in a subprocess -----------------------------------------------------------------------
def first_call(model: str, n: int, system: str) -> dict[str, Any]:
    """Measure one first call in this process (a subprocess of the benchmark: see ``--child``)."""
    torch.set_num_threads(1)
    register_hop_backend()
    start = time.perf_counter()
    common_child.warm_up_inductor()
    warmup_s = time.perf_counter() - start
    module, loss_of, _ = build(model, n, system)
    f = compiled(system, module)
    segments: list[dict[str, Any]] = []
    if system == "efx":  # where the first call goes: every segment compiled (effectfx.inductor's log)
        handler = logging.Handler()
        handler.emit = lambda r: segments.append(  # type: ignore[method-assign]
            {k: getattr(r, f"efx_{k}", None) for k in ("where", "nodes", "outcome", "seconds")})
        logger = logging.getLogger("effectfx.inductor")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    from effectfx.backends import inductor_cache

    compiles = inductor_cache.STATS.compiles
    gc.collect()
    cpu, wall = common_child.tree_cpu_s(), time.perf_counter()
    try:
        loss = loss_of(f)
        loss.backward()
    except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
        return {"status": f"{type(e).__name__}: {str(e)[:300]}", "warmup_s": warmup_s}
    wall, cpu = time.perf_counter() - wall, common_child.tree_cpu_s() - cpu
    result = {"status": "ok", "wall_s": wall, "cpu_s": cpu, "warmup_s": warmup_s, "effects": len(common.LOG),
              "effects_expected": n if SYSTEMS[system][2] else 0}
    result.update(check(model, n, system, module, loss))
    if system == "efx":
        result["segments_compiled"] = inductor_cache.STATS.compiles - compiles
        result["segments"] = list(segments)
    # the second call: effectfx compiles the root's segments on their second run (deferred)
    for p in module.parameters():
        p.grad = None
    second = time.perf_counter()
    loss_of(f).backward()
    result["second_s"] = time.perf_counter() - second
    if system == "efx":
        result["second_segments"] = segments[len(result["segments"]):]
    return result


# -- steady state, in one process ---------------------------------------------------------------------------
def _prepare(model: str, n: int, system: str, mode: str) -> tuple[Callable[[], None], dict[str, Any]]:
    """One system's step of ``mode``, compiled on its own module, run, checked against eager (fast but
    wrong is not a result) and warmed up."""
    module, loss_of, out_of = build(model, n, system)
    f = compiled(system, module)
    params = list(module.parameters())

    def training() -> None:
        loss_of(f).backward()
        for p in params:
            p.grad = None

    def inference() -> None:
        with torch.no_grad():
            out_of(f)

    step = training if mode == "training" else inference
    step()
    step()
    common.LOG.clear()
    if mode == "training":
        loss = loss_of(f)
        loss.backward()
        effects = len(common.LOG)
        verdict = check(model, n, system, module, loss)
        for p in params:
            p.grad = None
    else:
        with torch.no_grad():
            out = out_of(f)
        effects = len(common.LOG)
        verdict = check_inference(model, n, system, out)
    step()
    verdict["effects"], verdict["effects_expected"] = effects, n if SYSTEMS[system][2] else 0
    return step, verdict


def steady_state(model: str, n: int, budget_s: float, systems: list[str],
                 skip: dict[str, str]) -> dict[str, Any]:
    """Training and inference steps of every system (each compiled apart), all interleaved in shuffled
    order; medians (ms), wall and CPU.  ``skip``: systems whose every first call failed (training not
    run again)."""
    torch.set_num_threads(1)
    register_hop_backend()
    steps: dict[tuple[str, str], Callable[[], None]] = {}
    status: dict[str, dict[str, str]] = {mode: {} for mode in MODES}
    checks: dict[str, dict[str, Any]] = {mode: {} for mode in MODES}
    for system in systems:
        for mode in MODES:
            if mode == "training" and system in skip:
                status[mode][system] = f"every first call failed: {skip[system][:200]}"
                continue
            try:
                step, verdict = _prepare(model, n, system, mode)
            except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
                status[mode][system] = f"{type(e).__name__}: {str(e)[:300]}"
                continue
            checks[mode][system] = verdict
            if not verdict["ok"]:
                status[mode][system] = f"wrong results: max rel. difference {verdict['max_rel_diff']:.2g}"
            elif verdict["effects"] != verdict["effects_expected"]:
                status[mode][system] = f"wrong effects: {verdict['effects']} of {verdict['effects_expected']}"
            else:
                status[mode][system] = "ok"
                steps[system, mode] = step
    samples, cpu, rounds, _ = common.interleave(steps, budget_s)  # one thread: process time is the step's

    def per_mode(values: dict[tuple[str, str], Any]) -> dict[str, dict[str, Any]]:
        return {mode: {s: v for (s, m), v in values.items() if m == mode} for mode in MODES}

    return {"status": status, "checks": checks, "rounds": rounds,
            "step_ms": per_mode({k: common.median(v) * 1e3 for k, v in samples.items()}),
            "step_cpu_ms": per_mode({k: common.median(v) * 1e3 for k, v in cpu.items()}),
            "samples_ms": per_mode({k: [x * 1e3 for x in v] for k, v in samples.items()})}


# -- the whole run -------------------------------------------------------------------------------------------
def run(quick: bool = False, reps: int | None = None, hop: bool = False) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    configs = cfg["configs"]
    rep_of = {model: reps or cfg["reps"][model] for model, _ in configs}
    systems = [*cfg["systems"], *(("efx_hop",) if hop else ())]
    steady_systems = [*cfg["steady"], *(("efx_hop",) if hop else ())]
    first: dict[str, list[dict[str, Any]]] = {}
    per_rep = len(systems) + len(set(WARM) & set(systems))
    n_steady = cfg["steady_processes"]
    progress = common.Progress(sum(rep_of[m] for m, _ in configs) * per_rep + len(configs) * n_steady, NAME)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="efx-inductor-bench-") as tmp:
        for rep in range(max(rep_of.values())):
            for model, n in configs:
                if rep >= rep_of[model]:
                    continue
                order = list(systems)
                random.Random(rep).shuffle(order)  # no system always runs first (or last) on a busy machine
                for system in order:
                    cache = tempfile.mkdtemp(dir=tmp)
                    spec = {"mode": "first", "model": model, "n": n, "system": system}
                    for kind in ("fresh", "warm") if system in WARM else ("fresh",):
                        key = f"{model}/{n}/{system}/{kind}"
                        fresh = first.get(f"{model}/{n}/{system}/fresh", [{}])[-1]
                        if kind == "warm" and fresh.get("status") != "ok":  # nothing to load: not measured
                            result = {"status": f"not run: the fresh call failed ({fresh.get('status')})"}
                        else:
                            result = common_child.run(__file__, spec, cache)
                        first.setdefault(key, []).append(result)
                        progress.step(key)
        steady: dict[str, dict[str, list[Any]]] = {f"{m}/{n}": {"processes": []} for m, n in configs}
        caches = {tag: tempfile.mkdtemp(dir=tmp) for tag in steady}  # later processes load the first one's
        for k in range(n_steady):  # processes of one configuration apart in time: drift hits all alike
            for model, n in configs:
                skip = {s: runs[0]["status"] for s in steady_systems if (runs := first.get(
                    f"{model}/{n}/{s}/fresh")) and all(r["status"] != "ok" for r in runs)}
                spec = {"mode": "steady", "model": model, "n": n, "systems": steady_systems, "skip": skip,
                        "budget_s": cfg["budget_s"]}
                process = common_child.run(__file__, spec, caches[f"{model}/{n}"])
                steady[f"{model}/{n}"]["processes"].append(process)
                progress.step(f"{model}/{n} steady state, process {k + 1} of {n_steady}")
    machine = common.machine_info()
    machine["load_average_start"], machine["duration_s"] = LOAD_AT_START, time.time() - started
    data = {"machine": machine,
            "config": {"quick": quick, "reps": rep_of, "configs": configs, "budget_s": cfg["budget_s"],
                       "steady_processes": n_steady,
                       "systems": {k: SYSTEMS[k] for k in dict.fromkeys([*systems, *steady_systems])},
                       "stack": {"width": defs.WIDTH, "batch": defs.BATCH, "seq": defs.SEQ},
                       "hf": {"layers": defs.HF_LAYERS, "batch": defs.GPT2_BATCH, "seq": defs.SEQ}},
            "first_call": first, "steady_state": steady}
    data["summary"] = summarize(data)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stack N=2 only, one repetition, short budget")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of every first call")
    parser.add_argument("--hop", action="store_true",
                        help="also effectfx's capture through torch's invoke_subgraph lowering (efx_hop)")
    common.add_output_arguments(parser, NAME)
    args = parser.parse_args(argv)

    def child(spec: dict[str, Any]) -> dict[str, Any]:
        if spec["mode"] == "first":
            return first_call(spec["model"], spec["n"], spec["system"])
        return steady_state(spec["model"], spec["n"], spec["budget_s"], spec["systems"], spec["skip"])

    return common.dispatch(args, NAME, (summarize, table, plot), lambda: run(args.quick, args.reps, args.hop),
                           child)


if __name__ == "__main__":
    sys.exit(main())
