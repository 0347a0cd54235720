"""The effectfx command line: ``effectfx <command>`` or ``python -m effectfx <command>``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="effectfx", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the seed example: captured and functionalized graphs, effect logs vs eager")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo()
    parser.error(f"unknown command {args.command!r}")
    return 2
