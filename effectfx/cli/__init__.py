"""The effectfx command line: ``effectfx <command>`` or ``python -m effectfx <command>``.

Each command lives in its own module ``effectfx.cli.<command>`` exposing ``add_arguments(parser)`` and
``run(args) -> int``; this file only dispatches, so commands are added without touching each other.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

COMMANDS = {
    "demo": "what effect tokens are for, measured beside eager and torch.compile (under a minute)",
    "show": "capture a function from a file and print a form, or write an HTML picture of its graphs",
    "bench": "run the benchmarks: JSON results and a PNG plot",
    "fuzz": "differential fuzzing of generated programs against eager",
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="effectfx", description="effectfx command line")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, help_text in COMMANDS.items():
        try:
            module = importlib.import_module(f"effectfx.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"effectfx.cli.{name}":
                raise
            continue
        modules[name] = module
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)
