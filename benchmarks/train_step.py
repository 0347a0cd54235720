"""A whole compiled training step (benchmarks/README.md, "Compiled training step"): GPT-2
(``effectfx.testing.hf``: 4 layers, hidden 64, random weights, every layer a ``LoggedLayer`` region
recording its name with ``efxtest::record_memory``) trained with AdamW, the step -- forward,
``loss.backward()``, an effect, ``clip_grad_norm_``, ``opt.step()``, ``opt.zero_grad()``, a ``log_tensor``
of the loss -- run eagerly and compiled in several ways, side by side.

Systems (:data:`SYSTEMS`; every one builds its own model and AdamW from the same seed):

* ``eager``: the step, eagerly (the reference);
* ``efx_step``: ``efx.compile(step)`` (default backend): two captures, the first step (AdamW's state is made
  lazily) and one program for every later step;
* ``efx_model``: ``efx.compile(model)`` called inside an otherwise eager step (backward, clipping and the
  optimizer run eagerly);
* ``efx_step_inductor``: ``efx.compile(step, backend="inductor")``;
* ``efx_step_cosine``, ``eager_cosine``: ``efx.compile(step)`` and the eager step with a new Python float
  ``param_groups[0]["lr"]`` before every step (nanoGPT's cosine decay): the lr is an input after its first
  change (Note [Float inputs]), so the step costs two captures and the time of a constant-lr step;
* ``tc_step``, ``eager_pure``: ``torch.compile(step)`` (Inductor) of the model built with
  ``hf.build("gpt2", logged=False)`` and a step without effect ops (torch.compile drops the ops effectfx
  knows and it does not: its effect-free run is the fair comparison), and that step eagerly, its reference.

First call: the first ``calls`` steps (3: the two captures, then a steady one) in a fresh subprocess per
system and repetition, with a fresh ``TORCHINDUCTOR_CACHE_DIR``, after the one-time costs every system pays
alike (imports; two eager steps of an unrelated model; a tiny ``efx.compile``; for the Inductor systems a
tiny ``torch.compile`` and ``efx.compile(backend="inductor")``, as ``inductor.py``), reported apart.  Each
call is timed (wall; CPU of the process, or of the process tree with Inductor's compile workers for the
Inductor systems), the captures counted after it (``stats.compiles`` of the compiled step or model for
effectfx, dynamo's ``counters["stats"]["unique_graphs"]`` for torch.compile), and the calls' effect logs,
losses, parameters and AdamW state checked against the reference's same steps in the same process.

Steady state: every system in one process, each first running ``check_steps`` steps on a cycle of seeded
batches, compared with its reference after them (effect log of every step, losses, max abs difference of the
parameters and of AdamW's ``exp_avg`` / ``exp_avg_sq`` / ``step``); then steps timed interleaved in shuffled
rounds (one sample per system per round, of >= 20 ms of steps), medians, and paired per-round ratios.

Run: ``python benchmarks/train_step.py [--quick] [--out DIR] [--reps R] [--batch B] [--systems a,b]``; a full
run writes ``results/train_step.json`` and ``.png`` (``--quick``: ``results/quick/``, eager / efx_step /
efx_model and the cosine pair only, no Inductor or torch.compile, well under a minute).
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
from benchmarks.train_step_report import plot, summarize, table  # noqa: E402
from benchmarks.train_step_systems import (  # noqa: E402
    CLIP,
    LABELS,
    LR,
    SYSTEMS,
    TARGETS,
    System,
    batches,
    compare,
    reference_of,
    state_of,
    uses_inductor,
)

NAME = "train_step"
FULL = {"reps": 3, "inductor_reps": 2, "calls": 3, "check_steps": 10, "budget_s": 40.0, "min_rounds": 10,
        "systems": tuple(SYSTEMS)}
# a smoke run: no Inductor, no torch.compile (their first calls take a minute or more each)
QUICK = {"reps": 1, "inductor_reps": 1, "calls": 3, "check_steps": 3, "budget_s": 2.0, "min_rounds": 3,
         "systems": ("eager", "efx_step", "efx_model", "eager_cosine", "efx_step_cosine")}


# -- the first calls, in a subprocess ------------------------------------------------------------------------
def warm_up(inductor: bool, size: int) -> float:
    """The one-time costs every system pays alike (module docstring); returns its seconds."""
    start = time.perf_counter()
    if inductor:
        common_child.warm_up_inductor()  # a tiny torch.compile and efx.compile(backend="inductor")
    x = torch.randn(3, 5, requires_grad=True)
    efx.compile(lambda a: torch.sin(a) * 2)(x).sum().backward()
    throwaway = System("eager", seed=1)
    common.run_steps(throwaway, batches(2, size))
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    common.freeze_heap()
    return time.perf_counter() - start


def first_calls(system: str, calls: int, size: int, threads: int) -> dict[str, Any]:
    """The first ``calls`` steps of ``system`` in this (fresh) process, then its reference's, compared."""
    common_child.quiet_transformers()
    torch.set_num_threads(threads)
    warmup_s = warm_up(uses_inductor(system), size)
    cpu_clock = common_child.tree_cpu_s if uses_inductor(system) else time.process_time
    data = batches(calls, size)
    s = System(system)
    timed, losses, logs, error = common_child.timed_first_calls(s, data, cpu_clock)
    if error is not None:
        return {"status": error, "warmup_s": warmup_s, "calls": timed}
    got = state_of(s)
    ref = System(reference_of(system))
    want_losses, want_logs = common.run_steps(ref, data)
    result: dict[str, Any] = {
        "status": "ok", "warmup_s": warmup_s,
        "cpu_clock": "process tree" if uses_inductor(system) else "process",
        "calls": timed, "captures": timed[-1]["captures"],
        "check": compare(got, state_of(ref), logs, want_logs, losses, want_losses)}
    if s.counted is not None:
        result["capture_seconds"] = list(s.counted.stats.compile_seconds)
    if SYSTEMS[system][0] == "tc_step":
        result["dynamo"] = common.dynamo_counts()
    return result


