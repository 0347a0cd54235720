"""A ResNet's first call and training step: eager vs efx.compile vs torch.compile(aot_eager), in one run.

The model is ``transformers``' ``ResNetForImageClassification`` built from a small config with random
weights (nothing is downloaded), in training mode, so every BatchNorm updates its running statistics.
Every residual block (``model.resnet.encoder.stages[i].layers[j]``) is wrapped the way a user would wrap
it (like ``effectfx.testing.hf.LoggedLayer``): a module whose ``forward`` first calls the effect op
``efxbench::record(name)`` with the block's name, then the block.  That ``forward`` is marked
``@efx.region`` for effectfx, ``@torch.compiler.nested_compile_region`` for torch.compile's region
variant, and left unmarked for eager and for plain torch.compile.

Measured, with systems interleaved and their order rotated on each repetition:

1. **first call**: a fresh model (same seed) -> compile -> one training step (forward with labels,
   ``loss.backward()``); wall and CPU time; then the **second call** (transformers sets
   ``config.problem_type`` during the first call, so both compilers compile again once);
2. **steady-state training step** (forward + backward + SGD step) after warm-up, median over rounds;
3. correctness: loss, every parameter's gradient and every buffer (running mean/var,
   ``num_batches_tracked``) after the first step, and every parameter and buffer after the warm-up steps,
   compared with eager's; effects counted per step (expected: one per block).

The model and systems are in :mod:`benchmarks.resnet_systems`, the summary, table and plot in
:mod:`benchmarks.resnet_report`.

Run: ``python benchmarks/resnet.py [--quick] [--out DIR] [--systems a,b]``; ``--plot-only
results/resnet.json`` redraws the table and plot from a saved run.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import effectfx as efx  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import LOG, median  # noqa: E402
from benchmarks.resnet_report import plot, summarize, table  # noqa: E402
from benchmarks.resnet_systems import (  # noqa: E402
    ATOL,
    BATCH,
    CHANNELS,
    CONFIG,
    LABELS,
    LR,
    RTOL,
    SIZE,
    SYSTEMS,
    WARMUP_STEPS,
    batch,
    build,
    compare,
    compile_for,
    n_blocks,
    references,
    snapshot,
    train_call,
)

NAME = "resnet"
# torch.compile takes seconds per first call, the others milliseconds to a second: they get more repetitions
FULL = {"reps": 5, "tc_reps": 3, "rounds": 60, "min_seconds": 45.0,
        "systems": ["eager", "efx", "tc", "tc_region", "efx_noregion", "tc_region_shared"]}
QUICK = {"reps": 1, "tc_reps": 1, "rounds": 3, "min_seconds": 0.0, "systems": ["eager", "efx", "tc_region"]}


def _error(exc: BaseException) -> str:
    return f"error: {common.error_text(exc)}"


# -- 1. first call ---------------------------------------------------------------------------------
def measure_first_call(system: str, reference: dict[str, Any]) -> dict[str, Any]:
    """Compile a fresh model and run one training step (then a second): times, effects, agreement."""
    marker, compiler = SYSTEMS[system]
    if compiler == "tc":
        torch._dynamo.reset()
    model = build(system)
    pixels, labels = batch()
    dyn0 = common.dynamo_counts()
    common.quiet_gc()
    LOG.clear()
    status, loss, forward_s, f = "ok", None, float("nan"), None
    cpu_start = time.process_time()
    start = time.perf_counter()
    try:
        f = compile_for(compiler, model)
        status, loss, forward_s = train_call(f, pixels, labels)
    except Exception as exc:  # a comparator failing is a result, not a crash of the benchmark
        status = _error(exc)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    effects = len(LOG)
    row: dict[str, Any] = {"seconds": seconds, "cpu_seconds": cpu_seconds, "forward_seconds": forward_s,
                           "status": status, "effects": effects}
    if not status.startswith("error"):
        got = snapshot(model, loss, grads=status == "ok")
        parts = ("loss", "grads", "buffers") if status == "ok" else ("loss", "buffers")
        row.update(compare(got, reference, parts))
    else:
        row["matches_eager"] = None
    dyn1 = common.dynamo_counts()
    # the second call: transformers set config.problem_type during the first, so a compiler guarding on
    # it compiles again
    second: dict[str, Any] = {"status": "skipped", "seconds": float("nan"), "cpu_seconds": float("nan"),
                              "effects": 0}
    if f is not None and not status.startswith("error"):
        model.zero_grad()
        common.quiet_gc()
        LOG.clear()
        cpu_start = time.process_time()
        start = time.perf_counter()
        try:
            second["status"] = train_call(f, pixels, labels)[0]
        except Exception as exc:
            second["status"] = _error(exc)
        second["seconds"] = time.perf_counter() - start
        second["cpu_seconds"] = time.process_time() - cpu_start
        second["effects"] = len(LOG)
    LOG.clear()
    row["second_call"] = second
    if compiler == "efx":  # a compiled module answers for its callable (stats, programs)
        row["efx_compiles"] = f.stats.compiles
    if compiler == "tc":
        dyn2 = common.dynamo_counts()
        row["dynamo"] = {"first_call": {k: dyn1[k] - dyn0[k] for k in dyn0},
                         "second_call": {k: dyn2[k] - dyn1[k] for k in dyn0}}
        torch._dynamo.reset()
    return row


def plan(cfg: dict[str, Any]) -> list[tuple[int, str]]:
    steps = []
    systems = cfg["systems"]
    for rep in range(cfg["reps"]):
        k = rep % len(systems)  # rotate the order so no system always goes first
        for system in systems[k:] + systems[:k]:
            if rep < cfg["tc_reps"] or SYSTEMS[system][1] != "tc":
                steps.append((rep, system))
    return steps


# -- 2. steady state -------------------------------------------------------------------------------
class Trainer:
    """One system's compiled model and optimizer, warmed up; ``step()`` is one timed training step."""

    def __init__(self, system: str, reference: dict[str, Any]) -> None:
        self.system = system
        marker, compiler = SYSTEMS[system]
        self.model = build(system)
        self.pixels, self.labels = batch()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.status = "ok"
        self.warmup_effects: list[int] = []
        self.info: dict[str, Any] = {}
        try:
            self.f = compile_for(compiler, self.model)
            for _ in range(WARMUP_STEPS):
                LOG.clear()
                self._step()
                self.warmup_effects.append(len(LOG))
                if self.status != "ok":
                    break
        except Exception as exc:
            self.status = _error(exc)
        LOG.clear()
        self.warm = (compare(snapshot(self.model, None, grads=False), reference, ("params", "buffers"))
                     if self.status == "ok" else {"matches_eager": None})
        if hasattr(getattr(self, "f", None), "stats"):  # efx.compile's callable, or a compiled module
            self.info["efx_compiles"] = self.f.stats.compiles
            try:
                programs = efx.explain(self.f).programs
                self.info["efx_region_bodies"] = sum(len(r.bodies) for r in programs[-1].regions)
            except Exception as exc:  # explain is a report only
                self.info["efx_region_bodies"] = _error(exc)

    def _step(self) -> None:
        loss = self.f(pixel_values=self.pixels, labels=self.labels).loss
        if loss.grad_fn is None:
            self.status = "loss has no grad_fn: backward impossible"
            return
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def step(self) -> tuple[float, float, int]:
        LOG.clear()
        cpu_start = time.process_time()
        start = time.perf_counter()
        self._step()
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        n = len(LOG)
        LOG.clear()
        return wall, cpu, n


