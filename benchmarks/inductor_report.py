"""The summary, tables, targets and plot of ``benchmarks/inductor.py``'s results; the targets are
benchmarks/README.md's ("Inductor backend": GPT-2 and Llama, 12 layers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import fmt, median, median_of_ok_runs, ratio

MODES = ("training", "inference")
# the targets: (a) first call vs torch.compile on the 12-layer models and a warm second process, (b) the
# steady steps vs torch.compile and eager, (c) every effectfx call exact (benchmarks/README.md)
HF_TAGS = ("gpt2/12", "llama/12")
STEP_TAGS = ("stack/16", *HF_TAGS)
FIRST_LIMITS = {"tc_ncr": 0.8, "tc": 0.5}
WARM_LIMIT_S = 1.0
STEP_LIMITS = {"tc": 1.0, "eager": 0.95}
T2_LIMIT = 0.97  # tier 2's steady steps against torch.compile's (benchmarks/README.md, "Tiered compilation")


def _step_used(ms: dict[str, float], other: str) -> str:
    return other if other in ms or other == "eager" else f"{other}_pure"


def processes(st: dict[str, Any]) -> list[dict[str, Any]]:
    """A configuration's steady-state processes that ran (each built and compiled every system anew); a
    run before ``processes`` was one process."""
    return [p for p in _every(st) if isinstance(p.get("status"), dict)]


def _every(st: dict[str, Any]) -> list[dict[str, Any]]:
    return st.get("processes", [st])


def _ms(p: dict[str, Any], field: str, mode: str) -> dict[str, float]:
    return p.get(field, {}).get(mode, {})


def merged(st: dict[str, Any]) -> dict[str, Any]:
    """One view of a configuration's steady-state processes: per mode and system the median over the
    processes of each process's median (ms, wall and CPU), the first status that was not ok, every
    process's checks, and the failures of processes that did not run."""
    procs = processes(st)
    out: dict[str, Any] = {"status": {}, "checks": {}, "step_ms": {}, "step_cpu_ms": {},
                           "failed": [p["status"] for p in _every(st) if p not in procs]}
    for mode in MODES:
        for field in ("step_ms", "step_cpu_ms"):
            systems = dict.fromkeys(k for p in procs for k in _ms(p, field, mode))
            out[field][mode] = {k: median([_ms(p, field, mode)[k] for p in procs if k in _ms(p, field, mode)])
                                for k in systems}
        statuses = [p["status"].get(mode, {}) for p in procs]
        out["status"][mode] = {k: next((s[k] for s in statuses if s.get(k, "ok") != "ok"), "ok")
                               for k in dict.fromkeys(k for s in statuses for k in s)}
        out["checks"][mode] = [p.get("checks", {}).get(mode, {}) for p in procs]
    return out


def _per_process(procs: list[dict[str, Any]], field: str, mode: str, a: str, b: str) -> list[float]:
    """Each process's ratio of the medians of ``a`` and ``b``."""
    return [_ms(p, field, mode)[a] / _ms(p, field, mode)[b] for p in procs
            if a in _ms(p, field, mode) and _ms(p, field, mode).get(b)]


