"""The analysis, table and plot of ``benchmarks/runtime.py``'s results, with its targets
(benchmarks/README.md, "Targets": steady state <= 1.0x eager, cost per effect <= the op's own cost + 2 us)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.runtime_systems import BATCH, N_BLOCKS


def _paired_diff(a: list[float], b: list[float]) -> float:
    return common.median(x - y for x, y in zip(a, b))


def analyze(samples: dict[str, list[float]]) -> dict[str, Any]:
    """Medians, ratios to eager and the cost per effect from one clock's samples."""
    med = {name: common.median(s) for name, s in samples.items()}
    out: dict[str, Any] = {
        "median_us": {name: m * 1e6 for name, m in med.items()},
        "efx_over_eager": common.ratio(med.get("efx"), med.get("eager")),
        "efx_noeffect_over_eager_noeffect": common.ratio(med.get("efx_noeffect"), med.get("eager_noeffect")),
        "tc_over_eager": common.ratio(med.get("tc"), med.get("eager")),
        "tc_noeffect_over_eager_noeffect": common.ratio(med.get("tc_noeffect"), med.get("eager_noeffect")),
    }
    op_us = med["op"] / N_BLOCKS * 1e6
    per_effect: dict[str, Any] = {"op_eager_us": op_us}
    for system in ("eager", "efx", "tc"):
        if system in samples and f"{system}_noeffect" in samples:
            diff = _paired_diff(samples[system], samples[f"{system}_noeffect"])
            per_effect[f"{system}_us"] = diff / N_BLOCKS * 1e6
    per_effect["efx_overhead_beyond_op_us"] = per_effect["efx_us"] - op_us
    per_effect["meets_target"] = per_effect["efx_us"] <= op_us + 2.0
    # the op costs more between other ops than back to back; eager's own per-effect cost measures that
    if "eager_us" in per_effect:
        per_effect["meets_target_vs_eager_in_model"] = per_effect["efx_us"] <= per_effect["eager_us"] + 2.0
    out["per_effect"] = per_effect
    out["meets_target"] = out["efx_over_eager"] <= 1.0
    return out


def table(data: dict[str, Any]) -> str:
    rows, effect_rows = [], []
    for r in data["results"]:
        w, c = r["wall"], r["cpu"]
        m = w["median_us"]
        tc = f"{m['tc']:.0f}" if "tc" in m else ("fails" if "tc" in r["systems"] else "-")
        met = ("met" if w["meets_target"] else "NOT") + "/" + ("met" if c["meets_target"] else "NOT")
        rows.append([r["width"], r["mode"], f"{m['eager']:.0f}", f"{m['efx']:.0f}", tc,
                     *(common.fmt(v, "x") for v in (w["efx_over_eager"], c["efx_over_eager"],
                                                    w["tc_over_eager"], c["efx_noeffect_over_eager_noeffect"],
                                                    c["tc_noeffect_over_eager_noeffect"])), met])
        pw, pc = w["per_effect"], c["per_effect"]
        effect_rows.append([
            r["width"], r["mode"], f"{pw['op_eager_us']:.2f} / {pc['op_eager_us']:.2f}",
            f"{pw['eager_us']:.2f} / {pc['eager_us']:.2f}", f"{pw['efx_us']:.2f} / {pc['efx_us']:.2f}",
            f"{pw['efx_overhead_beyond_op_us']:+.2f} / {pc['efx_overhead_beyond_op_us']:+.2f}",
            f"{pw['tc_us']:.2f} / {pc['tc_us']:.2f}" if "tc_us" in pw else "-",
            ("met" if pw["meets_target"] else "NOT") + "/" + ("met" if pc["meets_target"] else "NOT"),
            ("met" if pw["meets_target_vs_eager_in_model"] else "NOT") + "/"
            + ("met" if pc["meets_target_vs_eager_in_model"] else "NOT"),
        ])
    out = [f"steady state, {N_BLOCKS} blocks, batch {BATCH}: median wall-clock us per call; ratios to eager "
           "(wall = perf_counter, cpu = process CPU time)",
           common.format_table(["width", "mode", "eager", "effectfx", "torch.compile", "efx/eager",
                                "efx/eager cpu", "tc/eager", "efx/eager cpu no-eff",
                                "tc/eager cpu no-eff", "<=1.0x wall/cpu"], rows),
           "",
           "cost per effect in us, wall / cpu: (with effects - without) / 16, "
           "median of per-round differences",
           common.format_table(["width", "mode", "op itself", "eager", "effectfx", "efx - op",
                                "torch.compile", "<= op+2us", "<= eager+2us"], effect_rows)]
    return "\n".join(out) + "\n"


# the systems drawn, each with its effect op; the no-effect variants stay in the JSON and the table
PLOTTED = {"eager": ("eager", "C2"), "efx": ("effectfx", "C0"), "tc": ("torch.compile (aot_eager)", "C3")}


def _short_error(status: str) -> str:
    if "grad_fn" in status:
        return "output has no grad_fn"
    return status.split(":")[1].strip() if status.count(":") >= 2 else status


def plot(data: dict[str, Any], path: Path) -> Path:
    """Steady-state time per call, one panel per mode: a bar per system and width, labelled with its
    ratio to eager; a system that could not run the configuration is marked where its bar would be."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    widths = data["config"]["widths"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    bar = 0.8 / len(PLOTTED)
    for ax, mode in zip(axes, ("inference", "training")):
        rows = {r["width"]: r for r in data["results"] if r["mode"] == mode}
        for k, (system, (label, color)) in enumerate(PLOTTED.items()):
            for i, width in enumerate(widths):
                r = rows.get(width)
                if r is None or system not in r["systems"]:
                    continue  # not measured here (a quick run skips torch.compile)
                x = i + (k - (len(PLOTTED) - 1) / 2) * bar
                us = r["wall"]["median_us"].get(system)
                if us is None:  # compiled but could not run: the JSON holds its error
                    ax.text(x, 0.04, "fails: " + _short_error(r["systems"][system]["status"]),
                            rotation=90, ha="center", va="bottom", color=color, fontsize=8,
                            transform=blended_transform_factory(ax.transData, ax.transAxes))
                    continue
                ax.bar(x, us, bar, color=color, label=label if i == 0 else None)
                ax.text(x, us * 1.05, f"{us / r['wall']['median_us']['eager']:.2f}x", ha="center",
                        va="bottom", fontsize=7)
        ax.set_yscale("log")
        ax.set_xlim(-0.5, len(widths) - 0.5)  # room for the marks of systems that failed
        ax.set_xticks(range(len(widths)))
        ax.set_xticklabels([f"{w} wide" for w in widths])
        ax.set_title(f"steady state, {mode} ({N_BLOCKS} blocks, batch {BATCH})")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0].set_ylabel("median wall-clock time per call (us)")
    axes[0].legend(fontsize=8, loc="upper left")
    return common.save_figure(fig, "time per call after warm-up, labels = ratio to eager", data, path)
