"""Shared pieces of the benchmarks: the effect op, the block markers, numbers and tables, timing, compiler
counters, progress, machine info and output (:mod:`benchmarks.common_child` has those of the studies that
measure in child processes).

Every study is three modules: ``NAME.py`` runs it (``python benchmarks/NAME.py``), ``NAME_systems.py``
holds its models and the systems it compares, ``NAME_report.py`` turns a run's JSON into its summary, table
and plot.

The effect op ``efxbench::record(label)`` appends to :data:`LOG`.  It is registered with effectfx (key
``"memory"``) *and* with PyTorch's own effect registry (ORDERED); without the latter ``torch.compile``
treats the op as pure and drops every call.  :data:`MARKERS` marks a block body for one system each:
``"efx"`` ``@effectfx.region``, ``"tc"`` ``@torch.compiler.nested_compile_region``, ``"eager"`` nothing
(the eager baseline pays no wrapper cost).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch._library.effects import EffectType

import effectfx as efx

ROOT = Path(__file__).resolve().parent
RESULTS_DIR = ROOT / "results"
# quick runs are smoke tests: they must never replace the committed figures in RESULTS_DIR, so by default
# they land in a folder .gitignore excludes
QUICK_RESULTS_DIR = RESULTS_DIR / "quick"
Key = TypeVar("Key", bound=Hashable)

# -- the effect op and the markers -----------------------------------------------------------------
LOG: list[str] = []


@torch.library.custom_op("efxbench::record", mutates_args=(), schema="(str label) -> ()")
def record(label: str) -> None:
    LOG.append(label)


record.register_fake(lambda label: None)
efx.register_effect(record, key="memory")
torch.library._register_effectful_op("efxbench::record", EffectType.ORDERED)

MARKERS: dict[str, Callable[[Any], Any]] = {
    "eager": lambda f: f,
    "efx": efx.region,
    "tc": torch.compiler.nested_compile_region,
}


# -- numbers ---------------------------------------------------------------------------------------
def median(values: Iterable[float]) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def median_or_none(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when none is."""
    v = [x for x in values if x is not None]
    return median(v) if v else None


def median_of_ok_runs(runs: list[dict[str, Any]], field: str) -> float | None:
    """The median of ``field`` over the runs that succeeded (``status == "ok"``) and recorded it (runs of an
    older version of a script may lack a field)."""
    return median_or_none(r.get(field) for r in runs if r.get("status") == "ok")


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``; None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def ratio_unless_nan(a: float | None, b: float | None) -> float | None:
    """:func:`ratio`, and None also when either is NaN (the time a system records for what did not run)."""
    if a is None or b is None or math.isnan(a) or math.isnan(b):
        return None
    return ratio(a, b)


