"""The summary, table and plot of ``benchmarks/dynamo_backend.py``'s results, with its targets
(benchmarks/README.md, "Behind torch.compile")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import fmt, median_or_none
from benchmarks.dynamo_backend_systems import LABELS, TARGETS


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per system: first calls, captures, effects kept, the steady step and its ratios; each target."""
    first, steady = data["first_call"], data["steady_state"]
    step, step_cpu = steady.get("step_ms", {}), steady.get("step_cpu_ms", {})
    samples = steady.get("samples_ms", {})
    ncalls = data["config"]["calls"]
    out: dict[str, Any] = {}
    for system in data["config"]["systems_run"]:
        runs = first.get(system, [])
        ok = [r for r in runs if r.get("status") == "ok"]
        check = steady.get("checks", {}).get(system, {})
        checks = [r["check"] for r in ok] + ([check] if check.get("steps") else [])
        status = steady.get("status", {})  # per system, or the whole steady child's failure
        steady_status = status.get(system) if isinstance(status, dict) else status
        call = [{k: median_or_none([r["calls"][i][k] for r in ok if len(r["calls"]) > i])
                 for k in ("wall_s", "cpu_s")} for i in range(ncalls)]
        s: dict[str, Any] = {
            "label": LABELS[system],
            "first_s": call[0]["wall_s"], "first_cpu_s": call[0]["cpu_s"],
            "calls_s": [c["wall_s"] for c in call], "calls_cpu_s": [c["cpu_s"] for c in call],
            "warmup_s": median_or_none([r.get("warmup_s") for r in ok]),
            "captures": sorted({r["captures"] for r in ok}),
            "captures_per_call": sorted({tuple(c["captures"] for c in r["calls"]) for r in ok}),
            "graphs": sorted({r["graphs"] for r in ok if r.get("graphs") is not None}),
            "captures_while_timing": check.get("captures_while_timing"),
            "first_ok_runs": len(ok), "first_runs": len(runs),
            "failure": next((r["status"] for r in runs if r.get("status") != "ok"), None) or (
                steady_status if steady_status not in (None, "ok") else None),
            "effects_equal_eager": bool(checks) and all(c["effects_equal_eager"] for c in checks),
            "effects_kept": sum(c["effects_kept"] for c in checks),
            "eager_effects": sum(c["eager_effects"] for c in checks),
            "effects_per_step": sorted({n for c in checks for n in c["effects_per_step"]}),
            "max_loss_diff": max((c["max_loss_diff"] for c in checks if c["max_loss_diff"] is not None),
                                 default=None),
            "max_param_diff": check.get("max_param_diff"),
            "step_ms": step.get(system), "step_cpu_ms": step_cpu.get(system)}
        for other in ("eager", "efx_compile", "tc_inductor", "tc_aot_eager"):
            mine = other != system
            s[f"over_{other}"] = common.ratio(step.get(system), step.get(other)) if mine else None
            s[f"cpu_over_{other}"] = common.ratio(step_cpu.get(system), step_cpu.get(other)) if mine else None
            s[f"paired_over_{other}"] = (common.paired(samples.get(system), samples.get(other))
                                         if mine else None)
        out[system] = s
    for s in out.values():  # first calls against each other's
        for other in ("eager", "efx_compile", "tc_inductor", "tc_aot_eager"):
            s[f"first_over_{other}"] = common.ratio(s["first_s"], out.get(other, {}).get("first_s"))
    targets: dict[str, Any] = {}
    if "efx_backend" in out:
        b = out["efx_backend"]
        targets["backend_keeps_effects"] = {"target": "every effect, in eager's order",
                                            "value": f"{b['effects_kept']} of {b['eager_effects']}",
                                            "met": b["effects_equal_eager"] and b["effects_kept"] > 0}
        first_ratio = b["first_over_tc_aot_eager"]
        if first_ratio is not None:  # (one call per process: no rounds to pair, so the ratio is told as text)
            cpu = common.ratio(b["first_cpu_s"], out["tc_aot_eager"]["first_cpu_s"])
            targets["backend_first_over_aot_eager"] = {
                "target": f"<= {TARGETS['backend_first_over_aot_eager']}x",
                "value": f"{first_ratio:.3f}x (CPU {fmt(cpu, 'x', 3)})", "ratio": first_ratio,
                "met": first_ratio <= TARGETS["backend_first_over_aot_eager"]}
        ratio, rounds = b["over_eager"], b["paired_over_eager"]
        if ratio is not None and rounds is not None:
            targets["backend_step_over_eager"] = {
                "target": f"<= {TARGETS['backend_step_over_eager']}x", "value": ratio,
                "cpu": b["cpu_over_eager"], "paired": rounds,
                "met": ratio <= TARGETS["backend_step_over_eager"]}
    return {"systems": out, "targets": targets}


