"""The summary, table and plot of ``benchmarks/dynamic.py``'s results, with its targets (benchmarks/README.md,
"Symbolic shapes")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import fmt, median, ratio
from benchmarks.dynamic_systems import BATCH, STATIC_OF, SYSTEMS, TC_OF


def most_compiles_of_a_segment(segments: list[dict[str, Any]]) -> int:
    """The most compiles any one segment took over the lengths: its static compile at the first length (if
    any static segment compiled) plus the variants of its symbolic form.  Not all compiles ÷ the first
    call's: the root's segments are deferred (they compile on their second run), so a first call compiles
    the bodies alone and that ratio would count the root's one symbolic compile as a body's repeat."""
    static = any(not g["symbolic"] and g["compiled"] for g in segments)
    return int(static) + max((g["variants"] for g in segments if g["symbolic"]), default=0)


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per system: captures, the first calls (each, total, first alone, ratios; medians over repetitions),
    the steady step and its ratios; then the targets."""
    steady = data["steady_state"]
    ms, cms = steady.get("step_ms", {}), steady.get("step_cpu_ms", {})
    by: dict[str, dict[str, Any]] = {}
    for system, runs in data["first_calls"].items():
        done = [r for r in runs if "calls" in r]
        s: dict[str, Any] = {"runs": len(runs), "runs_complete": len(done),
                             "status": next((r["status"] for r in runs if r.get("status") != "ok"), "ok")}
        if done:
            n = len(done[0]["calls"])
            for clock in ("wall", "cpu"):
                per = [[r["calls"][i][f"{clock}_s"] for r in done] for i in range(n)]
                s[f"calls_{clock}_s"] = [median(v) for v in per]
                s[f"first_{clock}_s"] = median([r["calls"][0][f"{clock}_s"] for r in done])
                s[f"total_{clock}_s"] = median([sum(c[f"{clock}_s"] for c in r["calls"]) for r in done])
                s[f"total4_{clock}_s"] = median([sum(c[f"{clock}_s"] for c in r["calls"][:4]) for r in done])
                s[f"total_over_first_{clock}"] = median(
                    [sum(c[f"{clock}_s"] for c in r["calls"]) / r["calls"][0][f"{clock}_s"] for r in done])
            s["captures"] = max(r["captures"] for r in done)
            s["captures_per_call"] = [c["captures"] for c in done[0]["calls"]]
            s["warmup_s"] = median([r["warmup_s"] for r in done])
            s["matches_eager"] = all(r["matches_eager"] for r in done)
            s["effects_ok"] = all(r["effects_ok"] for r in done)
            s["max_rel_diff"] = max((c["max_rel_diff"] for r in done for c in r["calls"]
                                     if c["max_rel_diff"] is not None), default=None)
            s["effects_per_call"] = sorted({c["effects"] for r in done for c in r["calls"]})
            s["valid"] = all(c["status"] == "ok" for r in done for c in r["calls"])
            if "dynamo" in done[0]:
                s["backend_compiles"] = max(r["dynamo"]["backend_compiles"] for r in done)
                s["graph_breaks"] = max(r["dynamo"]["graph_breaks"] for r in done)
            if "inductor" in done[0]:
                r0 = done[0]
                first_compiles = r0["calls"][0]["inductor"]["compiles"]
                s["inductor"] = r0["inductor"]
                s["inductor_compiles_per_call"] = [c["inductor"]["compiles"] for c in r0["calls"]]
                s["segments_first_call"] = first_compiles
                s["most_compiles_of_a_segment"] = most_compiles_of_a_segment(r0["segments"])
                s["max_variants_per_segment"] = max((g["variants"] for g in r0["segments"]), default=0)
        by[system] = s
    for system in ms:
        s = by.setdefault(system, {})
        s["step_ms"], s["step_cpu_ms"] = ms[system], cms.get(system)
        s["step_over_eager"] = ratio(ms[system], ms.get("eager"))
        s["step_over_eager_cpu"] = ratio(cms.get(system), cms.get("eager"))
        tc = TC_OF.get(system)
        if tc != system:  # torch.compile failed with the effects: its effect-free run stands in
            used = tc if tc in ms or f"{tc}_pure" not in ms else f"{tc}_pure"
            s["step_tc_used"] = used
            s["step_over_tc"] = ratio(ms[system], ms.get(used))
            s["step_over_tc_cpu"] = ratio(cms.get(system), cms.get(used))
        if system in STATIC_OF:
            s["step_over_static"] = ratio(ms[system], ms.get(STATIC_OF[system]))
            s["step_over_static_cpu"] = ratio(cms.get(system), cms.get(STATIC_OF[system]))
    for system, s in by.items():
        if system not in ms and system in steady.get("status", {}):
            s["step_status"] = steady["status"][system]
        tc = TC_OF.get(system)
        if tc and tc != system and "total_wall_s" in s:
            used = tc if by.get(tc, {}).get("valid") or not by.get(f"{tc}_pure", {}).get("valid") \
                else f"{tc}_pure"
            if "total_wall_s" in by.get(used, {}):
                s["first_tc_used"] = used
                s["total_over_tc"] = ratio(s["total_wall_s"], by[used]["total_wall_s"])
                s["total4_over_tc"] = ratio(s["total4_wall_s"], by[used]["total4_wall_s"])
                s["total4_over_tc_cpu"] = ratio(s["total4_cpu_s"], by[used]["total4_cpu_s"])
    return {"by_system": by, "targets": targets(by, len(data["config"]["lengths"]))}


