"""``effectfx fuzz``: differential fuzzing of generated programs against eager PyTorch.

Generates ``--programs`` random programs (``effectfx.testing.generator``, driven by hypothesis with
``--seed``) and runs each (``effectfx.testing.checking``) in eager, through every form in
``effectfx.testing.differential.FORMS`` and through ``efx.compile`` with backward, comparing outputs,
gradients, effect logs (what the program prints included), and the arguments and buffers after every call
(programs update both in place) -- also over a sequence of calls with module hooks registered or removed
between them, on the eager model and the compiled one alike; a program effectfx must refuse (a region
changing its list argument, an update of a leaf that requires grad) must be refused by every form.  With
``--sizes``, each compiled program is then called on inputs of other batch sizes, and so is one compiled
with ``dynamic=True`` (Note [Symbolic shapes]): each call compared with eager's, and the captures counted
(one symbolic capture for all the sizes; more only where a capture pinned a size, reported).  Prints
a progress bar on stderr and a summary on stdout; on any failure, minimizes one program per kind of failure
and saves it as a standalone reproducer in ``--out``, and exits 1.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--programs", type=int, default=200, help="how many programs to generate")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (same seed, same programs)")
    parser.add_argument("--out", default="fuzz-failures", help="directory for minimized reproducers")
    parser.add_argument("--forms", default="", help="comma-separated forms to check (default: all FORMS)")
    parser.add_argument("--backend", default="eager", help="efx.compile backend to check (eager, inductor)")
    parser.add_argument("--exclude", action="append", default=[], metavar="KIND",
                        help="statement kind or effect op generated programs must not use "
                             "(e.g. nograd, inplace, loop, scale, child, hook, backward_hook, late_hook); "
                             "repeatable")
    parser.add_argument("--max-regions", type=int, default=4)
    parser.add_argument("--max-stmts", type=int, default=6)
    parser.add_argument("--max-repros", type=int, default=3,
                        help="minimize and save at most this many failures (one per kind)")
    parser.add_argument("--shrink-seconds", type=float, default=120.0, help="time budget per minimization")
    parser.add_argument("--sizes", action="store_true",
                        help="also call each compiled program on other batch sizes (B+1, B+3, B+2), with "
                             "automatic dynamic and dynamic=True, comparing each call with eager and "
                             "counting captures (about doubles the time)")


@dataclass
class Stats:
    programs: int = 0
    comparisons: int = 0
    effects_compared: int = 0
    failing_programs: int = 0
    refused: int = 0  # programs effectfx must refuse (checked to be refused, effects unrun)
    mismatches: int = 0  # failed comparisons (outputs/gradients/effect logs)
    errors: int = 0  # exceptions on programs effectfx should support
    by_kind: Counter = field(default_factory=Counter)
    sized: int = 0  # comparisons on other batch sizes (--sizes)
    captures: Counter = field(default_factory=Counter)  # (where, captures for the sizes) -> programs
    specialized: list = field(default_factory=list)  # (program number, what pinned a size)
    features: Counter = field(default_factory=Counter)
    first_failure: dict = field(default_factory=dict)  # label -> (spec, outcome)


class Progress:
    """A one-line progress bar on stderr (a line per 10% when stderr is not a terminal)."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width = max(total, 1), width
        self.start = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.last_decile = -1

    def update(self, done: int, failing: int) -> None:
        rate = done / max(time.monotonic() - self.start, 1e-9)
        filled = int(self.width * done / self.total)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} programs "
                f"{rate:.1f}/s  failing {failing}")
        if self.tty:
            sys.stderr.write("\r" + line)
            sys.stderr.flush()
        elif done * 10 // self.total != self.last_decile or done == self.total:
            self.last_decile = done * 10 // self.total
            sys.stderr.write(line + "\n")

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")[:60]


