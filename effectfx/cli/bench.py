"""``effectfx bench``: run the benchmarks in ``benchmarks/`` with a progress bar; JSON results + PNG plots.

* ``first_call`` -- capture+compile+first-run time of efx.compile vs torch.compile(aot_eager) vs eager
  for N = 1, 4, 16, 64 blocks, inference and training; plotted to ``first_call.png``;
* ``runtime`` -- steady-state time per call vs eager and torch.compile, and the cost per effect; plotted
  to ``runtime.png``.

A full run writes ``benchmarks/results/`` (the committed figures); ``--quick`` writes
``benchmarks/results/quick/`` (git-ignored), so a smoke run never replaces them; ``--out`` chooses.

The benchmarks live in the source checkout (``benchmarks/`` beside the ``effectfx`` package), which an
editable install (``pip install -e .``, what ``make`` does) provides.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = ("first_call", "runtime")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: few sizes, one repetition, short budgets (well under a minute)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for the JSON files and the plots (default: benchmarks/results, "
                             "or benchmarks/results/quick with --quick)")
    parser.add_argument("--only", choices=BENCHMARKS, action="append",
                        help="run only this benchmark (repeatable)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads while measuring (default 1: steadier figures)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _benchmarks_package() -> ModuleType:
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "first_call.py").is_file():
        raise SystemExit(
            f"effectfx bench: no benchmarks/ directory next to the effectfx package (looked in {root}). "
            "Run it from a source checkout installed with `pip install -e .`."
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("benchmarks")


def run(args: argparse.Namespace) -> int:
    _benchmarks_package()
    import torch

    from benchmarks import common, first_call, first_call_systems, runtime

    torch.set_num_threads(args.threads)
    out = common.output_dir(args.out, args.quick)
    selected = args.only or list(BENCHMARKS)
    total = 1  # the warm-up
    if "first_call" in selected:
        total += len(first_call.plan(args.quick))
    if "runtime" in selected:
        total += runtime.steps_total(args.quick)
    progress = common.Progress(total, "effectfx bench", enabled=not args.no_progress)

    first_call_systems.warmup()
    progress.step("warm-up (imports, one tiny compile of each system)")
    written: list[Path] = []
    if "first_call" in selected:
        data = first_call.run(args.quick, progress, warm=False)
        print(first_call.table(data))
        written.append(common.write_json(data, out, first_call.NAME))
        written.append(common.replace_atomically(out / f"{first_call.NAME}.png",
                                                 lambda path, data=data: first_call.plot(data, path)))
    if "runtime" in selected:
        data = runtime.run(args.quick, progress, warm=False)
        print(runtime.table(data))
        written.append(common.write_json(data, out, runtime.NAME))
        written.append(common.replace_atomically(out / f"{runtime.NAME}.png",
                                                 lambda path, data=data: runtime.plot(data, path)))
    for path in written:
        print(f"wrote {path}")
    return 0
