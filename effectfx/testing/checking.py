"""Running a generated program against eager PyTorch, and minimizing one that fails.

:func:`check_program` runs one :class:`~effectfx.testing.program.ProgramSpec` in eager, through every form
in ``FORMS`` and through ``efx.compile`` (twice on the same inputs, once on new inputs of the same
signature, once after an in-place parameter update; then, for a program whose hooks change between calls
(:meth:`~effectfx.testing.program.ProgramSpec.sequence`), once per call of that sequence, each compared
with eager's on the same hooks: ``effectfx.testing.sequence``) and classifies what went wrong.  Each run
gets fresh copies of the arguments and starts from the same buffers; the arguments and every buffer after
every call are compared with eager's too (``differential.run_sequence``, shared with
``check_mutations_against_eager``).  With ``sizes``, the compiled module is then called on inputs of other
batch sizes, and so is one compiled with ``dynamic=True``, each call compared with eager's; automatic
dynamic may capture once more for them all (the symbolic capture), ``dynamic=True`` once in all, and more
captures are a failure unless one pinned a size (a finding, ``Outcome.specialized``: Note [Symbolic
shapes]).  What the program prints (Python ``print`` to stdout or stderr) is
part of its effect log, in order with the effect ops; a program effectfx must refuse
(:meth:`~effectfx.testing.program.ProgramSpec.refusal`) must be refused by every form and by
``efx.compile``, before any effect runs.  :func:`shrink` (``effectfx.testing.shrinking``) is a
deletion-based minimizer over the description.
"""

from __future__ import annotations

import contextlib
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import effectfx as efx

from . import differential
from .differential import EagerMismatch, StartingState, compare, fresh_args, run_form, run_sequence, state_of
from .effect_ops import LOG, recording
from .program import ProgramSpec, build_source, load_source
from .render import render
from .sequence import EagerFailed, run_changing
from .shrinking import _candidates as _candidates
from .shrinking import shrink


@dataclass(frozen=True)
class Failure:
    """One way effectfx disagreed with eager (or refused a supported program)."""

    where: str  # the form, "compile call N", "compile new inputs", "eager"
    kind: str  # "outputs differ", "effect logs differ", ..., "error: CaptureError"
    detail: str

    @property
    def label(self) -> str:
        where = self.where
        if where.startswith("compile"):
            where = next((w for w in (HOOKS_CHANGED, SIZES_CHANGED, DYNAMIC) if where.startswith(w)),
                         "compile")
        return f"{self.kind} [{where}]"


HOOKS_CHANGED = "compile, hooks changed between calls"  # where: effectfx.testing.sequence
SIZES_CHANGED = "compile, batch size changed"  # where: the compiled module on other batch sizes
DYNAMIC = "compile dynamic=True"  # where: a module compiled with every size symbolic
# the batch sizes of the size-varying calls, as B + step: distinct, never 1 (0/1 specialize, as in torch),
# not in order, so a guard a symbolic capture got wrong (``s0 < 4``) shows on a later call
SIZE_STEPS = (1, 3, 2)


def batch_sizes(batch: int) -> tuple[int, ...]:
    """The batch sizes the size-varying calls of a program of batch size ``batch`` use."""
    return tuple(batch + step for step in SIZE_STEPS)


@dataclass
class Outcome:
    failures: list[Failure] = field(default_factory=list)
    comparisons: int = 0
    effects_compared: int = 0
    seconds: float = 0.0
    sized: int = 0  # of the comparisons, those of calls on other batch sizes
    captures: dict[str, int] = field(default_factory=dict)  # SIZES_CHANGED, DYNAMIC: captures for the sizes
    specialized: list[str] = field(default_factory=list)  # why a capture for other sizes pinned one

    @property
    def generator_error(self) -> bool:
        return any(f.where == "eager" for f in self.failures)

    def kinds(self) -> frozenset[str]:
        return frozenset(f.label for f in self.failures)

    def report(self) -> str:
        if not self.failures:
            sized = f" ({self.sized} on other batch sizes)" if self.sized else ""
            found = "".join(f"\nspecialized: {s}" for s in self.specialized)
            return f"ok: {self.comparisons} comparisons{sized}, {self.effects_compared} effects compared" \
                + found
        return "\n\n".join(f"{f.label}\n{f.detail}" for f in self.failures)


_MISMATCH_KINDS = ("capture ran effects", "outputs differ", "gradients differ", "effect logs differ",
                   "arguments or buffers differ")