def paired(a: list[float] | None, b: list[float] | None, resamples: int = 4000) -> dict[str, float] | None:
    """The per-round ratio ``a / b`` of two systems timed in the same shuffled rounds: its median, quartiles
    and the bootstrap 95 % interval of the median (the rounds' scatter only: it does not cover what two
    instances of one system built apart differ by).  None unless both ran in every round."""
    if not a or not b or len(a) != len(b):
        return None
    ratios = np.asarray(a) / np.asarray(b)
    picks = np.random.default_rng(0).integers(0, len(ratios), (resamples, len(ratios)))
    low, high = np.percentile(np.median(ratios[picks], axis=1), [2.5, 97.5])
    ordered = sorted(ratios.tolist())
    return {"median": float(np.median(ratios)), "q1": ordered[len(ordered) // 4],
            "q3": ordered[(3 * len(ordered)) // 4], "low": float(low), "high": float(high)}


def fmt(value: float | None, unit: str = "", digits: int = 2) -> str:
    """``value`` with ``digits`` decimals and ``unit``; ``-`` for None."""
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def targets_lines(targets: dict[str, dict[str, Any]]) -> list[str]:
    """A blank line, ``targets:`` and a line per target with its verdict: a count, or a ratio with its CPU
    figure and its per-round median and quartiles (:func:`paired`).  Nothing for no targets."""
    lines = ["", "targets:"] if targets else []
    for name, t in targets.items():
        value, rounds = t["value"], t.get("paired")
        if isinstance(value, float):
            each = f"; per-round median {rounds['median']:.3f}x, IQR {rounds['q1']:.3f}-{rounds['q3']:.3f}x"
            value = f"{value:.3f}x (CPU {fmt(t['cpu'], 'x', 3)}{each if rounds else ''})"
        lines.append(f"  {name}: {t['target']}: {value} -> {'met' if t['met'] else 'NOT met'}")
    return lines


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if k else c.ljust(w) for c, w in zip(r, widths)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# -- timing ----------------------------------------------------------------------------------------
def quiet_gc() -> None:
    """Collect garbage before a measurement (cheap once :func:`freeze_heap` ran)."""
    gc.collect()


def freeze_heap() -> None:
    """Move every object alive now (torch's modules, dynamo's tables) out of the collector's sight, so a
    full collection between measurements costs milliseconds instead of most of a second."""
    gc.collect()
    gc.freeze()


def interleave(steps: dict[Key, Callable[[], Any]], budget_s: float, min_rounds: int = 3
               ) -> tuple[dict[Key, list[float]], dict[Key, list[float]], int, dict[Key, int]]:
    """Time ``steps`` interleaved: each round runs every step once in a shuffled order, one sample of
    >= 20 ms of calls, for ``budget_s`` seconds and at least ``min_rounds`` rounds.  Returns the seconds
    per call of every sample, wall and CPU time of this process, the rounds and the calls per sample."""
    calls = {}
    for key, step in steps.items():  # calls per sample: at least 20 ms
        t = time.perf_counter()
        step()
        calls[key] = max(1, int(0.02 / max(time.perf_counter() - t, 1e-6)))
    freeze_heap()
    wall: dict[Key, list[float]] = {key: [] for key in steps}
    cpu: dict[Key, list[float]] = {key: [] for key in steps}
    end, rounds = time.perf_counter() + budget_s, 0
    while time.perf_counter() < end or rounds < min_rounds:
        order = list(steps)
        random.shuffle(order)
        for key in order:
            t, c = time.perf_counter(), time.process_time()
            for _ in range(calls[key]):
                steps[key]()
            wall[key].append((time.perf_counter() - t) / calls[key])
            cpu[key].append((time.process_time() - c) / calls[key])
        rounds += 1
    return wall, cpu, rounds, calls


def run_steps(step: Callable[[Any], tuple[float, list]], data: list[Any]) -> tuple[list[float], list[list]]:
    """``step(batch) -> (loss, effect log)`` on every batch: the losses and the logs, in order."""
    losses, logs = [], []
    for batch in data:
        loss, log = step(batch)
        losses.append(loss)
        logs.append(log)
    return losses, logs


def sci(v: float | None) -> str:
    """A difference for a table: ``1.2e-07``, or ``-`` where there is none."""
    return "-" if v is None else f"{v:.1e}"


# -- the compilers ----------------------------------------------------------------------------------
def dynamo_counts() -> dict[str, int]:
    """torch.compile's counters in this process: frames, graphs installed (a compile or a recompile each),
    backend compiles (a restarted analysis included) and graph breaks."""
    from torch._dynamo.utils import counters

    return {"frames_ok": int(counters["frames"]["ok"]), "frames_total": int(counters["frames"]["total"]),
            "unique_graphs": int(counters["stats"]["unique_graphs"]),
            "backend_compiles": int(counters["aot_autograd"]["total"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def error_text(exc: BaseException) -> str:
    """``Type: first line`` (and the next when the first only introduces it, as dynamo's
    ``BackendCompilerFailed: backend='inductor' raised:`` does)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text += " " + lines[1]
    return f"{type(exc).__name__}: {text[:300]}"


# -- progress --------------------------------------------------------------------------------------
class Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal, a line per step otherwise)."""

    def __init__(self, total: int, title: str = "bench", enabled: bool = True, width: int = 30) -> None:
        self.total, self.done, self.title, self.enabled, self.width = max(total, 1), 0, title, enabled, width
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def step(self, label: str = "") -> None:
        self.done = min(self.done + 1, self.total)
        if not self.enabled:
            return
        filled = round(self.width * self.done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        line = f"{self.title} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {label}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line[:160])
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


# -- machine info, provenance ----------------------------------------------------------------------
def _git(args: list[str], cwd: Path) -> str | None:
    """``git ARGS`` in ``cwd``: its output, or None outside git (or without git)."""
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "effectfx_commit": _git(["rev-parse", "--short", "HEAD"], ROOT) or None,
    }


def effectfx_source() -> dict[str, Any]:
    """Which effectfx a run measured, without this machine's paths: the imported package's folder relative
    to its git checkout (outside one, its name) and that checkout's ``git rev-parse HEAD`` (None outside)."""
    package = Path(efx.__file__).resolve().parent
    top = _git(["rev-parse", "--show-toplevel"], package)
    path = package.relative_to(top).as_posix() if top and package.is_relative_to(top) else package.name
    return {"effectfx_path": path, "effectfx_git_commit": _git(["rev-parse", "HEAD"], package) or None}


def effectfx_dirty() -> bool | None:
    """Whether the imported effectfx package has uncommitted changes (the commit then does not say it all);
    None outside git."""
    status = _git(["status", "--porcelain", "--", "."], Path(efx.__file__).resolve().parent)
    return None if status is None else bool(status)


# -- output ----------------------------------------------------------------------------------------
def output_dir(out: Path | None, quick: bool) -> Path:
    """Where a run writes: ``out`` when given, else :data:`QUICK_RESULTS_DIR` for quick runs (git-ignored)
    and :data:`RESULTS_DIR` (the committed figures) for full runs."""
    if out is not None:
        return out
    return QUICK_RESULTS_DIR if quick else RESULTS_DIR


def replace_atomically(path: Path, write: Callable[[Path], Any]) -> Path:
    """``write(tmp)`` then rename ``tmp`` to ``path``: two runs writing the same folder at once (two test
    runs in one checkout) never leave a half-written file for a reader."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_json(data: dict[str, Any], out_dir: Path, name: str) -> Path:
    text = json.dumps(data, indent=2, default=str) + "\n"
    return replace_atomically(out_dir / f"{name}.json", lambda tmp: tmp.write_text(text))


def add_output_arguments(parser: argparse.ArgumentParser, name: str, child: bool = True) -> None:
    """The options every script's results take: where they go, redrawing them, and (for a script that
    measures in child processes) the child's own."""
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where {name}.json goes (default: results/, or results/quick/ with --quick)")
    parser.add_argument("--plot-only", type=Path, default=None, metavar="JSON",
                        help="redraw the table and PNG (next to JSON) from a run's JSON; no measuring")
    if child:
        parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


def add_run_arguments(parser: argparse.ArgumentParser, budget: bool = True) -> None:
    """The options of a measuring run every steady-state script takes: threads, the steady-state budget,
    the progress bar and a label kept in the JSON."""
    parser.add_argument("--threads", type=int, default=1, help="torch threads while measuring")
    if budget:
        parser.add_argument("--budget", type=float, default=None, help="seconds of steady-state rounds")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--label", default=None, help="a note on the run, kept in the JSON")


# a study's report: summarize (None: the run's JSON holds its analysis already), table and plot
Report = tuple[Callable[[dict[str, Any]], dict[str, Any]] | None, Callable[[dict[str, Any]], str],
               Callable[[dict[str, Any], Path], Path]]


def redraw(json_path: Path, report: Report) -> int:
    """``--plot-only``: the summary, table and PNG (next to the JSON) of a run's results, no measuring."""
    summarize, table, plot = report
    data = json.loads(json_path.read_text())
    if summarize is not None:
        data["summary"] = summarize(data)
    print(table(data))
    print("wrote", replace_atomically(json_path.with_suffix(".png"), lambda p: plot(data, p)))
    return 0


def publish(data: dict[str, Any], out_dir: Path, name: str, report: Report) -> None:
    """Write a run's measurements (first, whatever the summary does), then with their summary; print the
    table and write the PNG."""
    summarize, table, plot = report
    path = write_json(data, out_dir, name)
    if summarize is not None:
        data["summary"] = summarize(data)
        path = write_json(data, out_dir, name)
    print(table(data))
    print(f"\nwrote {path}")
    print("wrote", replace_atomically(out_dir / f"{name}.png", lambda p: plot(data, p)))


def dispatch(args: argparse.Namespace, name: str, report: Report, measure: Callable[[], dict[str, Any]],
             child: Callable[[dict[str, Any]], Any] | None = None) -> int:
    """A script's ``main`` once its options are parsed: ``--plot-only`` redraws; ``--child SPEC`` measures
    the part ``child(spec)`` does and prints it as one JSON line (for :func:`benchmarks.common_child.run`);
    otherwise the whole run is measured (``measure()``) and published."""
    if args.plot_only is not None:
        return redraw(args.plot_only, report)
    if child is not None and args.child:
        print(json.dumps(child(json.loads(args.child)), default=str))
        return 0
    publish(measure(), output_dir(args.out, args.quick), name, report)
    return 0


def save_figure(fig: Any, title: str, data: dict[str, Any], path: Path) -> Path:
    """Title ``fig`` with what was measured and on which torch, when; write it to ``path`` as PNG."""
    import matplotlib.pyplot as plt

    m = data["machine"]
    fig.suptitle(f"{title} -- torch {m['torch']}, {m['timestamp'][:16]}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
