"""Steady-state time per call: efx.compile vs eager vs torch.compile(aot_eager), and the cost per effect.

A 16-block stack (Linear + ReLU + one effect op call per block), layers 64 and 512 wide, batch 32;
inference (``torch.no_grad``) and a training step (forward + ``out.sum().backward()``).  Every system is
also measured on the same stack without the effect op; the cost per effect is
``(time with effects - time without) / 16``, compared with the op's own eager cost (16 direct calls of
``torch.ops.efxbench.record``).  All systems of one configuration are timed interleaved, in a shuffled
order each round, each sample a batch of calls lasting about a millisecond or more; reported figures are
medians over rounds (differences are medians of per-round differences).

Run: ``python benchmarks/runtime.py [--quick]`` or ``effectfx bench``.
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
from benchmarks.common import LOG, compile_for, make_model, median  # noqa: E402

NAME = "runtime"
N_BLOCKS, BATCH = 16, 32
FULL = {"widths": [64, 512], "budget_s": 8.0, "sample_s": 2e-3, "skip": []}
QUICK = {"widths": [64], "budget_s": 0.4, "sample_s": 1e-3, "skip": ["tc", "tc_noeffect"]}
# system -> (compiler, marker of the blocks, whether blocks call the effect op)
SYSTEMS: dict[str, tuple[str, str, bool]] = {
    "eager": ("eager", "eager", True),
    "efx": ("efx", "efx", True),
    "tc": ("tc", "tc", True),
    "eager_noeffect": ("eager", "eager", False),
    "efx_noeffect": ("efx", "efx", False),
    "tc_noeffect": ("tc", "tc", False),
}
LABELS = {
    "eager": "eager", "efx": "effectfx", "tc": "torch.compile",
    "eager_noeffect": "eager (no effects)", "efx_noeffect": "effectfx (no effects)",
    "tc_noeffect": "torch.compile (no effects)", "op": f"effect op x{N_BLOCKS}, eager",
}


def _step(fn: Callable[..., Any], x: torch.Tensor, train: bool) -> Callable[[], Any]:
    if train:
        def step() -> None:
            fn(x).sum().backward()
    else:
        def step() -> Any:
            return fn(x)
    return step


def _op_step() -> Callable[[], None]:
    record = torch.ops.efxbench.record

    def step() -> None:
        for _ in range(N_BLOCKS):
            record("block")
    return step


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
        step = _step(fn, x, train)
        LOG.clear()
        status = "ok"
        try:
            with torch.set_grad_enabled(train):
                start = time.perf_counter()
                step()
                first = time.perf_counter() - start
        except Exception as exc:  # a comparator that cannot run this configuration is a result
            status = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            first = float("nan")
        entry: dict[str, Any] = {"status": status, "first_call_s": first, "effects_per_call": len(LOG),
                                 "expected_effects": N_BLOCKS if effects else 0}
        if compiler == "efx" and status == "ok":
            prog = fn.programs()[0]
            entry["efx_form"] = prog.form
            entry["efx_history"] = [r.name for r in getattr(prog, "forward", prog).history]
        info[system] = entry
        if status == "ok":
            steps[system] = step
    steps["op"] = _op_step()
    info["op"] = {"status": "ok", "effects_per_call": N_BLOCKS, "expected_effects": N_BLOCKS}
    LOG.clear()
    return steps, info


def _time_config(steps: dict[str, Callable[[], Any]], train: bool, budget_s: float,
                 sample_s: float, rng: random.Random) -> dict[str, list[float]]:
    """Interleaved timing: per-call seconds of each system, one sample per round."""
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
            one[name] = max(median(ts), 1e-7)
        inner = {name: max(1, round(sample_s / t)) for name, t in one.items()}
        per_round = sum(inner[n] * one[n] for n in steps)
        rounds = max(5, min(2000, int(budget_s / per_round)))
        samples: dict[str, list[float]] = {name: [] for name in steps}
        order = list(steps)
        for _ in range(rounds):
            rng.shuffle(order)
            for name in order:
                step, k = steps[name], inner[name]
                t0 = time.perf_counter()
                for _ in range(k):
                    step()
                samples[name].append((time.perf_counter() - t0) / k)
                LOG.clear()
    return samples


def _paired_diff(a: list[float], b: list[float]) -> float:
    return median(x - y for x, y in zip(a, b))


def run(quick: bool = False, progress: common.Progress | None = None, seed: int = 0,
        warm: bool = True) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    if warm:
        common.warmup()
    rng = random.Random(seed)
    configs = []
    for width in cfg["widths"]:
        for train in (False, True):
            mode = "training" if train else "inference"
            steps, info = _prepare(width, train, cfg["skip"])
            common.quiet_gc()
            samples = _time_config(steps, train, cfg["budget_s"], cfg["sample_s"], rng)
            med = {name: median(s) for name, s in samples.items()}
            eager = med["eager"]
            row: dict[str, Any] = {
                "width": width, "mode": mode, "n_blocks": N_BLOCKS, "batch": BATCH,
                "rounds": len(samples["eager"]),
                "median_us": {name: m * 1e6 for name, m in med.items()},
                "systems": info,
                "efx_over_eager": med["efx"] / eager,
                "efx_noeffect_over_eager_noeffect": med["efx_noeffect"] / med["eager_noeffect"],
                "tc_over_eager": med["tc"] / eager if "tc" in med else None,
                "tc_noeffect_over_eager_noeffect": (med["tc_noeffect"] / med["eager_noeffect"]
                                                    if "tc_noeffect" in med else None),
            }
            op_us = med["op"] / N_BLOCKS * 1e6
            per_effect = {
                "op_eager_us": op_us,
                "efx_us": _paired_diff(samples["efx"], samples["efx_noeffect"]) / N_BLOCKS * 1e6,
                "eager_us": _paired_diff(samples["eager"], samples["eager_noeffect"]) / N_BLOCKS * 1e6,
            }
            if "tc" in samples and "tc_noeffect" in samples:
                per_effect["tc_us"] = _paired_diff(samples["tc"], samples["tc_noeffect"]) / N_BLOCKS * 1e6
            per_effect["efx_overhead_beyond_op_us"] = per_effect["efx_us"] - op_us
            per_effect["meets_target"] = per_effect["efx_us"] <= op_us + 2.0
            row["per_effect"] = per_effect
            row["meets_target"] = row["efx_over_eager"] <= 1.0
            configs.append(row)
            if progress is not None:
                progress.step(f"runtime width={width} {mode}")
    return {
        "benchmark": NAME,
        "machine": common.machine_info(),
        "config": {**cfg, "n_blocks": N_BLOCKS, "batch": BATCH, "quick": quick, "systems": LABELS,
                   "torch_compile_backend": "aot_eager"},
        "results": configs,
        "targets": {"efx_over_eager_max": 1.0, "per_effect_overhead_max": "op's own cost + 2 us"},
    }


def steps_total(quick: bool) -> int:
    return len((QUICK if quick else FULL)["widths"]) * 2


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(data: dict[str, Any]) -> str:
    rows, effect_rows = [], []
    for r in data["results"]:
        m = r["median_us"]
        tc = f"{m['tc']:.0f}" if "tc" in m else ("fails" if "tc" in r["systems"] else "-")
        tc_ratio = _ratio(r["tc_over_eager"])
        rows.append([r["width"], r["mode"], f"{m['eager']:.0f}", f"{m['efx']:.0f}", tc,
                     f"{r['efx_over_eager']:.2f}x", tc_ratio,
                     f"{r['efx_noeffect_over_eager_noeffect']:.2f}x",
                     _ratio(r["tc_noeffect_over_eager_noeffect"]),
                     "met" if r["meets_target"] else "NOT met"])
        p = r["per_effect"]
        effect_rows.append([r["width"], r["mode"], f"{p['op_eager_us']:.2f}", f"{p['eager_us']:.2f}",
                            f"{p['efx_us']:.2f}", f"{p['efx_overhead_beyond_op_us']:+.2f}",
                            f"{p['tc_us']:.2f}" if "tc_us" in p else "-",
                            "met" if p["meets_target"] else "NOT met"])
    out = [f"steady state, {N_BLOCKS} blocks, batch {BATCH} (median us per call; ratios to eager)",
           common.format_table(["width", "mode", "eager", "effectfx", "torch.compile", "efx/eager",
                                "tc/eager", "efx/eager no-eff", "tc/eager no-eff", "<=1.0x"], rows),
           "",
           "cost per effect (us): (with effects - without) / 16, median of per-round differences",
           common.format_table(["width", "mode", "op itself", "eager", "effectfx", "efx - op",
                                "torch.compile", "<= op+2us"], effect_rows)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64-wide only, a short time budget")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="output directory")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = run(args.quick, common.Progress(steps_total(args.quick), NAME))
    print(table(data))
    print("wrote", common.write_json(data, args.out, NAME))
    return 0


if __name__ == "__main__":
    sys.exit(main())