def steady_state(cfg: dict[str, Any], reference: dict[str, Any],
                 progress: common.Progress | None = None) -> dict[str, Any]:
    torch._dynamo.reset()
    trainers = {}
    for system in cfg["systems"]:
        trainers[system] = Trainer(system, reference)
        if progress is not None:
            progress.step(f"warm-up {LABELS[system]}")
    running = [s for s, t in trainers.items() if t.status == "ok"]
    samples: dict[str, dict[str, list[float]]] = {s: {"wall": [], "cpu": []} for s in running}
    effects: dict[str, list[int]] = {s: [] for s in running}
    rng = random.Random(0)
    common.quiet_gc()
    start = time.perf_counter()
    rounds = 0
    while rounds < cfg["rounds"] or time.perf_counter() - start < cfg["min_seconds"]:
        order = running[:]
        rng.shuffle(order)
        for system in order:
            wall, cpu, n = trainers[system].step()
            samples[system]["wall"].append(wall)
            samples[system]["cpu"].append(cpu)
            effects[system].append(n)
        rounds += 1
    if progress is not None:
        progress.step(f"steady state: {rounds} rounds")
    out = {}
    for system, t in trainers.items():
        s = samples.get(system, {"wall": [], "cpu": []})
        out[system] = {
            "status": t.status,
            "warmup_effects": t.warmup_effects,
            "state_after_warmup": t.warm,
            "median_s": median(s["wall"]),
            "cpu_median_s": median(s["cpu"]),
            "min_s": min(s["wall"], default=float("nan")),
            "runs_s": s["wall"],
            "cpu_runs_s": s["cpu"],
            "effects_per_step": sorted(set(effects.get(system, []))),
            **t.info,
        }
    out["rounds"] = rounds
    out["seconds"] = time.perf_counter() - start
    return out


