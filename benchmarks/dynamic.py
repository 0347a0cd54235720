"""Symbolic shapes: GPT-2 training on 16 batches of distinct sequence lengths, effectfx's automatic dynamic
beside ``dynamic=False``, its Inductor backend, ``torch.compile`` (aot_eager, inductor; default dynamic and
``dynamic=True``) and eager.

Model: ``effectfx.testing.hf.build("gpt2")`` -- 4 layers, hidden 64, random weights (seed 0), each layer a
``LoggedLayer`` region recording its name through ``efxtest::record_memory`` (registered here in torch's
effect registry too, ORDERED: torch.compile would drop it otherwise).  Training call: ``model(ids,
labels=ids).loss.backward()``, no optimizer step (weights stay fixed, gradients cleared between calls).
Batches: size 4, lengths 16..31 (one of each), ids from a generator seeded 1, the same for every system.

First calls: each system in a subprocess of its own with a fresh ``TORCHINDUCTOR_CACHE_DIR`` (dynamo's and
Inductor's caches start empty), after a warm-up of one-time costs that every process pays alike (a tiny
``efx.compile`` and ``torch.compile(backend="aot_eager")``, static and dynamic, training; for the Inductor
systems also a tiny Inductor compile of each, as ``inductor.py`` does), reported apart.  Then the 16 calls in
order, each timed (wall; CPU of the process, or of the process tree with Inductor's compile workers for the
Inductor systems), and the captures after each: ``stats.compiles`` for effectfx, dynamo's
``counters["stats"]["unique_graphs"]`` (graphs installed: the first compile and each recompile) for
torch.compile, plus ``counters["aot_autograd"]["total"]`` (backend compiles, a restarted analysis included);
for effectfx's Inductor backend ``inductor_cache.STATS`` and the variants per segment.  Every call's loss and
gradients are compared with eager's on the same batch (max relative difference < 1e-3, as ``inductor.py``),
and its effects with eager's log.

Steady state: one more subprocess builds every system and warms it on the first two lengths and then the
steady length (24), so that a ``dynamic=None`` system serves it with its symbolic program; the static
comparators ``efx.compile(model, dynamic=False)`` (and with ``backend="inductor"``) are warmed at the steady
length only.  Training steps at that length are timed interleaved in shuffled rounds (samples of >= 20 ms),
medians.

Run: ``python benchmarks/dynamic.py [--quick] [--out DIR] [--reps R] [--systems a,b]``; a full run writes
``results/dynamic.json`` and ``.png`` (``--quick``: 3 lengths, eager / effectfx / torch.compile(aot_eager),
into ``results/quick/``).
"""

from __future__ import annotations

import argparse
import gc
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

import effectfx as efx  # noqa: E402
from benchmarks import common, common_child  # noqa: E402
from benchmarks.dynamic_report import plot, summarize, table  # noqa: E402
from benchmarks.dynamic_systems import (  # noqa: E402
    BATCH,
    FIRST_CALL,
    FULL,
    NAME,
    QUICK,
    STATIC_OF,
    SYSTEMS,
    TOLERANCE,
    batches,
    build,
    captures,
    compare,
    has_effects,
    inductor_stats,
    minus,
    references,
    segments_report,
    snapshot,
    train_call,
    uses_inductor,
)


# -- in a subprocess: warm-up, the first calls ---------------------------------------------------------------
def warm_up(inductor: bool) -> float:
    """The one-time costs every process pays alike (module docstring); returns its seconds."""
    start = time.perf_counter()
    for dynamic in (False, True):
        x = torch.randn(3, 5, requires_grad=True)
        efx.compile(lambda a: torch.sin(a) * 2, dynamic=dynamic)(x).sum().backward()
        torch.compile(lambda a: torch.cos(a) * 3, backend="aot_eager", dynamic=dynamic)(x).sum().backward()
    if inductor:  # as inductor.py: Inductor's ISA probe, precompiled header, compile workers
        common_child.warm_up_inductor()
    torch._dynamo.reset()
    common.freeze_heap()
    return time.perf_counter() - start


