"""The summary, table and plot of ``benchmarks/tiers.py``'s results, with the targets it checks
(benchmarks/README.md, "Tiered compilation")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import fmt
from benchmarks.tiers_systems import LABELS, SYSTEMS, compare_logs, max_rel_diff

TC = ("tc", "tc_pure")  # the torch.compile run the ratios are against: the first that ran
# time to train: the default tiers; the steady step: tier 2's (at-once: from the first step; the default's
# time rule builds it only once the steps paid for it, Note [When tier 2 pays], after a 300-step run)
TARGETS = {"time_to_train": ("efx_tiered", 0.8), "steady_step": ("efx_at_once", 0.97)}
WARM_TARGET = ("efx_tiered_warm", 1.0)  # a second process's first step (forward, backward, AdamW), seconds


def _switches(run: dict[str, Any]) -> list[int | None]:
    """Per program (creation order): the first step (1-based, the steady steps after the N included) it ran
    in tier 2; None if never."""
    out: list[int | None] = []
    for k in range(max((len(t) for t in run.get("tiers", [])), default=0)):
        out.append(next((i + 1 for i, t in enumerate(run["tiers"]) if len(t) > k and t[k] == 2), None))
    return out


def run_has_tier2(data: dict[str, Any], system: str) -> bool:
    return SYSTEMS[system][1] in ("background", "at-once") and data["runs"][system].get("status") == "ok"


def _tc(data: dict[str, Any]) -> str | None:
    return next((s for s in TC if data["runs"].get(s, {}).get("status") == "ok"), None)


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per system: time to train, steady step, ratios to torch.compile's, tier 2's build, the switch, the
    checks against eager; each target's verdict."""
    runs, cfg = data["runs"], data["config"]
    eager = runs.get("eager", {})
    tc = _tc(data)
    steps, last = cfg["steps"], cfg["steady_steps"]
    per: dict[str, Any] = {}
    for system, run in runs.items():
        if run.get("status") != "ok":
            per[system] = {"label": LABELS[system], "failure": run.get("status")}
            continue
        cum = run["cumulative_s"]
        times = [b - a for a, b in zip([0.0, *cum], cum)]
        switches = _switches(run)
        switch = switches[-1] if switches else None  # the program that serves every step after the first
        logs = compare_logs(run["logs"], eager["logs"]) if SYSTEMS[system][2] and eager.get("logs") else None
        around = None
        if logs is not None and switch is not None:
            around = {str(i): logs["equal"][i - 1] for i in range(max(1, switch - 1), switch + 2)
                      if i <= len(logs["equal"])}
        states = run.get("tier_states", [])
        built = [s["compile_wall_s"] for s in states if s["compile_wall_s"] is not None]
        per[system] = {
            "label": LABELS[system], "failure": None,
            "time_to_train_s": cum[-1], "cpu_s": run["cpu_s"], "warmup_s": run["warmup_s"],
            "first_step_s": times[0], "steady_ms": common.median(run["steady_s"]) * 1e3,
            "last_steps_ms": common.median(times[-last:]) * 1e3,
            "switch_steps": switches, "switch_step": switch, "tiers_after_wait": run.get("tiers_after_wait"),
            "waited_s": run.get("waited_s"),
            "tier2_compile_s": sum(built) if built else None,
            "tier2_compile_thread_cpu_s": sum(s["compile_thread_cpu_s"] for s in states
                                              if s["compile_thread_cpu_s"] is not None) if built else None,
            "tier2_errors": [s["error"] for s in states if s["error"]],
            "peak_rss_mb": run["peak_rss_mb"], "peak_rss_children_mb": run.get("peak_rss_children_mb"),
            "peak_rss_over_start_mb": run["peak_rss_mb"] - run["rss_start_mb"],
            "switched_within_steps": switch is not None and switch <= steps,
            "effects": None if logs is None else {k: v for k, v in logs.items() if k != "equal"},
            "effects_around_switch": around,
            "max_loss_rel_diff": max_rel_diff(run["losses"], eager.get("losses", [])),
        }
    base = per.get(tc or "", {})
    tier1 = per.get("efx_tier1", {})
    for system, s in per.items():
        if s["failure"] is None:
            s["train_over_tc"] = common.ratio(s["time_to_train_s"], base.get("time_to_train_s"))
            s["cpu_over_tc"] = common.ratio(s["cpu_s"], base.get("cpu_s"))
            s["steady_over_tc"] = common.ratio(s["steady_ms"], base.get("steady_ms"))
            has_tier2 = tier1.get("peak_rss_mb") and run_has_tier2(data, system)
            s["peak_rss_over_tier1_mb"] = s["peak_rss_mb"] - tier1["peak_rss_mb"] if has_tier2 else None
    targets = {}
    for name, (system, limit) in TARGETS.items():
        s = per.get(system, {})
        value = s.get("train_over_tc" if name == "time_to_train" else "steady_over_tc")
        if value is not None:
            cpu = s.get("cpu_over_tc") if name == "time_to_train" else None
            targets[f"{name} ({system} / {tc})"] = {"target": f"<= {limit}x", "value": value, "cpu": cpu,
                                                    "met": value <= limit}
    system, limit = WARM_TARGET
    first = per.get(system, {}).get("first_step_s")
    if first is not None:
        targets[f"warm start ({system}, first step)"] = {"target": f"<= {limit} s", "value": first,
                                                         "cpu": None, "met": first <= limit, "unit": " s"}
    return {"systems": per, "tc": tc, "targets": targets, "steps": steps}


