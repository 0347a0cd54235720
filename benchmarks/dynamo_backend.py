"""effectfx behind ``torch.compile`` (benchmarks/README.md, "Behind torch.compile"): a GPT-2 training step
(``effectfx.testing.hf``'s config, 12 layers, random weights, every layer recording its name with
``efxtest::record_memory``; AdamW outside the compiled model) with the model compiled by
``torch.compile(backend="effectfx")`` (both lowerings), by torch.compile's ``inductor`` and ``aot_eager``,
and by effectfx's own frontend ``efx.compile(model)``, against eager -- first call, steady step, and the
effects each keeps.

Systems (``dynamo_backend_systems.SYSTEMS``; every one builds its own model and AdamW from the same seed):
``eager`` (the reference), ``efx_backend`` (``options={"backend": "eager"}``), ``efx_backend_inductor``
(``options={"backend": "inductor"}``), ``tc_inductor``, ``tc_aot_eager``, ``efx_compile``.

First call: the first ``calls`` steps in a fresh subprocess per system and repetition, with a fresh
``TORCHINDUCTOR_CACHE_DIR``, after the one-time costs every system pays alike (imports; a tiny
``torch.compile(backend="eager")``, whose first frame imports Dynamo; a tiny ``efx.compile``; two eager
steps of an unrelated model; for the Inductor systems a tiny ``torch.compile`` and
``efx.compile(backend="inductor")``), reported apart.  Each call is timed (wall; CPU of the process, or of
the process tree for the Inductor systems), its captures counted (effectfx's captures of every Dynamo
graph for the backend, ``stats.compiles`` for ``efx.compile``, dynamo's ``unique_graphs`` for torch.compile's
own backends), its effects counted, and the steps checked against eager's same steps in the same process
(effect log, losses, parameters, AdamW state).

Steady state: every system in one process, first ``check_steps`` steps checked against eager's, then steps
timed interleaved in shuffled rounds (``common.interleave``), medians and paired per-round ratios.

Run: ``python benchmarks/dynamo_backend.py [--quick] [--out DIR] [--reps R] [--layers L] [--systems a,b]``;
a full run writes ``results/dynamo_backend.json`` and ``.png`` (``--quick``: ``results/quick/``, 4 layers, no
Inductor system, well under a minute).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import effectfx as efx  # noqa: E402
from benchmarks import common, common_child  # noqa: E402
from benchmarks.dynamo_backend_report import plot, summarize, table  # noqa: E402
from benchmarks.dynamo_backend_systems import (  # noqa: E402
    LABELS,
    LR,
    SYSTEMS,
    TARGETS,
    System,
    batches,
    compare,
    state_of,
    uses_inductor,
)

NAME = "dynamo_backend"
FULL = {"reps": 3, "inductor_reps": 2, "calls": 3, "check_steps": 5, "budget_s": 40.0, "min_rounds": 10,
        "layers": 12, "systems": tuple(SYSTEMS)}
# a smoke run: no Inductor (its first calls take a minute or more each), a smaller model
QUICK = {"reps": 1, "inductor_reps": 1, "calls": 3, "check_steps": 3, "budget_s": 2.0, "min_rounds": 3,
         "layers": 4, "systems": ("eager", "efx_backend", "tc_aot_eager", "efx_compile")}


def warm_up(inductor: bool, size: int) -> float:
    """The one-time costs every system pays alike (module docstring); returns its seconds."""
    start = time.perf_counter()
    if inductor:
        common_child.warm_up_inductor()
    x = torch.randn(3, 5, requires_grad=True)
    torch.compile(lambda a: torch.cos(a) * 3, backend="eager")(x).sum().backward()
    efx.compile(lambda a: torch.sin(a) * 2)(x).sum().backward()
    throwaway = System("eager", layers=1, seed=1)
    common.run_steps(throwaway, batches(2, size))
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    common.freeze_heap()
    return time.perf_counter() - start


def first_calls(system: str, calls: int, size: int, layers: int, threads: int) -> dict[str, Any]:
    """The first ``calls`` steps of ``system`` in this (fresh) process, then eager's, compared."""
    common_child.quiet_transformers()
    torch.set_num_threads(threads)
    warmup_s = warm_up(uses_inductor(system), size)
    cpu_clock = common_child.tree_cpu_s if uses_inductor(system) else time.process_time
    data = batches(calls, size)
    s = System(system, layers)
    timed, losses, logs, error = common_child.timed_first_calls(s, data, cpu_clock)
    if error is not None:
        return {"status": error, "warmup_s": warmup_s, "calls": timed}
    ref = System("eager", layers)
    want_losses, want_logs = common.run_steps(ref, data)
    return {"status": "ok", "warmup_s": warmup_s,
            "cpu_clock": "process tree" if uses_inductor(system) else "process",
            "calls": timed, "captures": timed[-1]["captures"], "graphs": s.graphs(),
            "check": compare(state_of(s), state_of(ref), logs, want_logs, losses, want_losses)}


