"""The summary, table and plot of ``benchmarks/generate.py``'s results, with its targets
(benchmarks/README.md, "Generation")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import fmt, median_of_ok_runs
from benchmarks.generate_systems import SYSTEMS, effects_expected, reference_of, tc_of

# captures of effectfx's static and dynamic cache, and its static decode step over eager's
TARGETS = {"static_captures": 2, "dynamic_captures": 3, "static_token_over_eager": 1.0}


def _paired(samples: dict[str, Any], system: str, other: str, field: str) -> dict[str, float] | None:
    """The per-round ratio ``system / other`` of ``field`` (one call of each per round): common.paired."""
    if system == other:
        return None
    return common.paired(samples.get(system, {}).get(field), samples.get(other, {}).get(field))


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per system: first call, captures, steady times, their ratios to eager and torch.compile, checks;
    and each target's verdict."""
    first, steady = data["first_call"], data["steady_state"]
    med = steady.get("medians", {})
    checks = steady.get("checks", {})
    eager_tokens = {s: c["tokens"] for s, c in checks.items() if SYSTEMS[s][0] == "eager"}
    out: dict[str, Any] = {}
    for system in data["config"]["systems"]:
        runs = first.get(system, [])
        ok = [r for r in runs if r.get("status") == "ok"]
        m, c = med.get(system, {}), checks.get(system, {})
        ref, tc = reference_of(system), tc_of(system)
        # every check made of this system: in its first-call processes and in the steady-state one
        tokens_same = [r[k] for r in ok for k in ("tokens_equal_eager", "second_tokens_equal_eager")]
        tokens_same += [r["tokens"] == eager_tokens[ref] for r in ok if ref in eager_tokens]
        tokens_same += [c[k] for k in ("tokens_equal_eager", "timed_tokens_equal_eager") if k in c]
        tokens_same += [c["tokens"] == eager_tokens[ref]] if c and ref in eager_tokens else []
        effects_same = [r[k] for r in ok for k in ("effects_equal_eager", "second_effects_equal_eager")]
        effects_same += [c["effects_equal_eager"]] if c else []
        effects_same += [c["effects_per_generate_timed"] == [c["effects_per_generate"][-1]]] if c else []
        s: dict[str, Any] = {
            "first_s": median_of_ok_runs(runs, "wall_s"), "first_cpu_s": median_of_ok_runs(runs, "cpu_s"),
            "second_s": median_of_ok_runs(runs, "second_s"),
            "compiles": sorted({r["compiles"] for r in ok}),
            "compiles_after_second": sorted({r["compiles_after_second"] for r in ok}),
            "first_ok_runs": len(ok), "first_runs": len(runs),
            "first_failure": next((r["status"] for r in runs if r.get("status") != "ok"), None),
            "tokens_equal_eager": bool(tokens_same) and all(tokens_same),
            "effects_equal_eager": bool(effects_same) and all(effects_same),
            "max_logit_diff": c.get("max_logit_diff"),
            "compiles_in_timing": c.get("compiles_in_timing"),
            "effects": sorted({r["effects"] for r in ok} | set(c.get("effects_per_generate", []))),
            "effects_expected": effects_expected(system, data["config"]["tokens"]),
            "steady_status": steady.get("status", {}).get(system),
            "generate_ms": _ms(m.get("generate_s")), "generate_cpu_ms": _ms(m.get("generate_cpu_s")),
            "token_ms": _ms(m.get("token_s")), "token_cpu_ms": _ms(m.get("token_cpu_s")),
            "forward_ms": _ms(m.get("forward_s")), "forward_cpu_ms": _ms(m.get("forward_cpu_s")),
            "reference": ref, "tc_reference": tc}
        r, t = med.get(ref, {}), med.get(tc, {}) if tc else {}
        for field in ("generate_s", "generate_cpu_s", "token_s", "token_cpu_s", "forward_s"):
            s[f"{field[:-2]}_over_eager"] = common.ratio(m.get(field), r.get(field))
            s[f"{field[:-2]}_over_tc"] = common.ratio(m.get(field), t.get(field))
        s["token_paired_over_eager"] = _paired(steady.get("samples", {}), system, ref, "token_s")
        s["token_paired_over_tc"] = _paired(steady.get("samples", {}), system, tc, "token_s") if tc else None
        s["first_over_eager"] = common.ratio(s["first_s"], median_of_ok_runs(first.get(ref, []), "wall_s"))
        s["first_over_tc"] = common.ratio(s["first_s"], median_of_ok_runs(first.get(tc, []), "wall_s")) \
            if tc else None
        out[system] = s
    targets: dict[str, Any] = {}
    if "efx_static" in out:
        c = out["efx_static"]["compiles"]
        targets["static_captures"] = {"target": f"<= {TARGETS['static_captures']}", "value": c,
                                      "met": bool(c) and max(c) <= TARGETS["static_captures"]}
        ratio = out["efx_static"]["token_over_eager"]
        cpu = out["efx_static"]["token_cpu_over_eager"]
        targets["static_token_over_eager"] = {
            "target": f"<= {TARGETS['static_token_over_eager']}x", "value": ratio, "cpu": cpu,
            "paired": out["efx_static"]["token_paired_over_eager"],
            "met": ratio is not None and ratio <= TARGETS["static_token_over_eager"]}
    if "efx_dynamic" in out:
        c = out["efx_dynamic"]["compiles"]
        targets["dynamic_captures"] = {"target": f"<= {TARGETS['dynamic_captures']}", "value": c,
                                       "met": bool(c) and max(c) <= TARGETS["dynamic_captures"]}
    return {"systems": out, "targets": targets}


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3




