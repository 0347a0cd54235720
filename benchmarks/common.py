"""Shared pieces of the benchmarks: the effect op, the block-stack models, timing, machine info, output.

The model is a stack of N blocks, each ``relu(Linear(x))`` plus one call of a cheap effect op
``efxbench::record(label)`` that appends to :data:`LOG`.  The same block body is marked three ways, one
class per marker, so each system sees its own marker and nothing else:

* ``"efx"``   -- ``@effectfx.region`` (for ``efx.compile``);
* ``"tc"``    -- ``@torch.compiler.nested_compile_region`` (for ``torch.compile``);
* ``"eager"`` -- unmarked (the eager baseline pays no wrapper cost).

The effect op is registered with effectfx (key ``"memory"``) *and* with PyTorch's own effect registry
(ORDERED); without the latter ``torch.compile`` treats the op as pure and drops every call.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch._library.effects import EffectType

import effectfx as efx

ROOT = Path(__file__).resolve().parent
RESULTS_DIR = ROOT / "results"
# quick runs are smoke tests: they must never replace the committed figures in RESULTS_DIR, so by default
# they land in a folder .gitignore excludes
QUICK_RESULTS_DIR = RESULTS_DIR / "quick"

# -- the effect op ---------------------------------------------------------------------------------
LOG: list[str] = []


@torch.library.custom_op("efxbench::record", mutates_args=(), schema="(str label) -> ()")
def record(label: str) -> None:
    LOG.append(label)


record.register_fake(lambda label: None)
efx.register_effect(record, key="memory")
torch.library._register_effectful_op("efxbench::record", EffectType.ORDERED)
RECORD = torch.ops.efxbench.record.default


# -- the models ------------------------------------------------------------------------------------
def _forward_effect(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    torch.ops.efxbench.record("block")
    return torch.relu(self.lin(x))


def _forward_plain(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(self.lin(x))


class BlockBase(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)


MARKERS: dict[str, Callable[[Any], Any]] = {
    "eager": lambda f: f,
    "efx": efx.region,
    "tc": torch.compiler.nested_compile_region,
}

BLOCKS: dict[tuple[str, bool], type[BlockBase]] = {
    (marker, effects): type(
        f"Block_{marker}{'' if effects else '_noeffect'}",
        (BlockBase,),
        {"forward": mark(_forward_effect if effects else _forward_plain)},
    )
    for marker, mark in MARKERS.items()
    for effects in (True, False)
}


class Stack(torch.nn.Module):
    def __init__(self, n: int, width: int, marker: str = "eager", effects: bool = True) -> None:
        super().__init__()
        block = BLOCKS[(marker, effects)]
        self.blocks = torch.nn.ModuleList(block(width) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def make_model(n: int, width: int, marker: str, effects: bool = True, train: bool = True,
               seed: int = 0) -> Stack:
    """A fresh stack; the same ``seed`` gives the same weights whatever the marker."""
    torch.manual_seed(seed)
    model = Stack(n, width, marker, effects)
    model.requires_grad_(train)
    return model


def compile_for(system: str, model: torch.nn.Module) -> Callable[..., Any]:
    if system == "efx":
        return efx.compile(model)
    if system == "tc":
        return torch.compile(model, backend="aot_eager")
    if system == "eager":
        return model
    raise ValueError(system)


# -- timing ----------------------------------------------------------------------------------------
def median(values: Iterable[float]) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


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


def quiet_gc() -> None:
    """Collect garbage before a measurement (cheap once :func:`freeze_heap` ran)."""
    gc.collect()


def freeze_heap() -> None:
    """Move every object alive now (torch's modules, dynamo's tables) out of the collector's sight, so a
    full collection between measurements costs milliseconds instead of most of a second."""
    gc.collect()
    gc.freeze()


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


# -- progress --------------------------------------------------------------------------------------
class Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal, a line per step otherwise)."""

    def __init__(self, total: int, title: str = "bench", enabled: bool = True, width: int = 30) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.title = title
        self.enabled = enabled
        self.width = width
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


# -- machine info and output -----------------------------------------------------------------------
def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


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
        "effectfx_commit": _git_commit(),
    }


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


def add_output_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """The options every script's results take: where they go, redrawing them, and the child-process one."""
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where {name}.json goes (default: results/, or results/quick/ with --quick)")
    parser.add_argument("--plot-only", type=Path, default=None, metavar="JSON",
                        help="redraw the table and PNG (next to JSON) from a run's JSON; no measuring")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)


def add_run_arguments(parser: argparse.ArgumentParser, budget: bool = True) -> None:
    """The options of a measuring run every steady-state script takes: threads, the steady-state budget,
    the progress bar and a label kept in the JSON."""
    parser.add_argument("--threads", type=int, default=1, help="torch threads while measuring")
    if budget:
        parser.add_argument("--budget", type=float, default=None, help="seconds of steady-state rounds")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument("--label", default=None, help="a note on the run, kept in the JSON")


Report = tuple[Callable[[dict[str, Any]], dict[str, Any]], Callable[[dict[str, Any]], str],
               Callable[[dict[str, Any], Path], Path]]  # a script's summarize, table and plot


def redraw(json_path: Path, report: Report) -> int:
    """``--plot-only``: the summary, table and PNG (next to the JSON) of a run's results, no measuring."""
    summarize, table, plot = report
    data = json.loads(json_path.read_text())
    data["summary"] = summarize(data)
    print(table(data))
    print("wrote", replace_atomically(json_path.with_suffix(".png"), lambda p: plot(data, p)))
    return 0


def publish(data: dict[str, Any], out_dir: Path, name: str, report: Report) -> None:
    """Write a run's measurements (first, whatever the summary does), then with their summary; print the
    table and write the PNG."""
    summarize, table, plot = report
    write_json(data, out_dir, name)
    data["summary"] = summarize(data)
    path = write_json(data, out_dir, name)
    print(table(data))
    print(f"\nwrote {path}")
    print("wrote", replace_atomically(out_dir / f"{name}.png", lambda p: plot(data, p)))


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


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if k else c.ljust(w) for c, w in zip(r, widths)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def warmup() -> None:
    """Pay one-time costs (lazy imports, dynamo/AOT initialisation, first dispatch) before measuring."""
    for train in (False, True):
        for system, marker in (("efx", "efx"), ("tc", "tc"), ("eager", "eager")):
            torch._dynamo.reset()
            model = make_model(1, 8, marker, train=train)
            x = torch.randn(2, 8)
            with torch.set_grad_enabled(train):
                out = compile_for(system, model)(x)
                if train and out.requires_grad:
                    out.sum().backward()
    torch._dynamo.reset()
    LOG.clear()
    freeze_heap()