def steady_state(systems: list[str], check_steps: int, size: int, layers: int, threads: int, budget_s: float,
                 min_rounds: int) -> dict[str, Any]:
    """Every system checked over ``check_steps`` steps against eager's, then timed interleaved."""
    common_child.quiet_transformers()
    torch.set_num_threads(threads)
    data = batches(check_steps, size)
    ref = System("eager", layers)
    want_losses, want_logs = common.run_steps(ref, data)
    want = state_of(ref)
    status: dict[str, str] = {}
    checks: dict[str, dict[str, Any]] = {}
    built: dict[str, System] = {}
    for system in systems:
        start = time.perf_counter()
        try:
            s = System(system, layers)
            losses, logs = common.run_steps(s, data)
        except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
            status[system] = common.error_text(e)
            continue
        checks[system] = compare(state_of(s), want, logs, want_logs, losses, want_losses)
        checks[system].update({"captures_in_checks": s.captures(), "check_s": time.perf_counter() - start})
        status[system], built[system] = "ok", s
    before = {system: s.captures() for system, s in built.items()}
    effects: dict[str, set[int]] = {system: set() for system in built}
    cursor = {system: 0 for system in built}

    def stepper(system: str) -> Any:
        def step() -> None:
            _, log = built[system](data[cursor[system] % len(data)])
            cursor[system] += 1
            effects[system].add(len(log))
        return step

    wall, cpu, rounds, calls = common.interleave({s: stepper(s) for s in built}, budget_s, min_rounds)
    for system, s in built.items():  # nothing may have captured or compiled again while timing
        checks[system]["captures_while_timing"] = s.captures() - before[system]
        checks[system]["effects_per_step_timed"] = sorted(effects[system])
    return {"status": status, "checks": checks, "rounds": rounds, "calls_per_sample": calls,
            "step_ms": {k: common.median(v) * 1e3 for k, v in wall.items()},
            "step_cpu_ms": {k: common.median(v) * 1e3 for k, v in cpu.items()},
            "samples_ms": {k: [x * 1e3 for x in v] for k, v in wall.items()},
            "samples_cpu_ms": {k: [x * 1e3 for x in v] for k, v in cpu.items()}}