def first_calls(system: str, lengths: list[int], threads: int) -> dict[str, Any]:
    """The 16 first calls of ``system`` in this (fresh) process."""
    torch.set_num_threads(threads)
    warmup_s = warm_up(uses_inductor(system))
    cpu_clock = common_child.tree_cpu_s if uses_inductor(system) else time.process_time
    model, f = build(system)
    dyn0, ind0 = common.dynamo_counts(), inductor_stats()
    calls, got = [], []
    for ids in batches(lengths):
        gc.collect()
        cpu, wall = cpu_clock(), time.perf_counter()
        try:
            status, loss, log = train_call(f, ids)
        except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
            status, loss, log = common.error_text(e), None, []
        wall, cpu = time.perf_counter() - wall, cpu_clock() - cpu
        call = {"length": int(ids.shape[1]), "wall_s": wall, "cpu_s": cpu, "status": status,
                "effects": len(log), "captures": captures(system, f, dyn0)}
        if SYSTEMS[system][0] == "tc":
            call["dynamo"] = minus(common.dynamo_counts(), dyn0)
        if uses_inductor(system) and SYSTEMS[system][0] == "efx":
            call["inductor"] = minus(inductor_stats(), ind0)
        calls.append(call)
        got.append((snapshot(model, loss), list(log)))
    # against eager, after every timed call
    for call, (values, log), (want, want_log) in zip(calls, got, references(lengths, has_effects(system))):
        call.update(compare(values, want) if call["status"] == "ok" else {"max_rel_diff": None, "ok": False})
        call["effects_ok"] = log == want_log
        call["effects_expected"] = len(want_log)
    result: dict[str, Any] = {
        "status": next((c["status"] for c in calls if c["status"] != "ok"), "ok"),
        "warmup_s": warmup_s, "cpu_clock": "process tree" if uses_inductor(system) else "process",
        "calls": calls, "captures": calls[-1]["captures"],
        "matches_eager": all(c["ok"] for c in calls), "effects_ok": all(c["effects_ok"] for c in calls)}
    if SYSTEMS[system][0] == "efx":
        result["capture_seconds"] = list(f.stats.compile_seconds)
    if SYSTEMS[system][0] == "tc":
        result["dynamo"] = minus(common.dynamo_counts(), dyn0)
    if uses_inductor(system) and SYSTEMS[system][0] == "efx":
        result["inductor"] = minus(inductor_stats(), ind0)
        result["segments"] = segments_report()
    return result


# -- in a subprocess: the steady state -----------------------------------------------------------------------
def steady_state(systems: list[str], lengths: list[int], length: int, budget_s: float,
                 threads: int) -> dict[str, Any]:
    """Training step at ``length`` of every system, interleaved in shuffled rounds; medians (ms)."""
    torch.set_num_threads(threads)
    # several compiled instances of one model class share dynamo's cache of its forward
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 4096
    (ids,) = batches([length])
    warm = batches(lengths[:2])
    want_of = {logged: references([length], logged)[0] for logged in (True, False)}
    steps: dict[str, Callable[[], None]] = {}
    status: dict[str, str] = {}
    info: dict[str, dict[str, Any]] = {}
    counters_of: dict[str, Callable[[], int]] = {}
    for system in systems:
        model, f = build(system)
        dyn0 = common.dynamo_counts()
        step = _step(f, model, ids)
        want, want_log = want_of[has_effects(system)]
        try:
            # a dynamic=None system serves the steady length with its symbolic program; the static
            # comparators (dynamic=False) are warmed at that length only
            for w in (warm if SYSTEMS[system][2] is not False else []):
                train_call(f, w)
                snapshot(model, None)
            state, loss, log = train_call(f, ids)
            verdict = compare(snapshot(model, loss), want) if state == "ok" else {"ok": False}
            step()
            step()
        except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
            status[system] = common.error_text(e)
            continue
        info[system] = {"max_rel_diff": verdict.get("max_rel_diff"), "effects": len(log),
                        "effects_ok": list(log) == want_log}
        if state != "ok":
            status[system] = state
            continue
        if not verdict["ok"]:
            status[system] = f"wrong results: max rel. difference {verdict['max_rel_diff']:.2g} from eager"
            continue
        status[system] = "ok"
        steps[system] = step
        counters_of[system] = lambda system=system, f=f, dyn0=dyn0: captures(system, f, dyn0)
        info[system]["captures_after_warmup"] = counters_of[system]()
    before = {system: counters_of[system]() for system in steps}
    graphs_before = common.dynamo_counts()["unique_graphs"]
    samples, cpu, rounds, calls = common.interleave(steps, budget_s)  # compiles done: process time
    for system in steps:  # nothing may have captured or compiled again while timing
        info[system]["captures_while_timing"] = counters_of[system]() - before[system]
    return {"status": status, "info": info, "length": length, "rounds": rounds, "calls_per_sample": calls,
            "dynamo_graphs_while_timing": common.dynamo_counts()["unique_graphs"] - graphs_before,
            "step_ms": {k: common.median(v) * 1e3 for k, v in samples.items()},
            "step_cpu_ms": {k: common.median(v) * 1e3 for k, v in cpu.items()},
            "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()}}


def _step(f: Callable[..., Any], model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], None]:
    params = list(model.parameters())

    def step() -> None:
        f(ids, labels=ids).loss.backward()
        for p in params:
            p.grad = None

    return step


