"""The report of ``benchmarks/resnet.py``: the summary of a run's results against eager and torch.compile,
its table and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import ratio_unless_nan
from benchmarks.resnet_systems import SHORT


def _result(data: dict[str, Any], system: str) -> dict[str, Any] | None:
    return next((r for r in data["results"] if r["system"] == system), None)


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    eager, efx_ = _result(data, "eager"), _result(data, "efx")
    summary: dict[str, Any] = {"by_system": {}}
    for r in data["results"]:
        fc, st = r["first_call"], r["step"]
        summary["by_system"][r["system"]] = {
            "first_call_ms": fc["median_s"] * 1e3,
            "first_call_cpu_ms": fc["cpu_median_s"] * 1e3,
            "second_call_ms": fc["second_call_median_s"] * 1e3,
            "first_two_calls_ms": (fc["median_s"] + fc["second_call_median_s"]) * 1e3,
            "step_ms": st["median_s"] * 1e3,
            "step_cpu_ms": st["cpu_median_s"] * 1e3,
            "first_call_over_efx": ratio_unless_nan(fc["median_s"], efx_ and efx_["first_call"]["median_s"]),
            "first_call_over_efx_cpu": ratio_unless_nan(fc["cpu_median_s"],
                                                        efx_ and efx_["first_call"]["cpu_median_s"]),
            "first_two_calls_over_efx": ratio_unless_nan(fc["median_s"] + fc["second_call_median_s"],
                                                         efx_ and efx_["first_call"]["median_s"]
                                                         + efx_["first_call"]["second_call_median_s"]),
            "step_over_eager": ratio_unless_nan(st["median_s"], eager and eager["step"]["median_s"]),
            "step_over_eager_cpu": ratio_unless_nan(st["cpu_median_s"],
                                                    eager and eager["step"]["cpu_median_s"]),
            "step_over_efx": ratio_unless_nan(st["median_s"], efx_ and efx_["step"]["median_s"]),
            "first_call_ok": fc["ok"],
            "step_ok": st["status"] == "ok",
            "effects_correct": r["effects_correct"],
            "matches_eager": r["matches_eager"],
        }
    s = summary["by_system"]
    if "efx" in s:
        summary["efx_over_eager_step"] = s["efx"]["step_over_eager"]
        summary["efx_over_eager_step_cpu"] = s["efx"]["step_over_eager_cpu"]
        summary["efx_correct"] = bool(s["efx"]["matches_eager"] and s["efx"]["effects_correct"])
    for tc in ("tc", "tc_region"):
        if tc in s and "efx" in s:
            summary[f"{tc}_over_efx_first_call"] = s[tc]["first_call_over_efx"]
            summary[f"{tc}_over_efx_first_call_cpu"] = s[tc]["first_call_over_efx_cpu"]
            summary[f"{tc}_over_efx_step"] = s[tc]["step_over_efx"]
    return summary


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None or value != value else f"{value:{spec}}{suffix}"


def table(data: dict[str, Any]) -> str:
    s = data["summary"]["by_system"]
    rows = []
    for r in data["results"]:
        m = s[r["system"]]
        correct = "yes" if r["matches_eager"] and r["effects_correct"] else "NO"
        if not r["matches_eager"] or not r["effects_correct"]:
            fc = r["first_call"]
            notes = [x for x in fc["status"] + [r["step"]["status"]] if x != "ok"]
            if fc["matches_eager"] is False:
                bad = [p for p in ("loss", "grads", "buffers") if fc["runs"][0].get(f"{p}_matches") is False]
                notes.append("differs: " + ",".join(bad))
            if r["step"]["state_after_warmup"]["matches_eager"] is False:
                notes.append("state after warm-up differs")
            if not r["effects_correct"]:
                notes.append(f"effects {fc['effects_per_call']}/{fc['second_call_effects']}"
                             f"/{r['step']['effects_per_step']}")
            correct += " (" + "; ".join(dict.fromkeys(notes))[:100] + ")"
        over = m["first_call_over_efx"]
        rows.append([SHORT[r["system"]], _fmt(m["first_call_ms"]), _fmt(m["first_call_cpu_ms"]),
                     _fmt(m["second_call_ms"]), _fmt(over, ".2f" if (over or 0) < 1 else ".1f", "x"),
                     _fmt(m["step_ms"], ".2f"), _fmt(m["step_cpu_ms"], ".2f"),
                     _fmt(m["step_over_eager"], ".2f", "x"), _fmt(m["step_over_efx"], ".2f", "x"), correct])
    cfg = data["config"]
    head = (f"ResNet ({cfg['blocks']} basic blocks, hidden {cfg['resnet_config']['hidden_sizes']}), batch "
            f"{'x'.join(map(str, cfg['batch']))}, training; median wall ms (cpu = process CPU time); "
            f"steady state over {cfg['rounds']} rounds")
    return head + "\n" + common.format_table(
        ["system", "1st call", "cpu", "2nd call", "1st/efx", "step", "cpu", "step/eager", "step/efx",
         "matches eager, effects"], rows) + "\n"


def plot(data: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"eager": "C2", "efx": "C0", "efx_noregion": "C9", "tc": "C1", "tc_region": "C3",
              "tc_region_shared": "C5"}
    results = data["results"]
    names = [SHORT[r["system"]].replace(" ", "\n", 1) for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    ax = axes[0]
    xs = range(len(results))
    first = [r["first_call"]["median_s"] * 1e3 for r in results]
    second = [r["first_call"]["second_call_median_s"] * 1e3 for r in results]
    w = 0.4
    bar_colors = [colors[r["system"]] for r in results]
    ax.bar([x - w / 2 for x in xs], first, w, color=bar_colors, label="first call")
    ax.bar([x + w / 2 for x in xs], second, w, color=bar_colors, alpha=0.45,
           hatch="//", label="second call (recompile: problem_type)")
    ax.scatter([x - w / 2 for x in xs], [r["first_call"]["cpu_median_s"] * 1e3 for r in results], marker="_",
               s=150, color="k", zorder=5, label="CPU time (median)")
    for x, v in zip(xs, first):
        ax.annotate(_fmt(v, ".0f"), (x - w / 2, v), ha="center", va="bottom", fontsize=7)
    for x, r in zip(xs, results):
        if not (r["matches_eager"] and r["effects_correct"]):
            failed = any(st.startswith("error") for st in r["first_call"]["status"])
            top = max(v for v in (first[x], second[x]) if v == v)
            ax.annotate("error" if failed else "wrong", (x, top * 1.6), ha="center", color="red", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(top=max(v for v in first + second if v == v) * 12)  # room for the legend
    ax.set_ylabel("ms (log scale)")
    ax.set_title("first call: compile + one training step", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", ncol=3)
    ax = axes[1]
    steps = [r["step"]["median_s"] * 1e3 for r in results]
    lo = [r["step"]["median_s"] * 1e3 - _quantile(r["step"]["runs_s"], 0.25) * 1e3 for r in results]
    hi = [_quantile(r["step"]["runs_s"], 0.75) * 1e3 - r["step"]["median_s"] * 1e3 for r in results]
    ax.bar(xs, steps, 0.6, color=[colors[r["system"]] for r in results], yerr=[lo, hi], capsize=3)
    ax.scatter(xs, [r["step"]["cpu_median_s"] * 1e3 for r in results], marker="_", s=300, color="k",
               zorder=5, label="CPU time (median)")
    for x, r in zip(xs, results):
        if r["step"]["status"] != "ok":
            ax.annotate("did not\nrun", (x, 0), ha="center", va="bottom", color="red", fontsize=8,
                        xytext=(0, 4), textcoords="offset points")
    ax.set_ylim(0, max(v for v in steps if v == v) * 1.45)  # room for the legend
    ax.legend(fontsize=7, loc="upper left")
    for x, v in zip(xs, steps):
        ax.annotate(_fmt(v, ".1f"), (x, v), ha="center", va="bottom", fontsize=7, xytext=(8, 2),
                    textcoords="offset points")
    ax.set_ylabel("ms per step (median, bars: quartiles)")
    ax.set_title("steady-state training step (fwd + bwd + SGD)", fontsize=10)
    for a in axes:
        a.set_xticks(list(xs))
        a.set_xticklabels(names, fontsize=8)
        a.grid(True, axis="y", alpha=0.3)
    cfg = data["config"]
    title = (f"HF ResNet, {cfg['blocks']} blocks as regions, batch {'x'.join(map(str, cfg['batch']))}, "
             "1 thread, torch.compile backend aot_eager")
    return common.save_figure(fig, title, data, path)


def _quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]