def table(data: dict[str, Any]) -> str:
    summary = data["summary"]["systems"]
    rows = []
    for system, s in summary.items():
        rows.append([
            system, ",".join(str(c) for c in s["captures"]) or "-", ",".join(map(str, s["graphs"])) or "-",
            f"{fmt(s['first_s'], ' s')} / {fmt(s['first_cpu_s'], ' s')}",
            " / ".join(fmt(x, "", 3) for x in s["calls_s"][1:]),
            f"{fmt(s['step_ms'], '', 2)} / {fmt(s['step_cpu_ms'], '', 2)}",
            fmt(s["over_eager"], "x"), fmt(s["first_over_tc_aot_eager"], "x"),
            f"{s['effects_kept']} of {s['eager_effects']}" + ("" if s["effects_equal_eager"] else " DIFFER"),
            common.sci(s["max_loss_diff"]), common.sci(s["max_param_diff"]), (s["failure"] or "")[:60]])
    cfg, st = data["config"], data["steady_state"]
    head = f"{cfg['label']}: " if cfg.get("label") else ""
    m = data["machine"]
    load = ", ".join(f"{x:.2f}" for x in m["load_average"])
    text = [head + f"GPT-2 ({cfg['model']['layers']} layers, hidden {cfg['model']['hidden']}), AdamW "
            f"training step (optimizer eager), batch {cfg['model']['batch']} x 8 tokens, "
            f"{m['torch_threads']} thread(s); "
            f"first call: median of {cfg['reps']} fresh processes ({cfg['inductor_reps']} for Inductor); "
            f"steady: medians of {st.get('rounds', 0)} interleaved rounds (ms per step); checks after "
            f"{cfg['check_steps']} steps vs eager; load average {load}",
            common.format_table(["system", "captures", "graphs", "first call wall / CPU", "calls 2 / 3 s",
                                 "step ms wall / CPU", "/eager", "first /aot_eager", "effects kept",
                                 "max |dloss|", "max |dparam|", "failure"], rows)]
    return "\n".join(text + common.targets_lines(data["summary"]["targets"]))


COLORS = {"eager": "C7", "efx_backend": "C0", "efx_backend_inductor": "C9", "tc_inductor": "C3",
          "tc_aot_eager": "C1", "efx_compile": "C2"}


def plot(data: dict[str, Any], path: Path) -> Path:
    """First call per system (log scale, effects kept annotated) and the steady step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data["summary"]["systems"]
    names = [s for s in summary if summary[s]["first_s"] is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    xs = list(range(len(names)))
    left.bar(xs, [summary[s]["first_s"] for s in names], color=[COLORS[s] for s in names], label="call 1")
    left.scatter(xs, [summary[s]["first_cpu_s"] or float("nan") for s in names], marker="_", s=80, color="k",
                 zorder=5, label="CPU time, call 1")
    for x, s in zip(xs, names):
        note = f"effects {summary[s]['effects_kept']}/{summary[s]['eager_effects']}"
        left.annotate(note, (x, summary[s]["first_s"] * 1.15), ha="center", va="bottom", fontsize=6)
    left.set_yscale("log")
    left.set_ylim(top=left.get_ylim()[1] * 4)
    left.set_ylabel("s (median wall, log scale)")
    left.set_title("first training step (fresh process)", fontsize=10)
    steady = [s for s in summary if summary[s]["step_ms"] is not None]
    xs2 = list(range(len(steady)))
    right.bar(xs2, [summary[s]["step_ms"] for s in steady], color=[COLORS[s] for s in steady],
              label="wall (median)")
    right.scatter(xs2, [summary[s]["step_cpu_ms"] for s in steady], marker="_", s=80, color="k", zorder=5,
                  label="CPU (median)")
    for x, s in zip(xs2, steady):
        r = summary[s]["over_eager"]
        note = f"{r:.2f}x eager" if r is not None else ""
        if not summary[s]["effects_equal_eager"]:
            note += "\neffects lost"
        right.annotate(note, (x, summary[s]["step_ms"] * 1.02), ha="center", va="bottom", fontsize=6)
    right.set_ylabel("ms per training step (median)")
    right.set_ylim(top=right.get_ylim()[1] * 1.2)
    right.set_title("steady training step (interleaved rounds)", fontsize=10)
    for ax, labels, where in ((left, names, "upper left"), (right, steady, "upper right")):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.legend(fontsize=7, loc=where)
        ax.grid(True, axis="y", alpha=0.3)
    layers, threads = data["config"]["model"]["layers"], data["machine"]["torch_threads"]
    return common.save_figure(fig, f"behind torch.compile: GPT-2 ({layers} layers) training step, {threads} "
                              "thread(s)", data, path)