# -- what torch.compile made of the regions (not timed) ---------------------------------------------
def tc_structure(system: str) -> dict[str, Any]:
    """Compile ``system``'s model once more with a backend that looks at dynamo's graphs before handing them
    to aot_eager: how many region calls (``invoke_subgraph``) and bodies it made, how many effect calls
    were left at the top level, and whether a training step ran."""
    from torch._dynamo.backends.debugging import aot_eager

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    pixels, labels = batch()
    try:
        status = train_call(torch.compile(build(system), backend=backend), pixels, labels)[0]
    except Exception as exc:
        status = _error(exc)
    torch._dynamo.reset()
    LOG.clear()
    calls = [n for gm in graphs for n in gm.graph.nodes
             if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]
    records = [n for gm in graphs for n in gm.graph.nodes
               if n.op == "call_function" and "efxbench.record" in str(n.target)]
    return {"status": status, "dynamo_graphs": len(graphs), "invoke_subgraph_calls": len(calls),
            "distinct_subgraphs": len({str(n.args[1]) for n in calls}),
            "top_level_effect_calls": len(records)}


# -- the run ---------------------------------------------------------------------------------------
def warmup(systems: list[str]) -> None:
    """Pay one-time costs (imports, dynamo/AOT and effectfx initialisation, transformers' first call) on a
    smaller ResNet (other shapes, so nothing measured later is cached), for the systems measured only; then
    freeze the heap so the collection before each measurement is cheap."""
    tiny = dict(CONFIG, embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1])
    pixels, labels = batch(seed=2, size=16, batch_size=2)
    for system in systems:
        marker, compiler = SYSTEMS[system]
        torch._dynamo.reset()
        f = compile_for(compiler, build(system, config=tiny))
        try:
            f(pixel_values=pixels, labels=labels).loss.backward()
        except Exception:  # failures are measured (and reported) later
            pass
    torch._dynamo.reset()
    LOG.clear()
    common.freeze_heap()


