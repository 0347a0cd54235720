"""A whole compiled training step (issue 27): GPT-2 (``effectfx.testing.hf``: 4 layers, hidden 64, random
weights, every layer a ``LoggedLayer`` region recording its name with ``efxtest::record_memory``) trained
with AdamW, the step -- forward, ``loss.backward()``, an effect, ``clip_grad_norm_``, ``opt.step()``,
``opt.zero_grad()``, a ``log_tensor`` of the loss -- run eagerly and compiled in several ways, side by side.

Systems (:data:`SYSTEMS`; every one builds its own model and AdamW from the same seed):

* ``eager``: the step, eagerly (the reference);
* ``efx_step``: ``efx.compile(step)`` (default backend): two captures, the first step (AdamW's state is made
  lazily) and one program for every later step;
* ``efx_model``: ``efx.compile(model)`` called inside an otherwise eager step (backward, clipping and the
  optimizer run eagerly);
* ``efx_step_inductor``: ``efx.compile(step, backend="inductor")``;
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
efx_model only, no Inductor or torch.compile, well under a minute).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import effectfx as efx  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import median  # noqa: E402

NAME = "train_step"
LR, CLIP = 1e-3, 1.0
# system -> (how it runs, layers logged and effect ops in the step)
SYSTEMS: dict[str, tuple[str, bool]] = {
    "eager": ("eager", True),
    "efx_step": ("efx_step", True),
    "efx_model": ("efx_model", True),
    "efx_step_inductor": ("efx_step_inductor", True),
    "eager_pure": ("eager", False),
    "tc_step": ("tc_step", False),
}
LABELS = {
    "eager": "eager step",
    "efx_step": "efx.compile(step)",
    "efx_model": "efx.compile(model) in an eager step",
    "efx_step_inductor": 'efx.compile(step, backend="inductor")',
    "eager_pure": "eager step, no effects",
    "tc_step": "torch.compile(step), no effects",
}
INDUCTOR = ("efx_step_inductor", "tc_step")
STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")
TARGETS = {"step_captures": 2, "step_over_efx_model": 1.0, "inductor_over_efx_model": 0.9}
FULL = {"reps": 3, "inductor_reps": 2, "calls": 3, "check_steps": 10, "budget_s": 40.0, "min_rounds": 10,
        "systems": tuple(SYSTEMS)}
# a smoke run: no Inductor, no torch.compile (their first calls take a minute or more each)
QUICK = {"reps": 1, "inductor_reps": 1, "calls": 3, "check_steps": 3, "budget_s": 2.0, "min_rounds": 3,
         "systems": ("eager", "efx_step", "efx_model")}


# -- the systems ---------------------------------------------------------------------------------------------
def reference_of(system: str) -> str:
    """The eager system ``system`` is checked and measured against: the same model, the same step."""
    return "eager" if SYSTEMS[system][1] else "eager_pure"


def uses_inductor(system: str) -> bool:
    return system in INDUCTOR


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer, forward: Callable[..., Any],
              logged: bool) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """The training step of issue 27 (without its two effect ops when not ``logged``)."""
    if logged:
        def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = forward(**batch).loss
            loss.backward()
            torch.ops.efxtest.record_memory("after backward")
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            torch.ops.efxtest.log_tensor(loss.detach(), "loss")
            return loss
    else:
        def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = forward(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            return loss

    return step


class System:
    """One system's model, optimizer, the step it calls and what counts its captures."""

    def __init__(self, system: str, seed: int = 0) -> None:
        from effectfx.testing import hf

        how, logged = SYSTEMS[system]
        self.name = system
        self.model = hf.build("gpt2", seed=seed, logged=logged)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        forward: Callable[..., Any] = self.model
        if how == "efx_model":
            forward = efx.compile(self.model)
        step = make_step(self.model, self.opt, forward, logged)
        if how == "efx_step":
            self.step = self.counted = efx.compile(step)
        elif how == "efx_step_inductor":
            self.step = self.counted = efx.compile(step, backend="inductor")
        elif how == "tc_step":
            self.step, self.counted = torch.compile(step), None
        else:
            self.step = step
            self.counted = forward if how == "efx_model" else None

    def captures(self) -> int:
        """Captures (effectfx), graphs compiled (torch.compile, since the counters were cleared), eager 0."""
        if self.counted is not None:
            return int(self.counted.stats.compiles)
        if SYSTEMS[self.name][0] == "tc_step":
            return dynamo_counts()["unique_graphs"]
        return 0

    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[float, list]:
        from effectfx.testing.effect_ops import recording

        with recording() as log:
            loss = self.step(batch)
        return float(loss.detach()), list(log)


def dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"frames_ok": int(counters["frames"]["ok"]), "frames_total": int(counters["frames"]["total"]),
            "unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def batches(n: int, size: int) -> list[dict[str, torch.Tensor]]:
    """``n`` training batches (``hf.batch("gpt2")``: ``size`` sequences of 8 tokens), seeded 0."""
    from effectfx.testing import hf

    g = torch.Generator().manual_seed(0)
    return [hf.batch("gpt2", g, size=size) for _ in range(n)]


def state_of(s: System) -> dict[str, Any]:
    """What the steps left behind: parameters, AdamW state, ``.grad``s (copies)."""
    names = [n for n, _ in s.model.named_parameters()]
    params = [p.detach().clone() for p in s.model.parameters()]
    state = [{k: s.opt.state[p][k].detach().clone() for k in STATE_KEYS if k in s.opt.state[p]}
             if p in s.opt.state else {} for p in s.model.parameters()]
    grads_none = all(p.grad is None for p in s.model.parameters())
    return {"names": names, "params": params, "state": state, "grads_none": grads_none}


def compare(got: dict[str, Any], want: dict[str, Any], logs: list[list], want_logs: list[list],
            losses: list[float], want_losses: list[float]) -> dict[str, Any]:
    """Effects, losses, parameters and AdamW state of a system against its reference after the same steps."""
    diffs = [float((a - b).abs().max()) for a, b in zip(got["params"], want["params"])]
    worst = max(range(len(diffs)), key=diffs.__getitem__) if diffs else None
    rel = [float(((a - b).abs() / b.abs().clamp_min(1e-3)).max())
           for a, b in zip(got["params"], want["params"])]
    state: dict[str, float | None] = {}
    for k in STATE_KEYS:
        pairs = [(a[k], b[k]) for a, b in zip(got["state"], want["state"]) if k in a and k in b]
        state[k] = max((float((x.float() - y.float()).abs().max()) for x, y in pairs), default=None)
    state_complete = all(set(a) == set(b) for a, b in zip(got["state"], want["state"]))
    return {
        "steps": len(logs), "effects_equal_eager": logs == want_logs,
        "effects_per_step": sorted({len(x) for x in logs}), "eager_effects_per_step": sorted(
            {len(x) for x in want_logs}),
        "losses": losses,
        "max_loss_diff": max((abs(a - b) for a, b in zip(losses, want_losses)), default=None),
        "max_param_diff": max(diffs, default=None),
        "max_param_diff_at": got["names"][worst] if worst is not None else None,
        "max_param_rel_diff": max(rel, default=None),
        "max_state_diff": state, "state_keys_equal": state_complete,
        "params": len(diffs), "grads_none": got["grads_none"], "eager_grads_none": want["grads_none"]}


def run_steps(s: System, data: list[dict[str, torch.Tensor]]) -> tuple[list[float], list[list]]:
    losses, logs = [], []
    for batch in data:
        loss, log = s(batch)
        losses.append(loss)
        logs.append(log)
    return losses, logs


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()


# -- the first calls, in a subprocess ------------------------------------------------------------------------
def warm_up(inductor: bool, size: int) -> float:
    """The one-time costs every system pays alike (module docstring); returns its seconds."""
    start = time.perf_counter()
    if inductor:
        from benchmarks.inductor import _warm_up as inductor_warm_up

        inductor_warm_up()  # a tiny torch.compile and efx.compile(backend="inductor")
    x = torch.randn(3, 5, requires_grad=True)
    efx.compile(lambda a: torch.sin(a) * 2)(x).sum().backward()
    throwaway = System("eager", seed=1)
    run_steps(throwaway, batches(2, size))
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    common.freeze_heap()
    return time.perf_counter() - start