# -- the whole run -------------------------------------------------------------------------------------------
def run(quick: bool = False, reps: int | None = None, inductor_reps: int | None = None,
        systems: list[str] | None = None, threads: int = 1, progress: bool = True,
        label: str | None = None) -> dict[str, Any]:
    cfg = dict(QUICK if quick else FULL)
    cfg["reps"] = reps or cfg["reps"]
    cfg["inductor_reps"] = inductor_reps or (reps if reps and quick else cfg["inductor_reps"])
    if systems:
        unknown = set(systems) - set(SYSTEMS)
        if unknown:
            raise SystemExit(f"unknown systems {sorted(unknown)}; choose of {sorted(SYSTEMS)}")
        cfg["first_call"] = tuple(s for s in SYSTEMS if s in systems and s in FIRST_CALL)
        cfg["steady"] = tuple(dict.fromkeys(["eager", *(s for s in SYSTEMS if s in systems),
                                             *(STATIC_OF[s] for s in systems if s in STATIC_OF)]))
    first: dict[str, list[dict[str, Any]]] = {s: [] for s in cfg["first_call"]}
    n_reps = {s: cfg["inductor_reps"] if uses_inductor(s) else cfg["reps"] for s in first}
    bar = common.Progress(sum(n_reps.values()) + 1, NAME, enabled=progress)
    with tempfile.TemporaryDirectory(prefix="efx-dynamic-bench-") as tmp:
        for rep in range(max(n_reps.values(), default=0)):
            order = [s for s in first if rep < n_reps[s]]
            random.Random(rep).shuffle(order)  # no system always runs first (or last) on a busy machine
            for system in order:
                spec = {"mode": "first", "system": system, "lengths": cfg["lengths"], "threads": threads}
                cache_dir = tempfile.mkdtemp(dir=tmp)
                first[system].append(common_child.run(__file__, spec, cache_dir, timeout=7200))
                bar.step(f"{system} first calls, repetition {rep + 1}")
        spec = {"mode": "steady", "systems": list(cfg["steady"]), "lengths": cfg["lengths"],
                "length": cfg["steady_length"], "budget_s": cfg["budget_s"], "threads": threads}
        steady = common_child.run(__file__, spec, tempfile.mkdtemp(dir=tmp), timeout=7200)
        bar.step("steady state")
    machine = common.machine_info()
    machine["torch_threads"] = threads
    data = {"benchmark": NAME, "machine": machine,
            "config": {"quick": quick, "lengths": cfg["lengths"], "batch": BATCH,
                       "steady_length": cfg["steady_length"], "reps": cfg["reps"],
                       "inductor_reps": cfg["inductor_reps"], "budget_s": cfg["budget_s"], "threads": threads,
                       "label": label, **common.effectfx_source(),
                       "tolerance": TOLERANCE, "model": "hf.build('gpt2'): 4 layers, hidden 64, vocab 100",
                       "first_call_systems": list(cfg["first_call"]), "steady_systems": list(cfg["steady"]),
                       "systems": {k: {"compiler": v[0], "backend": v[1], "dynamic": v[2], "label": v[3]}
                                   for k, v in SYSTEMS.items() if k in first or k in cfg["steady"]},
                       "captures": "effectfx: stats.compiles; torch.compile: dynamo counters['stats']"
                                   "['unique_graphs'] (graphs installed); backend_compiles: "
                                   "counters['aot_autograd']['total'] (restarted analyses included)"},
            "first_calls": first, "steady_state": steady}
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 lengths, eager / effectfx / torch.compile(aot_eager), short budget")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of every system's first calls")
    parser.add_argument("--inductor-reps", type=int, default=None, help="the same, for the Inductor systems")
    parser.add_argument("--systems", default=None, help=f"comma-separated, of {','.join(SYSTEMS)}")
    common.add_run_arguments(parser, budget=False)
    common.add_output_arguments(parser, NAME)
    args = parser.parse_args(argv)

    def child(spec: dict[str, Any]) -> dict[str, Any]:
        if spec["mode"] == "first":
            return first_calls(spec["system"], spec["lengths"], spec["threads"])
        return steady_state(spec["systems"], spec["lengths"], spec["length"], spec["budget_s"],
                            spec["threads"])

    def measure() -> dict[str, Any]:
        systems = args.systems.split(",") if args.systems else None
        return run(args.quick, args.reps, args.inductor_reps, systems, args.threads, not args.no_progress,
                   args.label)

    return common.dispatch(args, NAME, (summarize, table, plot), measure, child)


if __name__ == "__main__":
    sys.exit(main())