def run(quick: bool = False, systems: list[str] | None = None, progress: common.Progress | None = None,
        warm: bool = True) -> dict[str, Any]:
    cfg = dict(QUICK if quick else FULL)
    if systems:
        cfg["systems"] = systems
    if warm:
        warmup(cfg["systems"])
    ref = references(WARMUP_STEPS)
    raw: dict[str, list[dict[str, Any]]] = {s: [] for s in cfg["systems"]}
    for _rep, system in plan(cfg):
        raw[system].append(measure_first_call(system, ref["first"]))
        if progress is not None:
            progress.step(f"first call {LABELS[system]}")
    steady = steady_state(cfg, ref["warm"], progress)
    structure = {s: tc_structure(s) for s in cfg["systems"] if SYSTEMS[s] == ("tc", "tc")}
    if progress is not None and structure:
        progress.step("torch.compile's regions")
    expected = n_blocks()
    results = []
    for system in cfg["systems"]:
        runs, st = raw[system], steady[system]
        matches = [r["matches_eager"] for r in runs]
        results.append({
            "system": system,
            "label": LABELS[system],
            "first_call": {
                "median_s": median(r["seconds"] for r in runs),
                "cpu_median_s": median(r["cpu_seconds"] for r in runs),
                "forward_median_s": median(r["forward_seconds"] for r in runs),
                "second_call_median_s": median(r["second_call"]["seconds"] for r in runs),
                "second_call_cpu_median_s": median(r["second_call"]["cpu_seconds"] for r in runs),
                "runs_s": [r["seconds"] for r in runs],
                "status": sorted({r["status"] for r in runs}),
                "second_call_status": sorted({r["second_call"]["status"] for r in runs}),
                "ok": all(r["status"] == "ok" for r in runs),
                "effects_per_call": [r["effects"] for r in runs],
                "second_call_effects": [r["second_call"]["effects"] for r in runs],
                "effects_correct": all(r["effects"] == expected and r["second_call"]["effects"] == expected
                                       for r in runs),
                "matches_eager": all(matches) if all(m is not None for m in matches) else None,
                "runs": runs,
            },
            "step": {k: v for k, v in st.items()},
            **({"tc_regions": structure[system]} if system in structure else {}),
            "expected_effects": expected,
            "effects_correct": all(r["effects"] == expected and r["second_call"]["effects"] == expected
                                   for r in runs)
            and st["effects_per_step"] == [expected] and st["warmup_effects"] == [expected] * WARMUP_STEPS,
            "matches_eager": (all(matches) if all(m is not None for m in matches) else None)
            if st["state_after_warmup"]["matches_eager"] is not False else False,
        })
    data = {
        "benchmark": NAME,
        "machine": {**common.machine_info(), "effectfx_worktree_dirty": common.effectfx_dirty()},
        "config": {"model": "transformers.ResNetForImageClassification", "resnet_config": CONFIG,
                   "blocks": expected, "batch": [BATCH, CHANNELS, SIZE, SIZE], "lr": LR, "optimizer": "SGD",
                   "warmup_steps": WARMUP_STEPS, "reps": cfg["reps"], "tc_reps": cfg["tc_reps"],
                   "min_rounds": cfg["rounds"], "min_seconds": cfg["min_seconds"], "rounds": steady["rounds"],
                   "steady_seconds": steady["seconds"], "quick": quick, "rtol": RTOL, "atol": ATOL,
                   "systems": {s: LABELS[s] for s in cfg["systems"]}, "torch_compile_backend": "aot_eager",
                   "efx_backend": "default", "torch_threads": torch.get_num_threads()},
        "results": results,
    }
    data["summary"] = summarize(data)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition, eager/effectfx/torch.compile "
                        "with regions, 3 steady-state rounds; writes results/quick/ unless --out")
    parser.add_argument("--systems", default=None,
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all, or quick's)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    common.add_output_arguments(parser, NAME, child=False)
    args = parser.parse_args(argv)
    systems = args.systems.split(",") if args.systems else None
    if systems and (unknown := set(systems) - set(SYSTEMS)):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")

    def measure() -> dict[str, Any]:
        torch.set_num_threads(args.threads)
        cfg = dict(QUICK if args.quick else FULL)
        if systems:
            cfg["systems"] = systems
        tc_regions = any(SYSTEMS[s] == ("tc", "tc") for s in cfg["systems"])
        steps = len(plan(cfg)) + len(cfg["systems"]) + 1 + tc_regions  # first calls, warm-ups, steady, tc
        return run(args.quick, systems, common.Progress(steps, NAME))

    return common.dispatch(args, NAME, (summarize, table, plot), measure)


if __name__ == "__main__":
    sys.exit(main())