def _pooled(procs: list[dict[str, Any]], mode: str, a: str, b: str) -> dict[str, float] | None:
    """:func:`common.paired` over the rounds of every process that timed both ``a`` and ``b``."""
    pairs = [(p["samples_ms"][mode][a], p["samples_ms"][mode][b]) for p in procs
             if a in p.get("samples_ms", {}).get(mode, {}) and b in p["samples_ms"][mode]]
    return common.paired([x for pa, _ in pairs for x in pa], [x for _, pb in pairs for x in pb]) if pairs \
        else None


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: effectfx's first call (fresh, warm) and steps, and their ratios effectfx / other
    (wall and CPU).  Where torch.compile failed on the effectful model, its effect-free run stands in
    (``*_used`` says).  Then the targets."""
    first, steady = data["first_call"], data["steady_state"]
    wall = {k: median_of_ok_runs(v, "wall_s") for k, v in first.items()}
    cpu = {k: median_of_ok_runs(v, "cpu_s") for k, v in first.items()}
    out: dict[str, Any] = {"first_call_s": wall, "first_call_cpu_s": cpu,
                           "warmup_s": median([r["warmup_s"] for v in first.values() for r in v
                                               if "warmup_s" in r])}
    for tag, st in steady.items():
        s: dict[str, Any] = {"efx_first_s": wall.get(f"{tag}/efx/fresh"),
                             "efx_first_cpu_s": cpu.get(f"{tag}/efx/fresh"),
                             "efx_warm_s": wall.get(f"{tag}/efx/warm"),
                             "efx_warm_cpu_s": cpu.get(f"{tag}/efx/warm")}
        for other in ("tc", "tc_ncr", "efx_hop"):
            if f"{tag}/{other}/fresh" not in first:
                continue
            used = other if wall.get(f"{tag}/{other}/fresh") is not None else f"{other}_pure"
            s[f"first_{other}_used"] = used
            s[f"first_efx_over_{other}"] = ratio(s["efx_first_s"], wall.get(f"{tag}/{used}/fresh"))
            s[f"first_efx_over_{other}_cpu"] = ratio(s["efx_first_cpu_s"], cpu.get(f"{tag}/{used}/fresh"))
        procs, steps = processes(st), merged(st)
        for mode in MODES:
            ms = steps["step_ms"][mode]
            pairs = [*(("efx", o) for o in ("eager", "tc", "tc_ncr", "efx_hop")), ("efx_t2", "tc")]
            for mine, other in pairs:
                used = _step_used(ms, other)
                if used not in ms or mine not in ms:
                    continue
                # each process's ratio of medians, then their median: a process's build is one draw of
                # what two builds of one system differ by (memory layout), which rounds cannot average out
                walls, cpus = (_per_process(procs, f, mode, mine, used) for f in ("step_ms", "step_cpu_ms"))
                s[f"{mode}_{other}_used"] = used
                s[f"{mode}_{mine}_over_{other}"] = median(walls) if walls else None
                s[f"{mode}_{mine}_over_{other}_cpu"] = median(cpus) if cpus else None
                s[f"{mode}_{mine}_over_{other}_processes"] = walls
                s[f"{mode}_{mine}_over_{other}_paired"] = _pooled(procs, mode, mine, used)
            s[f"{mode}_twin"] = _pooled(procs, mode, "efx_twin", "efx")
            s[f"{mode}_tc_over_eager"] = ratio(ms.get(s.get(f"{mode}_tc_used", "")), ms.get("eager"))
        out[tag] = s
    out["efx_growth_stack_2_to_16"] = ratio(wall.get("stack/16/efx/fresh"), wall.get("stack/2/efx/fresh"))
    out["efx_growth_stack_2_to_16_cpu"] = ratio(cpu.get("stack/16/efx/fresh"), cpu.get("stack/2/efx/fresh"))
    out["targets"] = targets(data, out)
    return out


def _target(text: str, value: float | None, value_cpu: float | None, limit: float,
            paired_: dict[str, float] | None = None, twin: dict[str, float] | None = None,
            per_process: list[float] | None = None) -> dict[str, Any]:
    """Judged on wall time (the targets' measure); CPU beside it (robust to a loaded machine).  A step
    target also carries the paired per-round ratio with its interval, the twins' ratio and each process's
    ratio: ``resolved`` is whether the run tells the verdict apart from noise (the interval and the twins'
    distance from 1 both clear of the limit, and every process on the same side of it)."""
    out = {"target": text, "value": value, "value_cpu": value_cpu, "limit": limit,
           "met": None if value is None else value <= limit,
           "met_cpu": None if value_cpu is None else value_cpu <= limit}
    if paired_ is not None and value is not None:
        noise = abs(twin["median"] - 1.0) if twin else 0.0
        agree = len({r <= limit for r in per_process or []}) <= 1
        out.update(paired=paired_, twin=twin, processes=per_process or [],
                   resolved=(not paired_["low"] <= limit <= paired_["high"] and abs(value - limit) > noise
                             and agree))
    return out


def targets(data: dict[str, Any], s: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for tag in (t for t in HF_TAGS if t in s):
        for other, limit in FIRST_LIMITS.items():
            used = s[tag].get(f"first_{other}_used", other)
            out.append(_target(f"(a) {tag} first call efx / {used}", s[tag].get(f"first_efx_over_{other}"),
                               s[tag].get(f"first_efx_over_{other}_cpu"), limit))
        out.append(_target(f"(a) {tag} warm second process, s", s[tag]["efx_warm_s"],
                           s[tag]["efx_warm_cpu_s"], WARM_LIMIT_S))
    for mode in MODES:
        for tag in (t for t in STEP_TAGS if t in s):
            for other, limit in STEP_LIMITS.items():
                used = s[tag].get(f"{mode}_{other}_used", other)
                out.append(_target(f"(b) {tag} {mode} step efx / {used}",
                                   s[tag].get(f"{mode}_efx_over_{other}"),
                                   s[tag].get(f"{mode}_efx_over_{other}_cpu"), limit,
                                   s[tag].get(f"{mode}_efx_over_{other}_paired"), s[tag].get(f"{mode}_twin"),
                                   s[tag].get(f"{mode}_efx_over_{other}_processes")))
    for mode in MODES:  # (d): tier 2's steady steps
        for tag in (t for t in STEP_TAGS if t in s and f"{mode}_efx_t2_over_tc" in s[t]):
            used = s[tag].get(f"{mode}_tc_used", "tc")
            out.append(_target(f"(d) {tag} {mode} step efx tier 2 / {used}", s[tag][f"{mode}_efx_t2_over_tc"],
                               s[tag].get(f"{mode}_efx_t2_over_tc_cpu"), T2_LIMIT,
                               s[tag].get(f"{mode}_efx_t2_over_tc_paired"), s[tag].get(f"{mode}_twin"),
                               s[tag].get(f"{mode}_efx_t2_over_tc_processes")))
    for tag, st in data["steady_state"].items():  # (c): every effectfx call exact and close to eager
        runs = [r for r in data["first_call"].get(f"{tag}/efx/fresh", []) + data["first_call"].get(
            f"{tag}/efx/warm", []) if r.get("status") == "ok"]
        checks = [c.get("efx") for mode in MODES for c in merged(st)["checks"][mode]]
        checks += [c["efx_t2"] for mode in MODES for c in merged(st)["checks"][mode] if "efx_t2" in c]
        diffs = [r["max_rel_diff"] for r in runs] + [c["max_rel_diff"] for c in checks if c]
        exact = (bool(runs) and all(r["ok"] and r["effects"] == r["effects_expected"] for r in runs)
                 and all(c and c["ok"] and c["effects"] == c["effects_expected"] for c in checks))
        out.append({"target": f"(c) {tag} efx effects exact (tiers 1, 2), outputs/gradients within "
                              "1e-3 of eager",
                    "value": max(diffs, default=None), "value_cpu": None, "limit": 1e-3, "met": exact,
                    "met_cpu": None})
    return out


def _pair(a: float | None, b: float | None, unit: str = "", star: bool = False) -> str:
    return f"{fmt(a, unit)} / {fmt(b, unit)}" + ("*" if star else "")


def _verdict(t: dict[str, Any]) -> str:
    verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
    if "paired" not in t:
        return verdict
    p, twin = t["paired"], t["twin"]
    twins = f"; twins {twin['median']:.3f}x" if twin else ""
    procs = t.get("processes", [])
    each = f"; processes {' / '.join(f'{r:.3f}' for r in procs)}x" if len(procs) > 1 else ""
    noise = "" if t["resolved"] else ", within this run's noise"
    interval = f"95% {p['low']:.3f}-{p['high']:.3f}"
    return f"{verdict}{noise} (paired per round {p['median']:.3f}x, {interval}{twins}{each})"


def targets_text(summary: dict[str, Any]) -> str:
    lines = ["targets: (judged on wall time; CPU beside)"]
    for t in summary["targets"]:
        value = f"{t['value']:.2g}" if t["target"].startswith("(c)") and t["value"] is not None else _pair(
            t["value"], t["value_cpu"])
        cpu = "" if t["met_cpu"] is None or t["met_cpu"] == t["met"] else (
            f" (CPU: {'met' if t['met_cpu'] else 'not met'})")
        lines.append(f"  {t['target']}: {value} <= {t['limit']:g}: {_verdict(t)}{cpu}")
    return "\n".join(lines)


def table(data: dict[str, Any]) -> str:
    summary, first = data["summary"], data["first_call"]
    rows = []
    for key in sorted(first):
        runs = first[key]
        bad = [r["status"] for r in runs if r.get("status") != "ok"]
        ok = [r for r in runs if r.get("status") == "ok"]
        checks = "-" if not ok else "same" if all(
            r["ok"] and r["effects"] == r["effects_expected"] for r in ok) else "MISMATCH"
        times = (summary["first_call_s"][key], summary["first_call_cpu_s"][key],
                 median_of_ok_runs(runs, "second_s"))
        rows.append([key, *(fmt(t, " s") for t in times), f"{len(ok)}/{len(runs)}", checks,
                     bad[0][:70] if bad else ""])
    warm = fmt(summary["warmup_s"], " s")
    text = [f"first call: median wall and CPU (process tree), and the second call's wall (effectfx compiles "
            f"its root's segments then); one-time warm-up apart, median {warm}",
            common.format_table(["model/N/system/cache", "wall", "cpu", "second", "ok", "vs eager",
                                 "failure"], rows)]
    views = {tag: merged(st) for tag, st in data["steady_state"].items()}
    for mode in MODES:
        systems = list(dict.fromkeys(s for steps in views.values() for s in steps["status"][mode]))
        rows = []
        for tag, steps in views.items():
            ms, cms = steps["step_ms"][mode], steps["step_cpu_ms"][mode]
            rows.append([tag, *[_pair(ms.get(k), cms.get(k)) for k in systems]])
            rows += [[f"  {tag} {k}: {v[:100]}", *[""] * len(systems)]
                     for k, v in steps["status"][mode].items() if v != "ok"]
            rows += [[f"  {tag}: a process failed: {v[:100]}", *[""] * len(systems)] for v in steps["failed"]]
        counts = sorted({len(processes(st)) for st in data["steady_state"].values()})
        text += ["", f"{mode} step, median ms, wall / CPU (interleaved; median over "
                 f"{'/'.join(map(str, counts))} process(es) of each one's median)",
                 common.format_table(["model/N", *systems], rows)]
    hop = any(k.endswith("/efx_hop/fresh") for k in first)
    others = ("tc_ncr", "tc", *(("efx_hop",) if hop else ()))
    rows = []
    for tag in data["steady_state"]:
        s = summary[tag]
        row = [tag, _pair(s["efx_first_s"], s["efx_first_cpu_s"], " s"),
               _pair(s["efx_warm_s"], s["efx_warm_cpu_s"], " s")]
        row += [_pair(s.get(f"first_efx_over_{o}"), s.get(f"first_efx_over_{o}_cpu"), "x",
                      s.get(f"first_{o}_used", o) != o) for o in others]
        row += [_pair(s.get(f"{m}_efx_over_{o}"), s.get(f"{m}_efx_over_{o}_cpu"), "x",
                      s.get(f"{m}_{o}_used", o) != o) for m in MODES for o in ("eager", *others)]
        rows.append(row)
    text += ["", "ratios effectfx / other, wall / CPU (* = torch.compile failed with effects, its "
             "effect-free run stands in)",
             common.format_table(["model/N", "efx first", "efx warm", *[f"first /{o}" for o in others],
                                  *[f"{m[:5]} /{o}" for m in MODES for o in ("eager", *others)]], rows),
             f"effectfx first-call growth, stack N=2 -> 16: {fmt(summary['efx_growth_stack_2_to_16'], 'x')} "
             f"wall, {fmt(summary['efx_growth_stack_2_to_16_cpu'], 'x')} CPU", "", targets_text(summary)]
    return "\n".join(text)


def plot(data: dict[str, Any], path: Path) -> Path:
    """First call (fresh caches, log scale; CPU as ticks), and training and inference step / eager."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, tags = data["summary"], list(data["steady_state"])
    views = {tag: merged(st) for tag, st in data["steady_state"].items()}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), gridspec_kw={"width_ratios": [1.3, 1, 1]})
    left = axes[0]
    bars = [("efx", "fresh", "effectfx"), ("efx", "warm", "effectfx, warm cache"),
            ("efx_hop", "fresh", "effectfx, HOP lowering"), ("tc_ncr", "fresh", "torch.compile + ncr"),
            ("tc", "fresh", "torch.compile")]
    w = 0.8 / len(bars)
    for k, (system, cache, label) in enumerate(bars):
        xs, wall, cpu = [], [], []
        for x, tag in enumerate(tags):
            used = summary[tag].get(f"first_{system}_used", system)
            if summary["first_call_s"].get(f"{tag}/{used}/{cache}") is not None:
                xs.append(x + (k - len(bars) / 2 + 0.5) * w)
                wall.append(summary["first_call_s"][f"{tag}/{used}/{cache}"])
                cpu.append(summary["first_call_cpu_s"][f"{tag}/{used}/{cache}"])
                runs = [r for r in data["first_call"][f"{tag}/{used}/{cache}"] if r.get("status") == "ok"]
                right_ = all(r["ok"] and r["effects"] == r["effects_expected"] for r in runs)
                if mark := "" if used == system and right_ else "wrong" if not right_ else "no\neffects":
                    left.annotate(mark, (xs[-1], wall[-1] * 1.15), ha="center", va="bottom", fontsize=6,
                                  color="red" if mark == "wrong" else "k")
        if not xs:  # not measured (a quick run, or no --hop): no legend entry
            continue
        left.bar(xs, wall, w, color=f"C{k}", label=label)
        left.scatter(xs, cpu, marker="_", s=60, color="k", zorder=5, label="CPU time" if k == 0 else None)
    left.set_yscale("log")
    left.set_ylim(top=left.get_ylim()[1] * 8)  # room for the legend
    left.set_ylabel("s (median, log scale)")
    left.set_title("first call: compile + forward + backward (fresh process)", fontsize=10)
    for ax, mode in zip(axes[1:], MODES):
        for k, (system, label) in enumerate([("efx", "effectfx"), ("efx_hop", "effectfx, HOP lowering"),
                                             ("tc_ncr", "torch.compile + ncr"), ("tc", "torch.compile")]):
            xs, ratio = [], []
            for x, tag in enumerate(tags):
                ms = views[tag]["step_ms"][mode]
                used = _step_used(ms, system)
                if used in ms and ms.get("eager"):
                    xs.append(x + (k - 1.5) * 0.2)
                    ratio.append(ms[used] / ms["eager"])
                    if used != system:
                        ax.annotate("no\neffects", (xs[-1], ratio[-1]), ha="center", va="bottom", fontsize=6)
            if xs:
                ax.bar(xs, ratio, 0.2, color=f"C{[0, 2, 3, 4][k]}", label=label)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.95, color="k", lw=0.8, ls="--", label="target 0.95x")
        ax.set_ylabel(f"{mode} step / eager's (median wall)")
        ax.set_ylim(0, 1.4)  # room for the legend
        ax.set_title(f"steady-state {mode} step", fontsize=10)
    for ax in axes:
        ax.set_xticks(range(len(tags)))
        ax.set_xticklabels(tags)
        ax.legend(fontsize=7, ncol=2, loc="upper left")
        ax.grid(True, axis="y", alpha=0.3)
    title = "effectfx's Inductor backend vs torch.compile (inductor), 1 thread"
    return common.save_figure(fig, title, data, path)