def first_calls(system: str, calls: int, size: int, threads: int) -> dict[str, Any]:
    """The first ``calls`` steps of ``system`` in this (fresh) process, then its reference's, compared."""
    from benchmarks.inductor import tree_cpu_s

    _quiet()
    torch.set_num_threads(threads)
    warmup_s = warm_up(uses_inductor(system), size)
    cpu_clock = tree_cpu_s if uses_inductor(system) else time.process_time
    data = batches(calls, size)
    s = System(system)
    timed, losses, logs = [], [], []
    for batch in data:
        gc.collect()
        cpu, wall = cpu_clock(), time.perf_counter()
        try:
            loss, log = s(batch)
        except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
            return {"status": f"{type(e).__name__}: {str(e)[:300]}", "warmup_s": warmup_s, "calls": timed}
        wall, cpu = time.perf_counter() - wall, cpu_clock() - cpu
        timed.append({"wall_s": wall, "cpu_s": cpu, "captures": s.captures(), "effects": len(log)})
        losses.append(loss)
        logs.append(log)
    got = state_of(s)
    ref = System(reference_of(system))
    want_losses, want_logs = run_steps(ref, data)
    result: dict[str, Any] = {
        "status": "ok", "warmup_s": warmup_s,
        "cpu_clock": "process tree" if uses_inductor(system) else "process",
        "calls": timed, "captures": timed[-1]["captures"],
        "check": compare(got, state_of(ref), logs, want_logs, losses, want_losses)}
    if s.counted is not None:
        result["capture_seconds"] = list(s.counted.stats.compile_seconds)
    if SYSTEMS[system][0] == "tc_step":
        result["dynamo"] = dynamo_counts()
    return result