def _classify(where: str, exc: BaseException) -> list[Failure]:
    if isinstance(exc, EagerMismatch):
        text = str(exc)
        kinds = [k for k in _MISMATCH_KINDS if k in text] or ["mismatch"]
        return [Failure(where, k, text) for k in kinds]
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    return [Failure(where, f"error: {type(exc).__name__}", tb)]


class _ToLog:
    """A stream whose text goes to the effect log, so prints are compared in order with the effect ops:
    consecutive writes join (``print`` writes its pieces one by one, effectfx's print op writes once)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        if text:
            if LOG and LOG[-1][0] == self.name:
                LOG[-1] = (self.name, LOG[-1][1] + text)
            else:
                LOG.append((self.name, text))
        return len(text)

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _prints_to_log() -> Iterator[list[warnings.WarningMessage]]:
    """Prints go to the effect log; effectfx's warnings (an unfaithful print) are collected."""
    with contextlib.redirect_stdout(_ToLog("stdout")), contextlib.redirect_stderr(_ToLog("stderr")), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", efx.EffectfxWarning)
        yield caught


Between = Callable[[torch.nn.Module, int], None]
Sized = Callable[[int, int], tuple]  # sized(variant, batch): make(variant)'s arguments, of batch size batch


def check_model(make: Callable[[int], tuple[torch.nn.Module, tuple]],
                forms: tuple[str, ...] | None = None, calls: int = 2, backend: str = "eager",
                refusal: str | None = None, between: Between | None = None, sequence: int = 0,
                sizes: tuple[int, ...] = (), sized: Sized | None = None) -> Outcome:
    """Run ``make()``'s model in eager, through every form in ``FORMS`` (``calls`` times each) and through
    ``efx.compile`` (``calls`` times, then once on ``make(1)``'s inputs and once after an in-place update of
    the parameters, neither of which may recompile).  With ``between`` (hooks registered or removed before
    call ``k`` of a sequence, ``between(model, k)``), the same compiled module then makes ``sequence`` calls,
    each compared with eager's on the model as ``between`` left it (``effectfx.testing.sequence``).  With
    ``sizes`` (batch sizes, none 1) and ``sized`` (``sized(variant, batch)``: arguments like ``make``'s, of
    that batch size), the compiled module is then called once per size, and a module compiled with
    ``dynamic=True`` once on ``make(0)``'s inputs and once per size, each compared with eager's; automatic
    dynamic must capture at most once for all the sizes, ``dynamic=True`` once in all, unless a capture pinned
    a size (``Outcome.specialized``).  With
    ``refusal`` (an error class name), every form and ``efx.compile`` must raise it instead, having run no
    effect."""
    if sizes and sized is None:
        raise ValueError("sizes need sized(variant, batch) to make the arguments")
    outcome = Outcome()
    start = time.perf_counter()
    with _prints_to_log() as caught:
        # (forms=() checks efx.compile only; None: every form)
        _check(make, tuple(differential.FORMS) if forms is None else forms, calls, backend, refusal, outcome,
               (between, sequence) if between is not None and sequence > 1 else None,
               (sizes, sized) if sizes and sized is not None else None)
    outcome.failures.extend(Failure("capture", f"warned: {type(w.message).__name__}", str(w.message))
                            for w in caught if isinstance(w.message, efx.EffectfxWarning))
    outcome.seconds = time.perf_counter() - start
    return outcome


