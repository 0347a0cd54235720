"""The summary, table and plot of ``benchmarks/train_step.py``'s results, with its targets
(benchmarks/README.md, "Compiled training step")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import fmt, median_or_none
from benchmarks.train_step_systems import LABELS, STATE_KEYS, SYSTEMS, TARGETS, reference_of


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
        call = [{k: median_or_none([r["calls"][i][k] for r in ok if len(r["calls"]) > i])
                 for k in ("wall_s", "cpu_s")} for i in range(ncalls)]
        ref = reference_of(system)
        s: dict[str, Any] = {
            "label": LABELS[system], "reference": ref,
            "first_s": call[0]["wall_s"], "first_cpu_s": call[0]["cpu_s"],
            "calls_s": [c["wall_s"] for c in call], "calls_cpu_s": [c["cpu_s"] for c in call],
            "warmup_s": median_or_none([r.get("warmup_s") for r in ok]),
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
        for other, key in ((ref, "eager"), ("efx_model", "efx_model"), ("tc_step", "tc"),
                           ("efx_step", "efx_step")):
            mine = other != system
            s[f"over_{key}"] = common.ratio(step.get(system), step.get(other)) if mine else None
            s[f"cpu_over_{key}"] = common.ratio(step_cpu.get(system), step_cpu.get(other)) if mine else None
            s[f"paired_over_{key}"] = None if system == other else common.paired(samples.get(system),
                                                                               samples.get(other))
        s["first_over_eager"] = common.ratio(s["first_s"], median_or_none(
            [r["calls"][0]["wall_s"] for r in first.get(ref, []) if r.get("status") == "ok"]))
        out[system] = s
    targets: dict[str, Any] = {}
    if "efx_step" in out:
        c = out["efx_step"]["captures"]
        targets["step_captures"] = {"target": f"== {TARGETS['step_captures']}", "value": c,
                                    "met": bool(c) and set(c) == {TARGETS["step_captures"]}
                                    and out["efx_step"]["captures_in_checks"] == TARGETS["step_captures"]}
    if "efx_step_cosine" in out:  # a new float lr every step: an input after the first change
        c = out["efx_step_cosine"]["captures"]
        targets["cosine_captures"] = {"target": f"<= {TARGETS['cosine_captures']}", "value": c,
                                      "met": bool(c) and max(c) <= TARGETS["cosine_captures"]
                                      and out["efx_step_cosine"]["captures_while_timing"] == 0}
    for system, name, over in (("efx_step", "step_over_efx_model", "efx_model"),
                               ("efx_step_inductor", "inductor_over_efx_model", "efx_model"),
                               ("efx_step_cosine", "cosine_over_step", "efx_step")):
        if system in out and out[system][f"over_{over}"] is not None:
            ratio = out[system][f"over_{over}"]
            targets[name] = {"target": f"<= {TARGETS[name]}x", "value": ratio,
                             "cpu": out[system][f"cpu_over_{over}"],
                             "paired": out[system][f"paired_over_{over}"], "met": ratio <= TARGETS[name]}
    return {"systems": out, "targets": targets}


def table(data: dict[str, Any]) -> str:
    summary = data["summary"]["systems"]
    rows = []
    for system, s in summary.items():
        state = s["max_state_diff"] or {}
        calls = " / ".join(fmt(x, "", 3) for x in s["calls_s"][1:])
        rows.append([
            system, ",".join(str(c) for c in s["captures"]) or "-",
            f"{fmt(s['first_s'], ' s')} / {fmt(s['first_cpu_s'], ' s')}", calls,
            f"{fmt(s['step_ms'], '', 2)} / {fmt(s['step_cpu_ms'], '', 2)}",
            fmt(s["over_eager"], "x"), fmt(s["over_efx_model"], "x"), fmt(s["over_tc"], "x"),
            ("same" if s["effects_equal_eager"] else "DIFFER")
            + f" ({'/'.join(map(str, s['effects_per_step']))})",
            common.sci(s["max_loss_diff"]), common.sci(s["max_param_diff"]),
            " / ".join(common.sci(state.get(k)) for k in STATE_KEYS), (s["failure"] or "")[:60]])
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
    return "\n".join(text + common.targets_lines(data["summary"]["targets"]))


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
