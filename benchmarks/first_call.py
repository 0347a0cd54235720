"""First-call time (capture + compile + first execution) of efx.compile vs torch.compile(aot_eager) vs eager.

For a stack of N blocks (Linear + ReLU + one effect op call each), N in {1, 4, 16, 64}, inference
(``torch.no_grad``, parameters not requiring grad) and training (forward + ``out.sum().backward()``).
Every measurement uses a fresh model (same seed, so the same weights) and, for torch.compile, follows a
``torch._dynamo.reset()``; systems are interleaved and their order rotated on each repetition.  The
effect log of every call is counted and the outputs (and gradients) are compared with eager's.

Run: ``python benchmarks/first_call.py [--quick]`` or ``effectfx bench``.
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
from benchmarks.common import LOG, compile_for, make_model, median  # noqa: E402

NAME = "first_call"
# system -> (marker of the blocks, whether blocks call the effect op)
SYSTEMS: dict[str, tuple[str, bool]] = {
    "efx": ("efx", True),
    "tc": ("tc", True),
    "eager": ("eager", True),
    "efx_noeffect": ("efx", False),
    "tc_noeffect": ("tc", False),
}
LABELS = {
    "efx": "effectfx",
    "tc": "torch.compile",
    "eager": "eager",
    "efx_noeffect": "effectfx (no effects)",
    "tc_noeffect": "torch.compile (no effects)",
}
# torch.compile takes seconds per measurement, the others milliseconds: they get more repetitions
FULL = {"ns": [1, 4, 16, 64], "reps": 7, "tc_reps": 3, "systems": list(SYSTEMS)}
QUICK = {"ns": [1, 4], "reps": 1, "tc_reps": 1, "systems": ["efx", "tc", "eager"]}
WIDTH, BATCH = 64, 8


def _reference(n: int, train: bool, effects: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    model = make_model(n, WIDTH, "eager", effects, train)
    x = _input()
    with torch.set_grad_enabled(train):
        out = model(x)
        if not train:
            return out.detach(), None
        out.sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _input() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, WIDTH, generator=g)


def measure(system: str, n: int, train: bool, reference: Any) -> dict[str, Any]:
    """One first call of a fresh model: time, effects counted, status, agreement with eager."""
    marker, effects = SYSTEMS[system]
    if marker == "tc":
        torch._dynamo.reset()
    model = make_model(n, WIDTH, marker, effects, train)
    x = _input()
    common.quiet_gc()
    LOG.clear()
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
    n_effects = len(LOG)
    LOG.clear()
    matches = None
    if out is not None and not status.startswith("error"):
        ref_out, ref_grads = reference
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
        common.warmup()
    references = {(n, train, eff): _reference(n, train, eff)
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
            "median_s": median(r["seconds"] for r in runs),
            "cpu_median_s": median(r["cpu_seconds"] for r in runs),
            "forward_median_s": median(r["forward_seconds"] for r in runs),
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


def _lookup(data: dict[str, Any], system: str, mode: str, n: int) -> dict[str, Any] | None:
    for r in data["results"]:
        if r["system"] == system and r["mode"] == mode and r["n"] == n:
            return r
    return None


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    ns = data["config"]["ns"]
    summary: dict[str, Any] = {}
    for mode in ("inference", "training"):
        rows = {}
        for n in ns:
            efx, tc, eager = (_lookup(data, s, mode, n) for s in ("efx", "tc", "eager"))
            efx0, tc0 = (_lookup(data, s, mode, n) for s in ("efx_noeffect", "tc_noeffect"))
            rows[str(n)] = {
                "efx_s": efx["median_s"],
                "efx_min_s": min(efx["runs_s"]),  # the fastest repetition: the least disturbed by others
                "tc_s": tc["median_s"],
                "tc_ok": tc["ok"],
                "eager_s": eager["median_s"],
                "tc_over_efx": tc["median_s"] / efx["median_s"],
                "tc_over_efx_cpu": tc["cpu_median_s"] / efx["cpu_median_s"],
                "efx_cpu_s": efx["cpu_median_s"],
                "efx_over_eager": efx["median_s"] / eager["median_s"],
                "tc_noeffect_over_efx_noeffect": tc0["median_s"] / efx0["median_s"] if tc0 and efx0 else None,
                "efx_effects_correct": efx["effects_correct"],
                "tc_effects_correct": tc["effects_correct"],
                "tc_effects_per_call": tc["effects_per_call"],
                "efx_matches_eager": efx["matches_eager"],
                "tc_matches_eager": tc["matches_eager"],
            }
        first, last = str(min(ns)), str(max(ns))
        growth = rows[last]["efx_s"] / rows[first]["efx_s"]
        growth_cpu = rows[last]["efx_cpu_s"] / rows[first]["efx_cpu_s"]
        summary[mode] = {
            "by_n": rows,
            "efx_growth": growth,
            "efx_growth_cpu": growth_cpu,
            "efx_growth_fastest": rows[last]["efx_min_s"] / rows[first]["efx_min_s"],
            "growth_from_to": [int(first), int(last)],
            "target_tc_over_efx_at_max_n": 20.0,
            # when torch.compile could not run backward it did less work: its ratio is then a lower bound
            "meets_speedup_target": rows[last]["tc_over_efx"] >= 20.0,
            "speedup_is_lower_bound": not rows[last]["tc_ok"],
            "meets_speedup_target_vs_working_tc": (rows[last]["tc_noeffect_over_efx_noeffect"] or 0) >= 20.0,
        }
    return summary


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}x"


def table(data: dict[str, Any]) -> str:
    out = []
    for mode in ("inference", "training"):
        s = data["summary"][mode]
        rows = []
        for n, r in s["by_n"].items():
            tc_note = "" if r["tc_ok"] else " *"
            rows.append([
                n, f"{r['efx_s'] * 1e3:.1f}", f"{r['tc_s'] * 1e3:.1f}{tc_note}", f"{r['eager_s'] * 1e3:.2f}",
                f"{r['tc_over_efx']:.1f}x", f"{r['tc_over_efx_cpu']:.1f}x",
                _ratio(r["tc_noeffect_over_efx_noeffect"]),
                "yes" if r["efx_effects_correct"] and r["efx_matches_eager"] else "NO",
                ("yes" if r["tc_effects_correct"] else f"NO {r['tc_effects_per_call']}")
                + ("" if r["tc_ok"] else ", no grad_fn"),
            ])
        out.append(f"first call, {mode} (median wall ms; ratios = torch.compile / effectfx, "
                   "cpu = process CPU time)")
        out.append(common.format_table(
            ["N", "effectfx", "torch.compile", "eager", "tc/efx", "tc/efx cpu", "tc/efx no-eff",
             "efx correct", "tc correct"], rows))
        lo, hi = s["growth_from_to"]
        out.append(f"effectfx growth N={lo}->{hi}: {s['efx_growth']:.2f}x (cpu {s['efx_growth_cpu']:.2f}x, "
                   f"fastest repetitions {s['efx_growth_fastest']:.2f}x; no target: the first run's own cost "
                   f"per call site is its floor);  tc/efx at N={hi}: "
                   f"{s['by_n'][str(hi)]['tc_over_efx']:.1f}x (target >= 20x: "
                   f"{'met' if s['meets_speedup_target'] else 'NOT met'}"
                   f"{', lower bound: torch.compile skipped backward' if s['speedup_is_lower_bound'] else ''}"
                   ")")
        if any(not r["tc_ok"] for r in s["by_n"].values()):
            out.append("* torch.compile's output had no grad_fn, so backward could not run: "
                       "forward time only")
        out.append("")
    return "\n".join(out)


def plot(data: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    styles = {"efx": ("effectfx", "C0", "o"), "tc": ("torch.compile (aot_eager)", "C3", "s"),
              "eager": ("eager (first call)", "C2", "^"),
              "tc_noeffect": ("torch.compile, no effects", "C1", "x")}
    ns = data["config"]["ns"]
    for ax, mode in zip(axes, ("inference", "training")):
        for system, (label, color, marker) in styles.items():
            rows = [r for r in (_lookup(data, system, mode, n) for n in ns) if r is not None]
            if not rows:
                continue
            xs = [r["n"] for r in rows]
            ys = [r["median_s"] * 1e3 for r in rows]
            ls = ":" if system == "tc_noeffect" else "-"
            ax.plot(xs, ys, ls, color=color, marker=marker, label=label)
            bad = [(r["n"], r["median_s"] * 1e3) for r in rows if not r["ok"]]
            if bad:
                ax.scatter(*zip(*bad), s=140, facecolors="none", edgecolors="k", zorder=5,
                           label="torch.compile: no grad_fn (fwd only)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns)
        ax.set_xticklabels([str(n) for n in ns])
        ax.set_xlabel("number of blocks N")
        ax.set_title(f"first call, {mode}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("time of first call (ms)")
    axes[1].legend(fontsize=8, loc="best")
    m = data["machine"]
    fig.suptitle(f"capture+compile+first run, Linear({WIDTH})+ReLU+effect per block -- torch {m['torch']}, "
                 f"{m['timestamp'][:16]}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N in (1, 4), one repetition")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: results/, or results/quick/ with --quick)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = common.output_dir(args.out, args.quick)
    progress = common.Progress(len(plan(args.quick)), NAME)
    data = run(args.quick, progress)
    print(table(data))
    print("wrote", common.write_json(data, out, NAME),
          common.replace_atomically(out / f"{NAME}.png", lambda path: plot(data, path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