# -- the steady state, in one process ------------------------------------------------------------------------
def steady_state(systems: list[str], check_steps: int, size: int, threads: int, budget_s: float,
                 min_rounds: int) -> dict[str, Any]:
    """Every system checked over ``check_steps`` steps against its reference, then timed interleaved."""
    common_child.quiet_transformers()
    torch.set_num_threads(threads)
    data = batches(check_steps, size)
    # references first; torch.compile last (its graphs would guard on effectfx's thread-local state)
    order = sorted(systems, key=lambda s: (s != reference_of(s), uses_inductor(s),
                                           SYSTEMS[s][0] == "tc_step"))
    status: dict[str, str] = {}
    checks: dict[str, dict[str, Any]] = {}
    built: dict[str, System] = {}
    reference: dict[str, tuple[dict[str, Any], list[float], list[list]]] = {}
    for system in order:
        start = time.perf_counter()
        try:
            s = System(system)
            losses, logs = common.run_steps(s, data)
        except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
            status[system] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        got = state_of(s)
        if system == reference_of(system):
            reference[system] = (got, losses, logs)
        want = reference.get(reference_of(system))
        checks[system] = compare(got, want[0], logs, want[2], losses, want[1]) if want else {}
        checks[system].update({"captures_in_checks": s.captures(), "check_s": time.perf_counter() - start})
        status[system] = "ok"
        built[system] = s
    calls = {}
    for system, s in built.items():  # steps per sample: at least 20 ms
        t = time.perf_counter()
        s(data[0])
        calls[system] = max(1, int(0.02 / max(time.perf_counter() - t, 1e-6)))
    before = {system: s.captures() for system, s in built.items()}
    common.freeze_heap()
    samples: dict[str, list[float]] = {system: [] for system in built}
    cpu: dict[str, list[float]] = {system: [] for system in built}
    effects: dict[str, set[int]] = {system: set() for system in built}
    end, rounds, k = time.perf_counter() + budget_s, 0, 0
    while time.perf_counter() < end or rounds < min_rounds:
        order = list(built)
        random.shuffle(order)
        for system in order:
            s, n = built[system], calls[system]
            common.quiet_gc()
            t, c = time.perf_counter(), time.process_time()
            for i in range(n):
                _, log = s(data[(k + i) % len(data)])
                effects[system].add(len(log))
            samples[system].append((time.perf_counter() - t) / n)
            cpu[system].append((time.process_time() - c) / n)
        k += 1
        rounds += 1
    for system, s in built.items():  # nothing may have captured or compiled again while timing
        checks[system]["captures_while_timing"] = s.captures() - before[system]
        checks[system]["effects_per_step_timed"] = sorted(effects[system])
    result = {"status": status, "checks": checks, "rounds": rounds, "calls_per_sample": calls,
              "step_ms": {k: common.median(v) * 1e3 for k, v in samples.items()},
              "step_cpu_ms": {k: common.median(v) * 1e3 for k, v in cpu.items()},
              "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()},
              "samples_cpu_ms": {k: [x * 1e3 for x in v] for k, v in cpu.items()}}
    if "tc_step" in built:
        result["dynamo"] = common.dynamo_counts()
    return result


