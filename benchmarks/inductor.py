"""effectfx's Inductor backend beside torch.compile and eager: first call (fresh and warm Inductor caches)
and the steady-state training step, for a stack of N transformer-style blocks (N = 2, 16) and GPT-2; the
models and systems are in :mod:`benchmarks.inductor_systems`.

First call = capture + compile + first forward and backward, each measured in its own subprocess whose
``TORCHINDUCTOR_CACHE_DIR`` is a fresh temporary directory ("fresh"), or the directory a fresh ``efx`` /
``tc`` run just filled ("warm": a second process starting).  Before measuring, every subprocess pays the
one-time costs every system pays alike (imports, Inductor's vector-ISA probe and precompiled header,
compile workers, dynamo's first frame): one tiny ``torch.compile`` and one tiny ``efx.compile`` of an
unrelated function; that warm-up is reported apart.  Each first call is checked against eager (outputs,
gradients, effect count).  Steady state: every system warmed up in one process, training steps timed
interleaved in shuffled order (samples of >= 20 ms, ~budget seconds per model), medians.

Run: ``python benchmarks/inductor.py [--quick] [--out DIR] [--reps R]``; a full run writes
``results/inductor.json`` (``--quick``: ``results/quick/``, never the committed figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import effectfx as efx  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks import inductor_systems as defs  # noqa: E402
from benchmarks.common import LOG, median  # noqa: E402
from benchmarks.inductor_systems import SYSTEMS, build, check, compiled, register_hop_backend  # noqa: E402

NAME = "inductor"
FIRST_CALL = ("efx", "efx_hop", "tc", "tc_ncr", "tc_pure", "tc_ncr_pure")
WARM = ("efx", "tc", "tc_pure")  # also measured in a second process on the cache the first filled
FULL = {"configs": [("stack", 2), ("stack", 16), ("gpt2", defs.GPT2_LAYERS)], "reps": 3, "budget_s": 20.0,
        "systems": FIRST_CALL}
QUICK = {"configs": [("stack", 2)], "reps": 1, "budget_s": 2.0, "systems": ("efx", "tc_pure")}


# -- one first call, in a subprocess -----------------------------------------------------------------------
def tree_cpu_s() -> float:
    """CPU seconds of this process, its finished children, and every live descendant with theirs: Inductor
    compiles C++ in worker processes (each running the compiler), which wall-clock time on a shared
    machine mixes with other users' work."""
    import resource

    total = sum(getattr(resource.getrusage(who), f) for f in ("ru_utime", "ru_stime")
                for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)], stats[int(entry)] = int(fields[1]), fields
    mine = {os.getpid()}
    for pid in sorted(parents):  # descendants: walk each chain of parents up to this process
        chain, p = [], pid
        while p in parents and p not in mine and p > 1:
            chain.append(p)
            p = parents[p]
        if p in mine:
            mine.update(chain)
    for pid in mine - {os.getpid()}:
        total += sum(int(v) for v in stats[pid][11:15]) / tick  # utime stime cutime cstime
    return total


def _warm_up() -> None:
    """The one-time costs every system pays alike (see the module docstring)."""
    torch.compile(lambda a: torch.cos(a) * 3, backend="inductor")(torch.randn(5))
    efx.compile(lambda a: torch.sin(a) + 1, backend="inductor")(torch.randn(3))
    torch._dynamo.reset()
    LOG.clear()
    common.freeze_heap()


def first_call(model: str, n: int, system: str) -> dict[str, Any]:
    """Measure one first call in this process (a subprocess of the benchmark: see ``--child``)."""
    torch.set_num_threads(1)
    register_hop_backend()
    start = time.perf_counter()
    _warm_up()
    warmup_s = time.perf_counter() - start
    module, loss_of = build(model, n, system)
    f = compiled(system, module)
    gc.collect()
    cpu, wall = tree_cpu_s(), time.perf_counter()
    try:
        loss = loss_of(f)
        loss.backward()
    except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
        return {"status": f"{type(e).__name__}: {str(e)[:300]}", "warmup_s": warmup_s}
    wall, cpu = time.perf_counter() - wall, tree_cpu_s() - cpu
    result = {"status": "ok", "wall_s": wall, "cpu_s": cpu, "warmup_s": warmup_s, "effects": len(LOG),
              "effects_expected": n if SYSTEMS[system][2] else 0}
    result.update(check(model, n, system, module, loss))
    if system == "efx":
        from effectfx.backends import inductor_cache

        result["segments_compiled"] = inductor_cache.STATS.compiles - 1  # minus the warm-up's
    return result