def _child(spec: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=3600)
    except subprocess.TimeoutExpired:
        return {"status": "child timed out after 3600 s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"status": f"child failed (exit {proc.returncode}): {proc.stderr[-500:]}"}


# -- the steady state, in one process ------------------------------------------------------------------------
def steady_state(systems: list[str], check_steps: int, size: int, threads: int, budget_s: float,
                 min_rounds: int) -> dict[str, Any]:
    """Every system checked over ``check_steps`` steps against its reference, then timed interleaved."""
    _quiet()
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
            losses, logs = run_steps(s, data)
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
              "step_ms": {k: median(v) * 1e3 for k, v in samples.items()},
              "step_cpu_ms": {k: median(v) * 1e3 for k, v in cpu.items()},
              "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()},
              "samples_cpu_ms": {k: [x * 1e3 for x in v] for k, v in cpu.items()}}
    if "tc_step" in built:
        result["dynamo"] = dynamo_counts()
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
    dirty = _dirty()  # before the children import effectfx (the tree may change while they run)
    with tempfile.TemporaryDirectory(prefix="efx-train-step-bench-") as tmp:
        for rep in range(max(n_reps.values())):
            order = [s for s in chosen if rep < n_reps[s]]
            random.Random(rep).shuffle(order)  # no system always runs first (or last) on a busy machine
            for system in order:
                spec = {"mode": "first", "system": system, "calls": cfg["calls"], "size": size,
                        "threads": threads}
                first[system].append(_child(spec, tempfile.mkdtemp(dir=tmp)))
                bar.step(f"{system} first calls, repetition {rep + 1}")
        load.append(list(os.getloadavg()))
        spec = {"mode": "steady", "systems": chosen, "check_steps": cfg["check_steps"], "size": size,
                "threads": threads, "budget_s": cfg["budget_s"], "min_rounds": cfg["min_rounds"]}
        steady = _child(spec, tempfile.mkdtemp(dir=tmp))
        bar.step("steady state")
    load.append(list(os.getloadavg()))
    from effectfx.testing import hf

    machine = {**common.machine_info(), "torch_threads": threads}
    machine["load_average_during"] = load  # (1, 5, 15 min) at the start, before the steady state, at the end
    data = {"benchmark": NAME, "machine": machine,
            "config": {"label": label, "effectfx_path": str(Path(efx.__file__).parent),
                       "effectfx_dirty": dirty, "quick": quick, "reps": cfg["reps"],
                       "inductor_reps": cfg["inductor_reps"], "calls": cfg["calls"],
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


def _dirty() -> bool | None:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "effectfx"], cwd=common.ROOT,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


# -- the summary, the table, the figure ----------------------------------------------------------------------
def _median_of(values: list[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return median(v) if v else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _paired(samples: dict[str, list[float]], system: str, other: str) -> dict[str, float] | None:
    """Median and quartiles of the per-round ratio ``system / other`` (one sample of each per round)."""
    a, b = samples.get(system), samples.get(other)
    if system == other or not a or not b or len(a) != len(b):
        return None
    ratios = sorted(x / y for x, y in zip(a, b))
    return {"median": median(ratios), "q1": ratios[len(ratios) // 4], "q3": ratios[(3 * len(ratios)) // 4]}


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per system: first calls, captures, the steady step, its ratios, the checks; each target's verdict."""
    first, steady = data["first_call"], data["steady_state"]
    step, step_cpu = steady.get("step_ms", {}), steady.get("step_cpu_ms", {})
    samples = steady.get("samples_ms", {})
    out: dict[str, Any] = {}
    for system in data["config"]["systems_run"]:
        runs = first.get(system, [])
        ok = [r for r in runs if r.get("status") == "ok"]
        check = steady.get("checks", {}).get(system, {})
        checks = [r["check"] for r in ok] + ([check] if check.get("steps") else [])
        steady_status = steady.get("status", {}).get(system)
        ncalls = data["config"]["calls"]
        call = [{k: _median_of([r["calls"][i][k] for r in ok if len(r["calls"]) > i])
                 for k in ("wall_s", "cpu_s")} for i in range(ncalls)]
        ref = reference_of(system)
        s: dict[str, Any] = {
            "label": LABELS[system], "reference": ref,
            "first_s": call[0]["wall_s"], "first_cpu_s": call[0]["cpu_s"],
            "calls_s": [c["wall_s"] for c in call], "calls_cpu_s": [c["cpu_s"] for c in call],
            "warmup_s": _median_of([r.get("warmup_s") for r in ok]),
            "captures": sorted({r["captures"] for r in ok}),
            "captures_per_call": sorted({tuple(c["captures"] for c in r["calls"]) for r in ok}),
            "captures_in_checks": check.get("captures_in_checks"),
            "captures_while_timing": check.get("captures_while_timing"),
            "first_ok_runs": len(ok), "first_runs": len(runs),
            "failure": next((r["status"] for r in runs if r.get("status") != "ok"), None) or (
                steady_status if steady_status != "ok" else None),
            "effects_equal_eager": bool(checks) and all(c["effects_equal_eager"] for c in checks) and (
                check.get("effects_per_step_timed", [None]) == check.get("eager_effects_per_step", [None])),
            "effects_per_step": sorted({n for c in checks for n in c["effects_per_step"]}),
            "max_loss_diff": max((c["max_loss_diff"] for c in checks if c["max_loss_diff"] is not None),
                                 default=None),
            "max_param_diff": check.get("max_param_diff"),
            "max_param_diff_at": check.get("max_param_diff_at"),
            "max_param_rel_diff": check.get("max_param_rel_diff"),
            "max_state_diff": check.get("max_state_diff"),
            "first_calls_max_param_diff": max((r["check"]["max_param_diff"] for r in ok
                                               if r["check"]["max_param_diff"] is not None), default=None),
            "grads_none": bool(checks) and all(c["grads_none"] == c["eager_grads_none"] for c in checks),
            "check_steps": check.get("steps"),
            "step_ms": step.get(system), "step_cpu_ms": step_cpu.get(system)}
        for other, key in ((ref, "eager"), ("efx_model", "efx_model"), ("tc_step", "tc")):
            mine = other != system
            s[f"over_{key}"] = _div(step.get(system), step.get(other)) if mine else None
            s[f"cpu_over_{key}"] = _div(step_cpu.get(system), step_cpu.get(other)) if mine else None
            s[f"paired_over_{key}"] = _paired(samples, system, other)
        s["first_over_eager"] = _div(s["first_s"], _median_of(
            [r["calls"][0]["wall_s"] for r in first.get(ref, []) if r.get("status") == "ok"]))
        out[system] = s
    targets: dict[str, Any] = {}
    if "efx_step" in out:
        c = out["efx_step"]["captures"]
        targets["step_captures"] = {"target": f"== {TARGETS['step_captures']}", "value": c,
                                    "met": bool(c) and set(c) == {TARGETS["step_captures"]}
                                    and out["efx_step"]["captures_in_checks"] == TARGETS["step_captures"]}
    for system, name in (("efx_step", "step_over_efx_model"),
                         ("efx_step_inductor", "inductor_over_efx_model")):
        if system in out and out[system]["over_efx_model"] is not None:
            ratio = out[system]["over_efx_model"]
            targets[name] = {"target": f"<= {TARGETS[name]}x", "value": ratio,
                             "cpu": out[system]["cpu_over_efx_model"],
                             "paired": out[system]["paired_over_efx_model"], "met": ratio <= TARGETS[name]}
    return {"systems": out, "targets": targets}


def _f(v: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def _e(v: float | None) -> str:
    return "-" if v is None else f"{v:.1e}"


def table(data: dict[str, Any]) -> str:
    summary = data["summary"]["systems"]
    rows = []
    for system, s in summary.items():
        state = s["max_state_diff"] or {}
        calls = " / ".join(_f(x, "", 3) for x in s["calls_s"][1:])
        rows.append([
            system, ",".join(str(c) for c in s["captures"]) or "-",
            f"{_f(s['first_s'], ' s')} / {_f(s['first_cpu_s'], ' s')}", calls,
            f"{_f(s['step_ms'], '', 2)} / {_f(s['step_cpu_ms'], '', 2)}",
            _f(s["over_eager"], "x"), _f(s["over_efx_model"], "x"), _f(s["over_tc"], "x"),
            ("same" if s["effects_equal_eager"] else "DIFFER")
            + f" ({'/'.join(map(str, s['effects_per_step']))})",
            _e(s["max_loss_diff"]), _e(s["max_param_diff"]),
            " / ".join(_e(state.get(k)) for k in STATE_KEYS), (s["failure"] or "")[:60]])
    cfg, st = data["config"], data["steady_state"]
    head = f"{cfg['label']}: " if cfg.get("label") else ""
    m = data["machine"]
    load = ", ".join(f"{x:.2f}" for x in m["load_average"])
    text = [head + f"GPT-2 ({cfg['model']['layers']} layers, hidden {cfg['model']['hidden']}), AdamW "
            f"training step, batch {cfg['model']['batch']} x 8 tokens, {m['torch_threads']} thread(s); first "
            f"call: median of {cfg['reps']} fresh processes ({cfg['inductor_reps']} for Inductor and "
            f"torch.compile); steady: medians of {st.get('rounds', 0)} interleaved rounds (ms per step); "
            f"checks after {cfg['check_steps']} steps vs eager (eager_pure for tc_step); load average {load}",
            common.format_table(["system", "captures", "first call wall / CPU", "calls 2 / 3 s",
                                 "step ms wall / CPU", "/eager", "/efx_model", "/tc_step",
                                 "effects (per step)", "max |dloss|", "max |dparam|",
                                 "max |dstate| m / v / step", "failure"], rows)]
    targets = data["summary"]["targets"]
    if targets:
        text += ["", "targets:"]
        for name, t in targets.items():
            value = t["value"]
            if isinstance(value, float):
                paired = t.get("paired") or {}
                value = f"{value:.3f}x (CPU {_f(t['cpu'], 'x', 3)}" + (
                    f"; per-round median {paired['median']:.3f}x, IQR {paired['q1']:.3f}-{paired['q3']:.3f}x)"
                    if paired else ")")
            text.append(f"  {name}: {t['target']}: {value} -> {'met' if t['met'] else 'NOT met'}")
    return "\n".join(text)


COLORS = {"eager": "C7", "efx_step": "C0", "efx_model": "C2", "efx_step_inductor": "C9", "tc_step": "C3"}


def plot(data: dict[str, Any], path: Path) -> Path:
    """First calls per system (log scale: call 1 and call 2, captures annotated) and the steady step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data["summary"]["systems"]
    names = [s for s in summary if summary[s]["first_s"] is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    xs = list(range(len(names)))
    w = 0.38
    colors = [COLORS[SYSTEMS[s][0]] for s in names]
    left.bar([x - w / 2 for x in xs], [summary[s]["calls_s"][0] for s in names], w, color=colors,
             label="call 1")
    left.bar([x + w / 2 for x in xs], [summary[s]["calls_s"][1] or 0 for s in names], w, color=colors,
             alpha=0.5, label="call 2")
    left.scatter([x - w / 2 for x in xs], [summary[s]["first_cpu_s"] or float("nan") for s in names],
                 marker="_", s=80, color="k", zorder=5, label="CPU time, call 1")
    for x, s in zip(xs, names):
        c = summary[s]["captures_per_call"]
        note = "\n".join("captures " + ",".join(map(str, t)) for t in c) if SYSTEMS[s][0] != "eager" else ""
        left.annotate(note, (x, max(summary[s]["first_s"], summary[s]["first_cpu_s"] or 0) * 1.15),
                      ha="center", va="bottom", fontsize=6)
    left.set_yscale("log")
    left.set_ylim(top=left.get_ylim()[1] * 6)
    left.set_ylabel("s (median wall, log scale)")
    left.set_title("first training steps (fresh process; captures after calls 1,2,3)", fontsize=10)
    steady = [s for s in summary if summary[s]["step_ms"] is not None]
    xs2 = list(range(len(steady)))
    right.bar(xs2, [summary[s]["step_ms"] for s in steady], color=[COLORS[SYSTEMS[s][0]] for s in steady],
              label="wall (median)")
    right.scatter(xs2, [summary[s]["step_cpu_ms"] for s in steady], marker="_", s=80, color="k", zorder=5,
                  label="CPU (median)")
    base = summary.get("efx_model", {}).get("step_ms")
    if base:
        for ratio, style in ((TARGETS["step_over_efx_model"], "--"),
                             (TARGETS["inductor_over_efx_model"], ":")):
            right.axhline(base * ratio, color="C2", linestyle=style, linewidth=0.8,
                          label=f"{ratio}x efx_model (target)")
    for x, s in zip(xs2, steady):
        r, m = summary[s]["over_eager"], summary[s]["over_efx_model"]
        note = "\n".join(t for t in (f"{r:.2f}x eager" if r is not None else "",
                                     f"{m:.2f}x efx_model" if m is not None else "") if t)
        if summary[s]["effects_per_step"] and not summary[s]["effects_equal_eager"]:
            note += "\neffects differ"
        right.annotate(note, (x, summary[s]["step_ms"] * 1.02), ha="center", va="bottom", fontsize=6)
    right.set_ylabel("ms per training step (median)")
    right.set_ylim(top=right.get_ylim()[1] * 1.2)
    right.set_title("steady training step (interleaved rounds)", fontsize=10)
    for ax, labels, where in ((left, names, "upper left"), (right, steady, "upper right")):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.legend(fontsize=7, loc=where)
        ax.grid(True, axis="y", alpha=0.3)
    threads = data["machine"]["torch_threads"]
    return common.save_figure(fig, f"AdamW training step, GPT-2 (4 layers), {threads} thread(s)", data, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="eager, efx_step, efx_model only (no Inductor, no torch.compile), short budget")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of every system's first calls")
    parser.add_argument("--inductor-reps", type=int, default=None,
                        help="the same, for efx_step_inductor and tc_step")
    parser.add_argument("--batch", type=int, default=2, help="sequences per batch (8 tokens each)")
    parser.add_argument("--systems", default=None, help=f"comma-separated, of {','.join(SYSTEMS)}")
    parser.add_argument("--threads", type=int, default=1, help="torch threads while measuring")
    parser.add_argument("--budget", type=float, default=None, help="seconds of steady-state rounds")
    parser.add_argument("--out", type=Path, default=None,
                        help="where train_step.json goes (default: results/, or results/quick/ with --quick)")
    parser.add_argument("--plot-only", type=Path, default=None, metavar="JSON",
                        help="redraw the table and PNG (next to JSON) from a run's JSON; no measuring")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--label", default=None, help="a note on the run, kept in the JSON")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plot_only is not None:
        data = json.loads(args.plot_only.read_text())
        data["summary"] = summarize(data)
        print(table(data))
        print("wrote", common.replace_atomically(args.plot_only.with_suffix(".png"), lambda p: plot(data, p)))
        return 0
    if args.child:
        spec = json.loads(args.child)
        if spec["mode"] == "first":
            result = first_calls(spec["system"], spec["calls"], spec["size"], spec["threads"])
        else:
            result = steady_state(spec["systems"], spec["check_steps"], spec["size"], spec["threads"],
                                  spec["budget_s"], spec["min_rounds"])
        print(json.dumps(result, default=str))
        return 0
    systems = args.systems.split(",") if args.systems else None
    data = run(args.quick, args.reps, args.inductor_reps, args.batch, systems, args.threads, args.budget,
               not args.no_progress, args.label)
    out = common.output_dir(args.out, args.quick)
    common.write_json(data, out, NAME)  # the measurements first, whatever the summary does
    data["summary"] = summarize(data)
    path = common.write_json(data, out, NAME)
    print(table(data))
    print(f"\nwrote {path}")
    print("wrote", common.replace_atomically(out / f"{NAME}.png", lambda p: plot(data, p)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