# -- the whole run -------------------------------------------------------------------------------------------
def run(quick: bool = False, reps: int | None = None, inductor_reps: int | None = None, size: int = 2,
        systems: list[str] | None = None, threads: int = 1, budget_s: float | None = None,
        progress: bool = True, label: str | None = None) -> dict[str, Any]:
    cfg = dict(QUICK if quick else FULL)
    cfg["reps"] = reps or cfg["reps"]
    cfg["inductor_reps"] = inductor_reps or (reps if reps and quick else cfg["inductor_reps"])
    cfg["budget_s"] = budget_s if budget_s is not None else cfg["budget_s"]
    if systems:
        unknown = set(systems) - set(SYSTEMS)
        if unknown:
            raise SystemExit(f"unknown systems {sorted(unknown)}; choose of {sorted(SYSTEMS)}")
        cfg["systems"] = tuple(s for s in SYSTEMS if s in systems or s in {reference_of(x) for x in systems})
    chosen = list(cfg["systems"])
    n_reps = {s: cfg["inductor_reps"] if uses_inductor(s) else cfg["reps"] for s in chosen}
    bar = common.Progress(sum(n_reps.values()) + 1, NAME, enabled=progress)
    first: dict[str, list[dict[str, Any]]] = {s: [] for s in chosen}
    load = [list(os.getloadavg())]
    dirty = common.effectfx_dirty()  # before the children import effectfx (the tree may change meanwhile)
    with tempfile.TemporaryDirectory(prefix="efx-train-step-bench-") as tmp:
        for rep in range(max(n_reps.values())):
            order = [s for s in chosen if rep < n_reps[s]]
            random.Random(rep).shuffle(order)  # no system always runs first (or last) on a busy machine
            for system in order:
                spec = {"mode": "first", "system": system, "calls": cfg["calls"], "size": size,
                        "threads": threads}
                first[system].append(common_child.run(__file__, spec, tempfile.mkdtemp(dir=tmp)))
                bar.step(f"{system} first calls, repetition {rep + 1}")
        load.append(list(os.getloadavg()))
        spec = {"mode": "steady", "systems": chosen, "check_steps": cfg["check_steps"], "size": size,
                "threads": threads, "budget_s": cfg["budget_s"], "min_rounds": cfg["min_rounds"]}
        steady = common_child.run(__file__, spec, tempfile.mkdtemp(dir=tmp))
        bar.step("steady state")
    load.append(list(os.getloadavg()))
    from effectfx.testing import hf

    machine = {**common.machine_info(), "torch_threads": threads}
    machine["load_average_during"] = load  # (1, 5, 15 min) at the start, before the steady state, at the end
    data = {"benchmark": NAME, "machine": machine,
            "config": {"label": label, **common.effectfx_source(), "effectfx_dirty": dirty, "quick": quick,
                       "reps": cfg["reps"], "inductor_reps": cfg["inductor_reps"], "calls": cfg["calls"],
                       "check_steps": cfg["check_steps"], "budget_s": cfg["budget_s"],
                       "min_rounds": cfg["min_rounds"], "threads": threads, "systems_run": chosen,
                       "systems": {s: {"how": SYSTEMS[s][0], "logged": SYSTEMS[s][1], "label": LABELS[s]}
                                   for s in chosen},
                       "model": {"kind": "gpt2", "layers": hf.LAYERS, "hidden": hf.HIDDEN, "heads": hf.HEADS,
                                 "vocab": hf.VOCAB, "batch": size, "length": 8},
                       "optimizer": {"kind": "AdamW", "lr": LR, "clip_grad_norm": CLIP},
                       "captures": "effectfx: stats.compiles of the compiled step (efx_model: of the "
                                   "compiled model); torch.compile: dynamo counters['stats']"
                                   "['unique_graphs']",
                       "targets": TARGETS},
            "first_call": first, "steady_state": steady}
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="eager, efx_step, efx_model, the cosine pair (no Inductor, no torch.compile), "
                             "short budget")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of every system's first calls")
    parser.add_argument("--inductor-reps", type=int, default=None,
                        help="the same, for efx_step_inductor and tc_step")
    parser.add_argument("--batch", type=int, default=2, help="sequences per batch (8 tokens each)")
    parser.add_argument("--systems", default=None, help=f"comma-separated, of {','.join(SYSTEMS)}")
    common.add_run_arguments(parser)
    common.add_output_arguments(parser, NAME)
    args = parser.parse_args(argv)

    def child(spec: dict[str, Any]) -> dict[str, Any]:
        if spec["mode"] == "first":
            return first_calls(spec["system"], spec["calls"], spec["size"], spec["threads"])
        return steady_state(spec["systems"], spec["check_steps"], spec["size"], spec["threads"],
                            spec["budget_s"], spec["min_rounds"])

    def measure() -> dict[str, Any]:
        systems = args.systems.split(",") if args.systems else None
        return run(args.quick, args.reps, args.inductor_reps, args.batch, systems, args.threads, args.budget,
                   not args.no_progress, args.label)

    return common.dispatch(args, NAME, (summarize, table, plot), measure, child)


if __name__ == "__main__":
    sys.exit(main())