def _child(spec: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=3600)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"status": f"child failed (exit {proc.returncode}): {proc.stderr[-500:]}"}


# -- steady state, in one process ---------------------------------------------------------------------------
def steady_state(model: str, n: int, budget_s: float) -> dict[str, Any]:
    """Training step of every system, interleaved in shuffled order; medians (ms)."""
    torch.set_num_threads(1)
    register_hop_backend()
    steps: dict[str, Callable[[], None]] = {}
    status: dict[str, str] = {}
    for system in SYSTEMS:
        module, loss_of = build(model, n, system)
        f = compiled(system, module)
        params = list(module.parameters())

        def step(f: Any = f, loss_of: Any = loss_of, params: list = params) -> None:
            loss_of(f).backward()
            for p in params:
                p.grad = None

        try:
            step()
            step()
            loss = loss_of(f)
            loss.backward()
            verdict = check(model, n, system, module, loss)  # fast but wrong is not a result
            step()
        except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
            status[system] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        if not verdict["ok"]:
            status[system] = f"wrong results: max rel. difference {verdict['max_rel_diff']:.2g} from eager"
            continue
        status[system] = "ok"
        steps[system] = step
    calls = {}
    for system, step in steps.items():  # calls per sample: at least 20 ms
        t = time.perf_counter()
        step()
        calls[system] = max(1, int(0.02 / max(time.perf_counter() - t, 1e-6)))
    common.freeze_heap()
    samples: dict[str, list[float]] = {system: [] for system in steps}
    cpu: dict[str, list[float]] = {system: [] for system in steps}  # one thread, no children: process time
    end, rounds = time.perf_counter() + budget_s, 0
    while time.perf_counter() < end or rounds < 3:
        order = list(steps)
        random.shuffle(order)
        for system in order:
            t, c = time.perf_counter(), time.process_time()
            for _ in range(calls[system]):
                steps[system]()
            samples[system].append((time.perf_counter() - t) / calls[system])
            cpu[system].append((time.process_time() - c) / calls[system])
        rounds += 1
    return {"status": status, "step_ms": {k: median(v) * 1e3 for k, v in samples.items()}, "rounds": rounds,
            "step_cpu_ms": {k: median(v) * 1e3 for k, v in cpu.items()},
            "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()}}


# -- the whole run -------------------------------------------------------------------------------------------
def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    reps = reps or cfg["reps"]
    configs = cfg["configs"]
    first: dict[str, list[dict[str, Any]]] = {}
    systems = cfg["systems"]
    progress = common.Progress(reps * len(configs) * (len(systems) + len(set(WARM) & set(systems)))
                               + len(configs), NAME)
    with tempfile.TemporaryDirectory(prefix="efx-inductor-bench-") as tmp:
        for rep in range(reps):
            for model, n in configs:
                order = list(systems)
                random.Random(rep).shuffle(order)  # no system always runs first (or last) on a busy machine
                for system in order:
                    cache = tempfile.mkdtemp(dir=tmp)
                    spec = {"mode": "first", "model": model, "n": n, "system": system}
                    for kind in ("fresh", "warm") if system in WARM else ("fresh",):
                        key = f"{model}/{n}/{system}/{kind}"
                        first.setdefault(key, []).append(_child(spec, cache))
                        progress.step(key)
        steady = {}
        for model, n in configs:
            steady[f"{model}/{n}"] = _child({"mode": "steady", "model": model, "n": n,
                                              "budget_s": cfg["budget_s"]}, tempfile.mkdtemp(dir=tmp))
            progress.step(f"{model}/{n} steady state")
    data = {"machine": common.machine_info(),
            "config": {"quick": quick, "reps": reps, "configs": configs, "budget_s": cfg["budget_s"],
                       "systems": {k: SYSTEMS[k] for k in systems},
                       "stack": {"width": defs.WIDTH, "batch": defs.BATCH, "seq": defs.SEQ},
                       "gpt2": {"layers": defs.GPT2_LAYERS, "batch": defs.GPT2_BATCH, "seq": defs.SEQ}},
            "first_call": first, "steady_state": steady}
    data["summary"] = summarize(data)
    return data


def _median_of(runs: list[dict[str, Any]], field: str) -> float | None:
    values = [r[field] for r in runs if r.get("status") == "ok"]
    return median(values) if values else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: effectfx's first call (fresh, warm) and step, and its ratios to the others.
    Where torch.compile failed on the effectful model, its effect-free run stands in (``*_used`` says)."""
    first, steady = data["first_call"], data["steady_state"]
    wall = {k: _median_of(v, "wall_s") for k, v in first.items()}
    cpu = {k: _median_of(v, "cpu_s") for k, v in first.items()}
    out: dict[str, Any] = {"first_call_s": wall, "first_call_cpu_s": cpu,
                           "warmup_s": median([r["warmup_s"] for v in first.values() for r in v
                                               if "warmup_s" in r])}
    for tag, st in steady.items():
        ms, cms = st.get("step_ms", {}), st.get("step_cpu_ms", {})
        s: dict[str, Any] = {"efx_first_s": wall.get(f"{tag}/efx/fresh"),
                             "efx_first_cpu_s": cpu.get(f"{tag}/efx/fresh"),
                             "efx_warm_s": wall.get(f"{tag}/efx/warm"),
                             "efx_warm_cpu_s": cpu.get(f"{tag}/efx/warm")}
        for other in ("tc", "tc_ncr", "efx_hop"):
            used = other if wall.get(f"{tag}/{other}/fresh") is not None else f"{other}_pure"
            s[f"first_{other}_used"] = used
            s[f"first_{other}_over_efx"] = _div(wall.get(f"{tag}/{used}/fresh"), s["efx_first_s"])
            s[f"first_{other}_over_efx_cpu"] = _div(cpu.get(f"{tag}/{used}/fresh"), s["efx_first_cpu_s"])
            used = other if other in ms else f"{other}_pure"
            s[f"step_{other}_used"] = used
            s[f"step_efx_over_{other}"] = _div(ms.get("efx"), ms.get(used))
            s[f"step_efx_over_{other}_cpu"] = _div(cms.get("efx"), cms.get(used))
        s["step_efx_over_eager"] = _div(ms.get("efx"), ms.get("eager"))
        s["step_efx_over_eager_cpu"] = _div(cms.get("efx"), cms.get("eager"))
        s["step_tc_over_eager"] = _div(ms.get(s["step_tc_used"]), ms.get("eager"))
        out[tag] = s
    out["efx_growth_stack_2_to_16"] = _div(wall.get("stack/16/efx/fresh"), wall.get("stack/2/efx/fresh"))
    out["efx_growth_stack_2_to_16_cpu"] = _div(cpu.get("stack/16/efx/fresh"), cpu.get("stack/2/efx/fresh"))
    return out


def _f(v: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def table(data: dict[str, Any]) -> str:
    summary, first = data["summary"], data["first_call"]
    rows = []
    for key in sorted(first):
        runs = first[key]
        bad = [r["status"] for r in runs if r.get("status") != "ok"]
        ok = [r for r in runs if r.get("status") == "ok"]
        checks = "-" if not ok else "same" if all(
            r["ok"] and r["effects"] == r["effects_expected"] for r in ok) else "MISMATCH"
        rows.append([key, _f(summary["first_call_s"][key], " s"), _f(summary["first_call_cpu_s"][key], " s"),
                     f"{len(ok)}/{len(runs)}", checks, bad[0][:70] if bad else ""])
    warm = _f(summary["warmup_s"], " s")
    text = [f"first call: median wall and CPU (process tree); one-time warm-up apart, median {warm}",
            common.format_table(["model/N/system/cache", "wall", "cpu", "ok", "vs eager", "failure"], rows)]
    rows = []
    for tag, st in data["steady_state"].items():
        ms, cms = st.get("step_ms", {}), st.get("step_cpu_ms", {})
        rows.append([tag, *[f"{_f(ms.get(k), '')} / {_f(cms.get(k), '')}" for k in SYSTEMS]])
        rows += [[f"  {tag} {k}: {v[:100]}", *[""] * len(SYSTEMS)] for k, v in st.get("status", {}).items()
                 if v != "ok"]
    text += ["", "training step, median ms, wall / CPU (interleaved)",
             common.format_table(["model/N", *SYSTEMS], rows)]
    rows = []
    for tag in data["steady_state"]:
        s = summary[tag]
        rows.append([tag, _f(s["efx_first_s"], " s"), _f(s["efx_warm_s"], " s"),
                     *[f"{_f(s[f'first_{o}_over_efx'], 'x')} / {_f(s[f'first_{o}_over_efx_cpu'], 'x')}"
                       + ("*" if s[f"first_{o}_used"] != o else "") for o in ("tc_ncr", "tc", "efx_hop")],
                     *[f"{_f(s[f'step_efx_over_{o}'], 'x')} / {_f(s[f'step_efx_over_{o}_cpu'], 'x')}"
                       + ("*" if s.get(f"step_{o}_used", o) != o else "")
                       for o in ("eager", "tc", "efx_hop")]])
    text += ["", "ratios (first call: other / effectfx, wall / CPU; step: effectfx / other; "
             "* = torch.compile failed with effects, its effect-free run stands in)",
             common.format_table(["model/N", "efx first", "efx warm", "tc_ncr/efx", "tc/efx", "efx_hop/efx",
                                  "step efx/eager", "step efx/tc", "step efx/efx_hop"], rows),
             f"effectfx first-call growth, stack N=2 -> 16: {_f(summary['efx_growth_stack_2_to_16'], 'x')} "
             f"wall, {_f(summary['efx_growth_stack_2_to_16_cpu'], 'x')} CPU"]
    return "\n".join(text)


def plot(data: dict[str, Any], path: Path) -> Path:
    """First call (fresh caches, log scale; CPU as ticks) and training step / eager, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, tags = data["summary"], list(data["steady_state"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
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
        if not xs:  # not measured (a quick run): no legend entry
            continue
        left.bar(xs, wall, w, color=f"C{k}", label=label)
        left.scatter(xs, cpu, marker="_", s=60, color="k", zorder=5, label="CPU time" if k == 0 else None)
    left.set_yscale("log")
    left.set_ylim(top=left.get_ylim()[1] * 8)  # room for the legend
    left.set_ylabel("s (median, log scale)")
    left.set_title("first call: compile + forward + backward (fresh process)", fontsize=10)
    for k, (system, _, label) in enumerate(b for b in bars if b[1] == "fresh"):
        xs, ratio = [], []
        for x, tag in enumerate(tags):
            ms = data["steady_state"][tag].get("step_ms", {})
            used = system if system in ms else f"{system}_pure"
            if used in ms and ms.get("eager"):
                xs.append(x + (k - 1.5) * 0.2)
                ratio.append(ms[used] / ms["eager"])
                if used != system:
                    right.annotate("no\neffects", (xs[-1], ratio[-1]), ha="center", va="bottom", fontsize=6)
        right.bar(xs, ratio, 0.2, color=f"C{[0, 2, 3, 4][k]}", label=label)
    right.axhline(1.0, color="k", lw=0.8)
    right.axhline(0.95, color="k", lw=0.8, ls="--", label="target 0.95x")
    right.set_ylabel("training step / eager's (median wall)")
    right.set_ylim(0, 1.4)  # room for the legend
    right.set_title("steady-state training step", fontsize=10)
    for ax in (left, right):
        ax.set_xticks(range(len(tags)))
        ax.set_xticklabels(tags)
        ax.legend(fontsize=7, ncol=2, loc="upper left")
        ax.grid(True, axis="y", alpha=0.3)
    title = "effectfx's Inductor backend vs torch.compile (inductor), 1 thread"
    return common.save_figure(fig, title, data, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stack N=2 only, one repetition, short budget")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of every first call")
    parser.add_argument("--out", type=Path, default=None,
                        help="where inductor.json goes (default: results/, or results/quick/ with --quick)")
    parser.add_argument("--plot-only", type=Path, default=None, metavar="JSON",
                        help="redraw the table and PNG (next to JSON) from a run's JSON; no measuring")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plot_only is not None:
        data = json.loads(args.plot_only.read_text())
        data["summary"] = summarize(data)
        print(table(data))
        print("wrote", common.replace_atomically(args.plot_only.with_suffix(".png"), lambda p: plot(data, p)))
        return 0
    if args.child:
        spec = json.loads(args.child)
        if spec["mode"] == "first":
            result = first_call(spec["model"], spec["n"], spec["system"])
        else:
            result = steady_state(spec["model"], spec["n"], spec["budget_s"])
        print(json.dumps(result, default=str))
        return 0
    data = run(args.quick, args.reps)
    out = common.output_dir(args.out, args.quick)
    path = common.write_json(data, out, NAME)
    print(table(data))
    print(f"\nwrote {path}", common.replace_atomically(out / f"{NAME}.png", lambda p: plot(data, p)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