def _check(make: Callable[[int], tuple[torch.nn.Module, tuple]], forms: tuple[str, ...], calls: int,
           backend: str, refusal: str | None, outcome: Outcome, changes: tuple[Between, int] | None,
           resized: tuple[tuple[int, ...], Sized] | None = None) -> None:
    model, args = make(0)
    if refusal is not None:  # (eager may refuse it too: a leaf that requires grad updated in place)
        builders = {name: differential.FORMS[name] for name in forms}
        builders["compile"] = lambda f, a, k: efx.compile(f, backend=backend)(*a, **k)
        for name, build in builders.items():
            _check_refused(name, lambda build=build: build(model, fresh_args(args)(), {}), refusal, outcome)
        return
    # every run gets fresh copies of the arguments and starts from the same buffers; the arguments and
    # every buffer after every call are compared too (Note [Mutations])
    start = StartingState(state_of(model))
    make_args = fresh_args(args)

    def eager(make_args: Callable[[], tuple], n: int) -> list[differential.RunResult] | None:
        try:
            return run_sequence(model, model, make_args, start, n)
        except Exception as exc:  # the generator made an invalid program
            outcome.failures.extend(_classify("eager", exc))
            return None

    def check(where: str, run: Callable[[], list[differential.RunResult]],
              expected: list[differential.RunResult]) -> None:
        try:
            for i, (want, got) in enumerate(zip(expected, run(), strict=True)):
                outcome.comparisons += 1
                outcome.sized += where.startswith((SIZES_CHANGED, DYNAMIC))
                compare(where if len(expected) == 1 else f"{where} call {i + 1}", want, got)
                outcome.effects_compared += len(want.log)
        except Exception as exc:
            outcome.failures.extend(_classify(where, exc))

    expected = eager(make_args, calls)
    if expected is None:
        return
    for name in forms:
        build = differential.FORMS[name]
        check(name, lambda name=name, build=build: run_form(name, build, model, make_args, start, calls),
              expected)
    cfn = efx.compile(model, backend=backend)
    check("compile", lambda: run_sequence(cfn, model, make_args, start, calls), expected)
    try:
        eager_first = run_sequence(model, model, make_args, start, 1, first_only=True)
    except Exception:  # a program eager cannot differentiate that way: nothing to compare
        eager_first = None
    if eager_first is not None:
        check("compile, backward of the first output only",
              lambda: run_sequence(cfn, model, make_args, start, 1, first_only=True), eager_first)
    new_args = fresh_args(make(1)[1])
    expected = eager(new_args, 1)
    if expected is None:
        return
    check("compile new inputs", lambda: run_sequence(cfn, model, new_args, start, 1), expected)
    with torch.no_grad():  # an optimizer step: parameters change in place, the program reads them anew
        for p in model.parameters():
            p.mul_(-0.5)
    expected = eager(make_args, 1)
    if expected is None:
        return
    check("compile updated parameters", lambda: run_sequence(cfn, model, make_args, start, 1), expected)
    start.reset()
    if not outcome.failures and cfn.stats.compiles != 1:
        outcome.failures.append(Failure("compile", "recompiled for the same signature",
                                        f"{cfn.stats.compiles} compiles for one signature"))
    if changes is not None:
        _check_changes(model, cfn, make_args, *changes, outcome)
    if resized is not None:
        _check_sizes(model, cfn, make_args, *resized, backend, eager, check, start, outcome)
    start.reset()


def _check_changes(model: torch.nn.Module, cfn: Any, make_args: Callable[[], tuple], between: Between,
                   calls: int, outcome: Outcome) -> None:
    """The compiled module already called, ``calls`` more calls with hooks changed between them."""
    try:
        pairs = run_changing(model, cfn, make_args, between, calls)
    except EagerFailed as exc:  # the generator made an invalid program
        outcome.failures.extend(_classify("eager", exc.__cause__ or exc))
        return
    except Exception as exc:
        outcome.failures.extend(_classify(HOOKS_CHANGED, exc))
        return
    for i, (want, got) in enumerate(pairs):
        outcome.comparisons += 1
        try:
            compare(f"{HOOKS_CHANGED}, call {i + 1}", want, got)
        except EagerMismatch as exc:
            outcome.failures.extend(_classify(HOOKS_CHANGED, exc))
        outcome.effects_compared += len(want.log)


Eager = Callable[[Callable[[], tuple], int], list[differential.RunResult] | None]
Check = Callable[[str, Callable[[], list[differential.RunResult]], list[differential.RunResult]], None]


def _check_sizes(model: torch.nn.Module, cfn: Any, make_args: Callable[[], tuple], sizes: tuple[int, ...],
                 sized: Sized, backend: str, eager: Eager, check: Check, start: StartingState,
                 outcome: Outcome) -> None:
    """The compiled module, already called at the program's batch size, on each of ``sizes`` (automatic
    dynamic: one symbolic capture serves them all); then a module compiled with ``dynamic=True`` on the
    first inputs and on each size (one capture in all).  Each call is compared with eager's."""
    calls = [(b, fresh_args(sized(2 + i, b))) for i, b in enumerate(sizes)]  # (variants 0, 1 are taken)
    expected = {b: eager(args, 1) for b, args in calls}
    if any(e is None for e in expected.values()):
        return
    before, known = cfn.stats.compiles, {id(p) for p in cfn.programs()}
    for b, args in calls:
        check(f"{SIZES_CHANGED} to {b}", lambda args=args: run_sequence(cfn, model, args, start, 1),
              expected[b])
    _count_captures(SIZES_CHANGED, cfn, cfn.stats.compiles - before, known, calls, outcome)
    dynamic = efx.compile(model, backend=backend, dynamic=True)
    first = eager(make_args, 1)
    if first is None:
        return
    check(f"{DYNAMIC}, first call", lambda: run_sequence(dynamic, model, make_args, start, 1), first)
    for b, args in calls:
        check(f"{DYNAMIC}, batch {b}", lambda args=args: run_sequence(dynamic, model, args, start, 1),
              expected[b])
    _count_captures(DYNAMIC, dynamic, dynamic.stats.compiles, set(), calls, outcome)