def run(args: argparse.Namespace) -> int:
    from hypothesis import HealthCheck, Phase, given, seed, settings

    from ..testing import differential
    from ..testing.checking import check_program, fails_like, reproducer_source, shrink
    from ..testing.generator import programs

    forms = tuple(f for f in args.forms.split(",") if f) or None
    if forms is not None:
        unknown = [f for f in forms if f not in differential.FORMS]
        if unknown:
            print(f"unknown form(s) {unknown}; FORMS has {sorted(differential.FORMS)}", file=sys.stderr)
            return 2
    stats = Stats()
    progress = Progress(args.programs)
    strategy = programs(max_regions=args.max_regions, max_stmts=args.max_stmts, exclude=tuple(args.exclude))
    started = time.monotonic()

    @seed(args.seed)
    @settings(max_examples=args.programs, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(strategy)
    def one(spec: object) -> None:
        if stats.programs >= args.programs:
            return
        outcome = check_program(spec, forms, backend=args.backend, sizes=args.sizes)  # type: ignore[arg-type]
        stats.programs += 1
        stats.comparisons += outcome.comparisons
        stats.effects_compared += outcome.effects_compared
        stats.refused += spec.refusal() is not None  # type: ignore[attr-defined]
        stats.sized += outcome.sized
        stats.captures.update(outcome.captures.items())
        stats.specialized.extend((stats.programs, text) for text in outcome.specialized)
        stats.features.update(spec.features())  # type: ignore[attr-defined]
        if outcome.failures:
            stats.failing_programs += 1
            for f in outcome.failures:
                if f.kind.startswith("error"):
                    stats.errors += 1
                else:
                    stats.mismatches += 1
            for label in outcome.kinds():
                stats.by_kind[label] += 1
                stats.first_failure.setdefault(label, (spec, outcome))
        progress.update(stats.programs, stats.failing_programs)

    try:
        one()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
    progress.close()
    elapsed = time.monotonic() - started

    saved = []
    if stats.first_failure:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        covered: set[str] = set()
        for label, (spec, _) in stats.first_failure.items():
            if label in covered or len(saved) >= args.max_repros:
                continue
            print(f"minimizing a program failing with {label} ...", file=sys.stderr)
            small = shrink(spec, fails_like(frozenset([label]), forms, args.backend, args.sizes),
                           budget_seconds=args.shrink_seconds)
            final = check_program(small, forms, backend=args.backend, sizes=args.sizes)
            note = f"effectfx fuzz --seed {args.seed}: {label}\n\n" + final.report()
            path = out / f"repro_{len(saved)}_{_slug(label)}.py"
            path.write_text(reproducer_source(small, note[:4000], args.backend, args.sizes))
            saved.append((label, path, spec.size(), small.size()))
            covered |= final.kinds() | {label}

    forms_run = forms or tuple(differential.FORMS)
    print(f"effectfx fuzz: seed {args.seed}, {stats.programs} programs in {elapsed:.0f}s")
    print(f"  forms checked      : {', '.join(forms_run)}, "
          f"compile backend {args.backend!r} (x2, new inputs, updated parameters, hooks changed between "
          f"calls{', other batch sizes' if args.sizes else ''}; with backward; arguments and buffers after "
          "every call)")
    print(f"  comparisons        : {stats.comparisons}")
    print(f"  effects compared   : {stats.effects_compared}")
    if args.sizes:
        print(f"  other batch sizes  : {stats.sized} of the comparisons (B+1, B+3, B+2; automatic dynamic "
              "and dynamic=True)")
        for (where, n), programs in sorted(stats.captures.items()):
            print(f"    {programs:6d}  programs: {n} capture(s) for the sizes [{where}]")
        print(f"  specialized        : {len(stats.specialized)} (a capture pinned a size: more captures)")
        for number, text in stats.specialized[:5]:
            print(f"    program {number}: {text[:300]}")
    print(f"  mismatches         : {stats.mismatches}")
    print(f"  errors             : {stats.errors}")
    print(f"  failing programs   : {stats.failing_programs}")
    print(f"  refused programs   : {stats.refused} (to be refused by every form and efx.compile)")
    if stats.by_kind:
        print("  failures by kind   :")
        for label, n in stats.by_kind.most_common():
            print(f"    {n:6d}  {label}")
    for label, path, before, after in saved:
        print(f"  reproducer         : {path}  ({label}; size {before} -> {after})")
    covered = ", ".join(f"{k} {v}" for k, v in sorted(stats.features.items()))
    print(f"  coverage (programs): {covered}")
    return 1 if stats.failing_programs else 0