def targets(by: dict[str, dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The targets (benchmarks/README.md, "Symbolic shapes"): (what, measured, limit, met); a system not
    measured gives None."""
    efx, ind = by.get("efx", {}), by.get("efx_ind", {})
    k = min(4, n)
    star = "*" if str(ind.get("first_tc_used", "")).endswith("_pure") else ""

    def row(what: str, value: float | None, limit: float, right: bool | None = True) -> dict[str, Any]:
        met = None if value is None else (value <= limit and bool(right))
        return {"target": what, "value": value, "limit": limit, "met": met, "results_right": right}

    return [
        row(f"default backend: captures over {n} lengths <= 2", efx.get("captures"), 2,
            efx.get("matches_eager")),
        row(f"default backend: total of {n} first calls <= 3x the first call (wall)",
            efx.get("total_over_first_wall"), 3.0, efx.get("matches_eager")),
        row(f"default backend: total of {n} first calls <= 3x the first call (CPU)",
            efx.get("total_over_first_cpu"), 3.0, efx.get("matches_eager")),
        row(f"inductor: compiles of one segment (body or root) over {n} lengths <= 2",
            ind.get("most_compiles_of_a_segment"), 2, ind.get("matches_eager")),
        row(f"inductor: first calls over {k} lengths <= 0.5x torch.compile(inductor)'s (wall){star}",
            ind.get("total4_over_tc"), 0.5, ind.get("matches_eager")),
        row(f"inductor: first calls over {k} lengths <= 0.5x torch.compile(inductor)'s (CPU){star}",
            ind.get("total4_over_tc_cpu"), 0.5, ind.get("matches_eager")),
        row("default backend: steady step symbolic <= 1.05x static (wall)", efx.get("step_over_static"),
            1.05),
        row("inductor: steady step symbolic <= 1.05x static (wall)", ind.get("step_over_static"), 1.05),
    ]


def _star(s: dict[str, Any], key: str, system: str) -> str:
    """``*`` when torch.compile's effect-free run stood in for the one that failed with effects."""
    used = s.get(key)
    return "*" if used and used.endswith("_pure") and TC_OF.get(system, "") + "_pure" == used else ""


def table(data: dict[str, Any]) -> str:
    by = data["summary"]["by_system"]
    n = len(data["config"]["lengths"])
    k = min(4, n)
    rows = []
    for system in SYSTEMS:
        s = by.get(system)
        if s is None:
            continue
        right = "-" if "matches_eager" not in s else "fails" if not s["valid"] else (
            ("same" if s["matches_eager"] else "WRONG") + ("" if s["effects_ok"] else ", effects differ"))
        rows.append([system, s.get("captures", "-"), s.get("backend_compiles", "-"),
                     f"{fmt(s.get('first_wall_s'), ' s', 3)} / {fmt(s.get('first_cpu_s'), '', 3)}",
                     f"{fmt(s.get('total_wall_s'), ' s', 3)} / {fmt(s.get('total_cpu_s'), '', 3)}",
                     " / ".join(fmt(s.get(f"total_over_first_{clock}"), "x") for clock in ("wall", "cpu")),
                     fmt(s.get("total4_wall_s"), " s", 3),
                     fmt(s.get("total4_over_tc"), "x", 3) + _star(s, "first_tc_used", system),
                     f"{fmt(s.get('step_ms'))} / {fmt(s.get('step_cpu_ms'))}",
                     fmt(s.get("step_over_eager"), "x"),
                     fmt(s.get("step_over_tc"), "x") + _star(s, "step_tc_used", system),
                     fmt(s.get("step_over_static"), "x"), right,
                     ",".join(str(e) for e in s.get("effects_per_call", [])) or "-"])
    steady = data["steady_state"]
    text = [f"GPT-2 (4 layers) training, batch {BATCH}, lengths {data['config']['lengths'][0]}.."
            f"{data['config']['lengths'][-1]}; first calls in fresh processes (medians of "
            f"{data['config']['reps']} repetitions, Inductor systems {data['config']['inductor_reps']}); "
            f"steady step at length {data['config']['steady_length']}, interleaved, "
            f"{steady.get('rounds', 0)} rounds" + (f"; {data['config']['label']}"
                                                   if data["config"].get("label") else ""),
            common.format_table(
                ["system", "captures", "backend", "first call (wall / CPU)", f"total of {n} (wall / CPU)",
                 "total/first", f"total of {k}", f"{k}: /tc", "step ms (wall / CPU)", "step/eager",
                 "step/tc", "sym/static", "vs eager", "effects"], rows)]
    for system, s in by.items():
        for key in ("status", "step_status"):
            if s.get(key, "ok") != "ok":
                text.append(f"  {system} {key}: {s[key][:200]}")
    ind = by.get("efx_ind", {})
    if "inductor" in ind:
        text.append(f"effectfx inductor: segment compiles after each call "
                    f"{ind['inductor_compiles_per_call']}; "
                    f"{ind['inductor']}; at most {ind['most_compiles_of_a_segment']} compiles of one "
                    f"segment, at most {ind['max_variants_per_segment']} variant(s) per segment")
    text.append("* torch.compile(inductor) failed with the effect op: its run without it stands in")
    text += ["", "targets"]
    text.append(common.format_table(["target", "measured", "limit", "status"], [
        [t["target"], t["value"] if isinstance(t["value"], int) else fmt(t["value"], "", 2), t["limit"],
         "not measured" if t["met"] is None else "met" if t["met"] else
         "NOT MET" + (" (wrong results)" if t["results_right"] is False else "")]
        for t in data["summary"]["targets"]]))
    return "\n".join(text)


def plot(data: dict[str, Any], path: Path) -> Path:
    """Each first call and their running total (log scales), and the steady step / eager's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    by, lengths = data["summary"]["by_system"], data["config"]["lengths"]
    fig, (each, cumulative, step) = plt.subplots(1, 3, figsize=(15, 4.6))
    styles = {"eager": ("k", "-"), "efx": ("C0", "-"), "efx_static": ("C0", ":"), "efx_ind": ("C1", "-"),
              "efx_ind_static": ("C1", ":"), "tc_aot": ("C2", "-"), "tc_aot_dyn": ("C2", "--"),
              "tc_ind": ("C3", "-"), "tc_ind_dyn": ("C3", "--"), "tc_ind_pure": ("C4", "-"),
              "tc_ind_dyn_pure": ("C4", "--")}
    for system in data["first_calls"]:
        s = by[system]
        if "calls_wall_s" not in s:
            continue
        color, ls = styles.get(system, ("C7", "-"))
        label = f"{SYSTEMS[system][3]} ({s['captures']} capt.)" if system != "eager" else "eager"
        wrong = " fails" if not s["valid"] else "" if s["matches_eager"] else " WRONG"
        calls = s["calls_wall_s"]
        each.plot(lengths[:len(calls)], calls, ls, color=color, marker=".", label=label + wrong)
        total, run = [], 0.0
        for c in calls:
            run += c
            total.append(run)
        cumulative.plot(lengths[:len(calls)], total, ls, color=color, marker=".", label=label + wrong)
    for ax, title in ((each, "each first call: forward + backward (fresh process)"),
                      (cumulative, "running total of the first calls")):
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (calls in this order)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("s, wall (median over repetitions)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    each.legend(fontsize=6.5, loc="upper right")
    names = [s for s in SYSTEMS if s in data["steady_state"].get("step_ms", {})]
    ms = data["steady_state"].get("step_ms", {})
    ratios = [ms[s] / ms["eager"] if ms.get("eager") else 0.0 for s in names]
    colors = [styles.get(s, ("C7", "-"))[0] for s in names]
    bars = step.bar(range(len(names)), ratios, color=colors)
    for bar, s in zip(bars, names):
        if SYSTEMS[s][2] is False:
            bar.set_hatch("//")
        step.annotate(f"{ms[s]:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                      va="bottom", fontsize=6.5)
    step.axhline(1.0, color="k", lw=0.8)
    step.set_ylim(0, max([1.2, *(r * 1.1 for r in ratios)]))
    step.set_xticks(range(len(names)))
    step.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
    step.set_ylabel("training step / eager's (median wall; ms on the bars)")
    step.set_title(f"steady step at length {data['config']['steady_length']} (hatched: static program)",
                   fontsize=10)
    step.grid(True, axis="y", alpha=0.3)
    title = f"symbolic shapes: GPT-2 training over {len(lengths)} sequence lengths, 1 thread"
    return common.save_figure(fig, title, data, path)