def table(data: dict[str, Any]) -> str:
    summary = data.get("summary") or summarize(data)
    cfg, per, tc = data["config"], summary["systems"], summary["tc"]
    head = (f"Tiered compilation: GPT-2, {cfg['layers']} layers, ids {cfg['batch']}, AdamW; "
            f"{cfg['steps']} steps timed, compiles included; steady = median of {cfg['steady_steps']} steps "
            f"after them; ratios against {tc or '-'}")
    rows = []
    for system, s in per.items():
        if s["failure"]:
            rows.append([system, f"failed: {s['failure'][:90]}"] + [""] * 10)
            continue
        eff = s["effects"]
        rows.append([
            system, fmt(s["time_to_train_s"], " s", 1), fmt(s["cpu_s"], " s", 1),
            fmt(s["train_over_tc"], "x"),
            fmt(s["first_step_s"], " s", 1), fmt(s["steady_ms"], " ms"), fmt(s["steady_over_tc"], "x", 3),
            ",".join("-" if w is None else str(w) for w in s["switch_steps"]) or "-",
            fmt(s["tier2_compile_s"], " s", 1), fmt(s["peak_rss_mb"], " MB", 0),
            "n/a" if eff is None else f"{eff['steps_equal']}/{eff['steps']}",
            "-" if s["max_loss_rel_diff"] is None else f"{s['max_loss_rel_diff']:.1e}"])
    lines = [head, "", common.format_table(
        ["system", "to train", "CPU", "x tc", "step 1", "steady", "x tc", "tier 2 at step", "tier 2 build",
         "peak RSS", "effects = eager", "loss rel. diff"], rows)]
    for system, s in per.items():
        run = data["runs"][system]
        for k, state in enumerate(run.get("tier_states", [])):
            lines.append(f"  {system} program {k + 1}: {state['describe']}")
        if s.get("effects_around_switch") is not None:
            lines.append(f"  {system}: effect log = eager's at steps around the switch: "
                         f"{s['effects_around_switch']}")
        if s.get("peak_rss_over_tier1_mb") is not None:
            lines.append(f"  {system}: peak RSS {s['peak_rss_over_tier1_mb']:+.0f} MB over tier 1's "
                         f"({s['peak_rss_over_start_mb']:+.0f} MB over its RSS before the first step)")
        if s.get("switch_step") is not None and not s["switched_within_steps"]:
            lines.append(f"  {system}: tier 2 not ready within the {cfg['steps']} steps: waited "
                         f"{fmt(s['waited_s'], ' s', 1)} for it after them")
    if summary["targets"]:  # (common.targets_lines wants per-round ratios, which one run per system lacks)
        lines += ["", "targets:"]
    for name, t in summary["targets"].items():
        cpu = f" (CPU {fmt(t['cpu'], 'x', 3)})" if t["cpu"] is not None else ""
        unit = t.get("unit", "x")
        lines.append(f"  {name}: {t['target']}: {t['value']:.3f}{unit.strip()}{cpu} -> "
                     f"{'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> Path:
    """Left: cumulative seconds after every step, one line per system (a dot where tier 2 took over);
    right: each step's time (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data.get("summary") or summarize(data)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for system, run in data["runs"].items():
        if run.get("status") != "ok":
            continue
        cum = run["cumulative_s"]
        steps = list(range(1, len(cum) + 1))
        times = [(b - a) * 1e3 for a, b in zip([0.0, *cum], cum)]
        (line,) = left.plot(steps, cum, label=LABELS[system], lw=1.6)
        right.plot(steps, times, lw=1.0, color=line.get_color())
        switch = summary["systems"][system].get("switch_step")
        if switch is not None and switch <= len(cum):
            left.plot([switch], [cum[switch - 1]], "o", color=line.get_color())
            right.axvline(switch, color=line.get_color(), ls=":", lw=0.8)
    left.set_xlabel("training steps")
    left.set_ylabel("cumulative wall seconds (compiles included)")
    left.set_title("time to train (dot: tier 2 from this step)", fontsize=9)
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    right.set_yscale("log")
    right.set_xlabel("training steps")
    right.set_ylabel("step wall ms")
    right.set_title("each step (dotted: the switch)", fontsize=9)
    right.grid(alpha=0.3)
    cfg = data["config"]
    return common.save_figure(fig, f"Tiered compilation: GPT-2, {cfg['layers']} layers, AdamW", data, path)