def run(quick: bool = False, reps: int | None = None, inductor_reps: int | None = None, size: int = 2,
        layers: int | None = None, systems: list[str] | None = None, threads: int = 1,
        budget_s: float | None = None, progress: bool = True, label: str | None = None) -> dict[str, Any]:
    cfg = dict(QUICK if quick else FULL)
    cfg["reps"] = reps or cfg["reps"]
    cfg["inductor_reps"] = inductor_reps or (reps if reps and quick else cfg["inductor_reps"])
    cfg["budget_s"] = budget_s if budget_s is not None else cfg["budget_s"]
    cfg["layers"] = layers or cfg["layers"]
    if systems:
        unknown = set(systems) - set(SYSTEMS)
        if unknown:
            raise SystemExit(f"unknown systems {sorted(unknown)}; choose of {sorted(SYSTEMS)}")
        cfg["systems"] = tuple(s for s in SYSTEMS if s in systems or s == "eager")
    chosen = list(cfg["systems"])
    n_reps = {s: cfg["inductor_reps"] if uses_inductor(s) else cfg["reps"] for s in chosen}
    bar = common.Progress(sum(n_reps.values()) + 1, NAME, enabled=progress)
    first: dict[str, list[dict[str, Any]]] = {s: [] for s in chosen}
    load = [list(os.getloadavg())]
    dirty = common.effectfx_dirty()
    with tempfile.TemporaryDirectory(prefix="efx-dynamo-backend-bench-") as tmp:
        for rep in range(max(n_reps.values())):
            order = [s for s in chosen if rep < n_reps[s]]
            random.Random(rep).shuffle(order)  # no system always runs first (or last) on a busy machine
            for system in order:
                spec = {"mode": "first", "system": system, "calls": cfg["calls"], "size": size,
                        "layers": cfg["layers"], "threads": threads}
                first[system].append(common_child.run(__file__, spec, tempfile.mkdtemp(dir=tmp)))
                bar.step(f"{system} first calls, repetition {rep + 1}")
        load.append(list(os.getloadavg()))
        spec = {"mode": "steady", "systems": chosen, "check_steps": cfg["check_steps"], "size": size,
                "layers": cfg["layers"], "threads": threads, "budget_s": cfg["budget_s"],
                "min_rounds": cfg["min_rounds"]}
        steady = common_child.run(__file__, spec, tempfile.mkdtemp(dir=tmp))
        bar.step("steady state")
    load.append(list(os.getloadavg()))
    from effectfx.testing import hf

    machine = {**common.machine_info(), "torch_threads": threads}
    machine["load_average_during"] = load  # (1, 5, 15 min) at the start, before the steady state, at the end
    return {"benchmark": NAME, "machine": machine,
            "config": {"label": label, **common.effectfx_source(), "effectfx_dirty": dirty, "quick": quick,
                       "reps": cfg["reps"], "inductor_reps": cfg["inductor_reps"], "calls": cfg["calls"],
                       "check_steps": cfg["check_steps"], "budget_s": cfg["budget_s"],
                       "min_rounds": cfg["min_rounds"], "threads": threads, "systems_run": chosen,
                       "systems": {s: {"how": str(SYSTEMS[s]), "label": LABELS[s]} for s in chosen},
                       "model": {"kind": "gpt2", "layers": cfg["layers"], "hidden": hf.HIDDEN,
                                 "heads": hf.HEADS, "vocab": hf.VOCAB, "batch": size, "length": 8},
                       "optimizer": {"kind": "AdamW", "lr": LR, "compiled": False},
                       "captures": "effectfx's backend: stats.compiles summed over the Dynamo graphs it was "
                                   "handed; efx.compile: stats.compiles; torch.compile: dynamo "
                                   "counters['stats']['unique_graphs']",
                       "targets": TARGETS},
            "first_call": first, "steady_state": steady}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="eager, efx_backend, tc_aot_eager, efx_compile (no Inductor), 4 layers, "
                             "short budget")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of every system's first calls")
    parser.add_argument("--inductor-reps", type=int, default=None,
                        help="the same, for efx_backend_inductor and tc_inductor")
    parser.add_argument("--batch", type=int, default=2, help="sequences per batch (8 tokens each)")
    parser.add_argument("--layers", type=int, default=None, help="GPT-2 layers (default 12; quick 4)")
    parser.add_argument("--systems", default=None, help=f"comma-separated, of {','.join(SYSTEMS)}")
    common.add_run_arguments(parser)
    common.add_output_arguments(parser, NAME)
    args = parser.parse_args(argv)

    def child(spec: dict[str, Any]) -> dict[str, Any]:
        if spec["mode"] == "first":
            return first_calls(spec["system"], spec["calls"], spec["size"], spec["layers"], spec["threads"])
        return steady_state(spec["systems"], spec["check_steps"], spec["size"], spec["layers"],
                            spec["threads"], spec["budget_s"], spec["min_rounds"])

    def measure() -> dict[str, Any]:
        systems = args.systems.split(",") if args.systems else None
        return run(args.quick, args.reps, args.inductor_reps, args.batch, args.layers, systems, args.threads,
                   args.budget, not args.no_progress, args.label)

    return common.dispatch(args, NAME, (summarize, table, plot), measure, child)


if __name__ == "__main__":
    sys.exit(main())