def table(data: dict[str, Any]) -> str:
    summary = data["summary"]["systems"]
    rows = []
    for system, s in summary.items():
        effects = "/".join(str(e) for e in s["effects"]) or "-"
        failure = s["first_failure"] or (s["steady_status"] if s["steady_status"] not in (None, "ok") else "")
        check = ("same" if s["tokens_equal_eager"] else "DIFFER") + ", " + (
            "same" if s["effects_equal_eager"] else f"{effects} of {s['effects_expected']}")
        if not s["first_ok_runs"] and s["steady_status"] in (None, "ok") and s["token_ms"] is None:
            check = "fails"
        rows.append([
            system, ",".join(str(c) for c in s["compiles"]) or "-",
            f"{fmt(s['first_s'], ' s')} / {fmt(s['first_cpu_s'], ' s')}", fmt(s["second_s"], " s", 3),
            fmt(s["generate_ms"], "", 1), f"{fmt(s['token_ms'], '', 3)} / {fmt(s['token_cpu_ms'], '', 3)}",
            fmt(s["forward_ms"], "", 3), fmt(s["token_over_eager"], "x"), fmt(s["token_cpu_over_eager"], "x"),
            fmt(s["token_over_tc"], "x"), fmt(s["generate_over_eager"], "x"),
            fmt(s["first_over_eager"], "x", 1), check, fmt(s["max_logit_diff"], "", 7), failure[:60]])
    cfg = data["config"]
    st = data["steady_state"]
    head = f"{cfg['label']}: " if cfg.get("label") else ""
    text = [head + f"GPT-2 ({cfg['model']['layers']} layers), greedy generation of {cfg['tokens']} tokens "
            f"after a {cfg['prompt']}-token prompt; first call: median of {cfg['reps']} fresh processes; "
            f"steady: medians of {st.get('rounds', 0)} interleaved rounds (ms); ratios vs eager with the"
            " same cache and model, vs torch.compile (static cache, same model)",
            common.format_table(["system", "captures", "first call wall / CPU", "2nd call", "generate ms",
                                 "per token wall / CPU", "forward", "tok/eager", "tok/eager CPU", "tok/tc",
                                 "gen/eager", "first/eager", "tokens, effects vs eager", "max |dlogit|",
                                 "failure"], rows)]
    return "\n".join(text + common.targets_lines(data["summary"]["targets"]))


def plot(data: dict[str, Any], path: Path) -> Path:
    """First call per system (log scale, CPU as ticks, captures annotated) and steady time per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data["summary"]["systems"]
    names = [s for s in summary if summary[s]["first_runs"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"eager": "C7", "efx": "C0", "tc": "C3", "tc_module": "C1"}
    xs = range(len(names))
    left.bar(xs, [summary[s]["first_s"] or 0 for s in names], color=[colors[SYSTEMS[s][0]] for s in names])
    left.scatter(xs, [summary[s]["first_cpu_s"] or float("nan") for s in names], marker="_", s=80, color="k",
                 zorder=5, label="CPU time (process tree)")
    low = min((summary[s]["first_s"] for s in names if summary[s]["first_s"]), default=1.0)
    for x, s in zip(xs, names):
        if summary[s]["first_s"] is None:
            left.annotate("fails", (x, low), ha="center", va="bottom", fontsize=7, color="red")
            continue
        c = summary[s]["compiles"]
        note = f"{','.join(map(str, c))} capt." if SYSTEMS[s][0] == "efx" else (
            f"{','.join(map(str, c))} graphs" if SYSTEMS[s][0] != "eager" else "")
        if summary[s]["effects"] and summary[s]["effects_expected"] and not summary[s]["effects_equal_eager"]:
            note += "\neffects\ndropped"
        top = max(summary[s]["first_s"], summary[s]["first_cpu_s"] or 0)
        left.annotate(note, (x, top * 1.1), ha="center", va="bottom", fontsize=6)
    left.set_yscale("log")
    left.set_ylim(top=left.get_ylim()[1] * 6)
    left.set_ylabel("s (median wall, log scale)")
    left.set_title(f"first generate call ({data['config']['tokens']} tokens, fresh process)", fontsize=10)
    steady = [s for s in summary if summary[s]["token_ms"] is not None]
    xs2 = range(len(steady))
    right.bar(xs2, [summary[s]["token_ms"] for s in steady], color=[colors[SYSTEMS[s][0]] for s in steady],
              label="per token (start to start)")
    right.scatter(xs2, [summary[s]["forward_ms"] for s in steady], marker="_", s=80, color="k", zorder=5,
                  label="forward alone")
    for x, s in zip(xs2, steady):
        ratio = summary[s]["token_over_eager"]
        if SYSTEMS[s][0] != "eager" and ratio is not None:
            dropped = "\neffects\ndropped" if summary[s]["effects_expected"] and not summary[s][
                "effects_equal_eager"] else ""
            right.annotate(f"{ratio:.2f}x{dropped}", (x, summary[s]["token_ms"] * 1.02), ha="center",
                           va="bottom", fontsize=7)
    right.set_ylabel("ms per decode step (median)")
    right.set_ylim(top=right.get_ylim()[1] * 1.15)
    right.set_title("steady decode step (x = vs eager, same cache and model)", fontsize=10)
    for ax, labels in ((left, names), (right, steady)):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, axis="y", alpha=0.3)
    return common.save_figure(fig, "greedy generation, GPT-2 (4 layers), 1 thread", data, path)