def _count_captures(where: str, cfn: Any, captures: int, known: set[int],
                    calls: list[tuple[int, Callable[[], tuple]]], outcome: Outcome) -> None:
    """At most one capture served the size-varying calls -- else one of them must have pinned a size: a
    finding (``Outcome.specialized``), not a failure."""
    outcome.captures[where] = captures
    if captures <= 1 or any(f.where.startswith(where) for f in outcome.failures):  # (a failed call: moot)
        return
    pinned, described = differential.pinned_sizes(cfn, known, [(f"batch {b}", args()) for b, args in calls])
    if pinned:
        outcome.specialized.append(f"[{where}] {captures} captures: " + "; ".join(pinned))
    else:
        sizes = [b for b, _ in calls]
        outcome.failures.append(Failure(where, "captured again for new sizes", f"{captures} captures for "
                                        f"batch sizes {sizes} (at most 1 expected):\n{described}"))


def _check_refused(where: str, build: Callable[[], Any], refusal: str, outcome: Outcome) -> None:
    outcome.comparisons += 1
    with recording() as log:
        try:
            build()
        except efx.EffectfxError as exc:
            if type(exc).__name__ != refusal:
                outcome.failures.extend(_classify(where, exc))
            elif log:
                outcome.failures.append(Failure(where, "capture ran effects", f"before refusing: {log}"))
            return
        except Exception as exc:
            outcome.failures.extend(_classify(where, exc))
            return
    outcome.failures.append(Failure(where, "not refused", f"expected {refusal}; effects: {log}"))


def check_program(spec: ProgramSpec, forms: tuple[str, ...] | None = None, calls: int = 2,
                  backend: str = "eager", sizes: bool = False) -> Outcome:
    """:func:`check_model` on the program ``spec`` describes; with ``sizes``, the size-varying calls too (on
    :func:`batch_sizes`)."""
    src = render(spec)
    between = load_source(src)["between"] if spec.sequence() else None
    return check_model(lambda variant: build_source(src, variant), forms, calls, backend, spec.refusal(),
                       between, spec.sequence(), batch_sizes(spec.batch) if sizes else (),
                       lambda variant, batch: build_source(src, variant, batch=batch)[1])


# the reproducer's ``sized``: the rendered ``make`` reads the global ``B`` when it runs
_SIZED_SOURCE = """
    def sized(variant, batch):
        \"\"\"make(variant)'s arguments with batch size ``batch``.\"\"\"
        global B
        saved, B = B, batch
        try:
            return make(variant)[1]
        finally:
            B = saved
"""


def reproducer_source(spec: ProgramSpec, note: str = "", backend: str = "eager", sizes: bool = False) -> str:
    """A standalone script that rebuilds the program and runs the differential check (with ``sizes``, the
    size-varying calls too)."""
    comment = "".join(f"# {line}\n" for line in note.splitlines())
    return (
        comment + render(spec)
        + "\n\nif __name__ == \"__main__\":\n"
        "    from effectfx.testing.checking import check_model\n"
        + (_SIZED_SOURCE if sizes else "") + "\n"
        f"    outcome = check_model(make, backend={backend!r}, refusal={spec.refusal()!r}"
        + (f", between=between, sequence={spec.sequence()}" if spec.sequence() else "")
        + (f",\n                          sizes={batch_sizes(spec.batch)!r}, sized=sized" if sizes else "")
        + ")\n"
        "    print(outcome.report())\n"
        "    raise SystemExit(1 if outcome.failures else 0)\n"
    )


def fails_like(kinds: frozenset[str], forms: tuple[str, ...] | None = None,
               backend: str = "eager", sizes: bool = False) -> Callable[[ProgramSpec], bool]:
    """A ``still_fails`` predicate for :func:`shrink`: the candidate fails with one of ``kinds``."""

    def predicate(candidate: ProgramSpec) -> bool:
        outcome = check_program(candidate, forms, backend=backend, sizes=sizes)
        return not outcome.generator_error and bool(outcome.kinds() & kinds)

    return predicate


__all__ = ["Failure", "Outcome", "batch_sizes", "check_model", "check_program", "fails_like",
           "reproducer_source", "shrink"]
