"""First-call time (capture + compile + first execution) of efx.compile vs torch.compile(aot_eager) vs eager.

For a stack of N blocks (Linear + ReLU + one effect op call each), N in {1, 4, 16, 64}, inference
(``torch.no_grad``, parameters not requiring grad) and training (forward + ``out.sum().backward()``).
Every measurement uses a fresh model (same seed, so the same weights) and, for torch.compile, follows a
``torch._dynamo.reset()``; systems are interleaved and their order rotated on each repetition.  The
effect log of every call is counted and the outputs (and gradients) are compared with eager's.  The model
and systems are in :mod:`benchmarks.first_call_systems`, the summary, table and plot in
:mod:`benchmarks.first_call_report`.

Run: ``python benchmarks/first_call.py [--quick]`` or ``effectfx bench``; ``--plot-only
results/first_call.json`` redraws the table and plot from a saved run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.first_call_report import plot, summarize, table  # noqa: E402
from benchmarks.first_call_systems import (  # noqa: E402
    BATCH,
    LABELS,
    SYSTEMS,
    WIDTH,
    compile_for,
    example_input,
    make_model,
    reference,
    warmup,
)

NAME = "first_call"
# torch.compile takes seconds per measurement, the others milliseconds: they get more repetitions
FULL = {"ns": [1, 4, 16, 64], "reps": 7, "tc_reps": 3, "systems": list(SYSTEMS)}
QUICK = {"ns": [1, 4], "reps": 1, "tc_reps": 1, "systems": ["efx", "tc", "eager"]}


def measure(system: str, n: int, train: bool, want: Any) -> dict[str, Any]:
    """One first call of a fresh model: time, effects counted, status, agreement with eager's ``want``
    (:func:`benchmarks.first_call_systems.reference`)."""
    marker, effects = SYSTEMS[system]
    if marker == "tc":
        torch._dynamo.reset()
    model = make_model(n, WIDTH, marker, effects, train)
    x = example_input()
    common.quiet_gc()
    common.LOG.clear()
    status, forward_s, out = "ok", float("nan"), None
    cpu_start = time.process_time()
    start = time.perf_counter()
    try:
        with torch.set_grad_enabled(train):
            out = compile_for(system.split("_")[0], model)(x)
            forward_s = time.perf_counter() - start
            if train:
                if out.grad_fn is None:
                    status = "output has no grad_fn: backward impossible (forward time only)"
                else:
                    out.sum().backward()
    except Exception as exc:  # a comparator failing is a result, not a crash of the benchmark
        status = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    n_effects = len(common.LOG)
    common.LOG.clear()
    matches = None
    if out is not None and not status.startswith("error"):
        ref_out, ref_grads = want
        matches = bool(torch.allclose(out.detach(), ref_out, rtol=1e-4, atol=1e-5))
        if train and status == "ok":
            grads = [p.grad for p in model.parameters()]
            matches = matches and all(
                g is not None and torch.allclose(g, r, rtol=1e-4, atol=1e-5) for g, r in zip(grads, ref_grads)
            )
    if marker == "tc":
        torch._dynamo.reset()
    return {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "forward_seconds": forward_s,
        "effects": n_effects,
        "expected_effects": n if effects else 0,
        "status": status,
        "matches_eager": matches,
    }


def plan(quick: bool) -> list[tuple[int, str, bool, int]]:
    cfg = QUICK if quick else FULL
    steps = []
    systems = cfg["systems"]
    for rep in range(cfg["reps"]):
        for train in (False, True):
            for n in cfg["ns"]:
                k = rep % len(systems)  # rotate the order so no system always goes first
                for system in systems[k:] + systems[:k]:
                    if rep < cfg["tc_reps"] or SYSTEMS[system][0] != "tc":
                        steps.append((rep, system, train, n))
    return steps


def run(quick: bool = False, progress: common.Progress | None = None, warm: bool = True) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    if warm:
        warmup()
    references = {(n, train, eff): reference(n, train, eff)
                  for n in cfg["ns"] for train in (False, True) for eff in (True, False)}
    raw: dict[tuple[str, bool, int], list[dict[str, Any]]] = {}
    for _rep, system, train, n in plan(quick):
        ref = references[(n, train, SYSTEMS[system][1])]
        raw.setdefault((system, train, n), []).append(measure(system, n, train, ref))
        if progress is not None:
            progress.step(f"first call {LABELS[system]} {'training' if train else 'inference'} N={n}")
    results = []
    for (system, train, n), runs in raw.items():
        results.append({
            "system": system,
            "label": LABELS[system],
            "mode": "training" if train else "inference",
            "n": n,
            "median_s": common.median(r["seconds"] for r in runs),
            "cpu_median_s": common.median(r["cpu_seconds"] for r in runs),
            "forward_median_s": common.median(r["forward_seconds"] for r in runs),
            "runs_s": [r["seconds"] for r in runs],
            "effects_per_call": [r["effects"] for r in runs],
            "expected_effects": runs[0]["expected_effects"],
            "effects_correct": all(r["effects"] == r["expected_effects"] for r in runs),
            "status": sorted({r["status"] for r in runs}),
            "ok": all(r["status"] == "ok" for r in runs),
            "matches_eager": all(r["matches_eager"] for r in runs) if all(
                r["matches_eager"] is not None for r in runs) else None,
        })
    results.sort(key=lambda r: (r["mode"], r["n"], list(SYSTEMS).index(r["system"])))
    data = {
        "benchmark": NAME,
        "machine": common.machine_info(),
        "config": {"ns": cfg["ns"], "reps": cfg["reps"], "tc_reps": cfg["tc_reps"], "width": WIDTH,
                   "batch": BATCH, "quick": quick, "systems": {s: LABELS[s] for s in cfg["systems"]},
                   "torch_compile_backend": "aot_eager"},
        "results": results,
    }
    data["summary"] = summarize(data)
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N in (1, 4), one repetition")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    common.add_output_arguments(parser, NAME, child=False)
    args = parser.parse_args(argv)

    def measure() -> dict[str, Any]:
        torch.set_num_threads(args.threads)
        return run(args.quick, common.Progress(len(plan(args.quick)), NAME))

    return common.dispatch(args, NAME, (summarize, table, plot), measure)


if __name__ == "__main__":
    sys.exit(main())
