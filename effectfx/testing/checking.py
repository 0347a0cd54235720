"""Running a generated program against eager PyTorch, and minimizing one that fails (issue 5).

:func:`check_program` runs one :class:`~effectfx.testing.program.ProgramSpec` in eager, through every form
in ``FORMS`` and through ``efx.compile`` (twice on the same inputs, once on new inputs of the same
signature, once after an in-place parameter update) and classifies what went wrong.  Each run gets fresh
copies of the arguments and starts from the same buffers; the arguments and every buffer after every call
are compared with eager's too (``differential.run_sequence``, shared with
``check_mutations_against_eager``).  What the program
prints (Python ``print`` to stdout or stderr) is part of its effect log, in order with the effect ops; a
program effectfx must refuse (:meth:`~effectfx.testing.program.ProgramSpec.refusal`) must be refused by
every form and by ``efx.compile``, before any effect runs.  :func:`shrink` is a deletion-based minimizer
over the description.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from .program import CALL_KINDS, Body, ProgramSpec, Stmt, build_source
from .render import render


@dataclass(frozen=True)
class Failure:
    """One way effectfx disagreed with eager (or refused a supported program)."""

    where: str  # the form, "compile call N", "compile new inputs", "eager"
    kind: str  # "outputs differ", "effect logs differ", ..., "error: CaptureError"
    detail: str

    @property
    def label(self) -> str:
        where = "compile" if self.where.startswith("compile") else self.where
        return f"{self.kind} [{where}]"


@dataclass
class Outcome:
    failures: list[Failure] = field(default_factory=list)
    comparisons: int = 0
    effects_compared: int = 0
    seconds: float = 0.0

    @property
    def generator_error(self) -> bool:
        return any(f.where == "eager" for f in self.failures)

    def kinds(self) -> frozenset[str]:
        return frozenset(f.label for f in self.failures)

    def report(self) -> str:
        if not self.failures:
            return f"ok: {self.comparisons} comparisons, {self.effects_compared} effects compared"
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


def check_model(make: Callable[[int], tuple[torch.nn.Module, tuple]],
                forms: tuple[str, ...] | None = None, calls: int = 2, backend: str = "eager",
                refusal: str | None = None) -> Outcome:
    """Run ``make()``'s model in eager, through every form in ``FORMS`` (``calls`` times each) and through
    ``efx.compile`` (``calls`` times, then once on ``make(1)``'s inputs and once after an in-place update of
    the parameters, neither of which may recompile).  With ``refusal`` (an error class name), every form
    and ``efx.compile`` must raise it instead, having run no effect."""
    outcome = Outcome()
    start = time.perf_counter()
    with _prints_to_log() as caught:
        _check(make, forms or tuple(differential.FORMS), calls, backend, refusal, outcome)
    outcome.failures.extend(Failure("capture", f"warned: {type(w.message).__name__}", str(w.message))
                            for w in caught if isinstance(w.message, efx.EffectfxWarning))
    outcome.seconds = time.perf_counter() - start
    return outcome


def _check(make: Callable[[int], tuple[torch.nn.Module, tuple]], forms: tuple[str, ...], calls: int,
           backend: str, refusal: str | None, outcome: Outcome) -> None:
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
                  backend: str = "eager") -> Outcome:
    src = render(spec)
    return check_model(lambda variant: build_source(src, variant), forms, calls, backend, spec.refusal())


def reproducer_source(spec: ProgramSpec, note: str = "", backend: str = "eager") -> str:
    """A standalone script that rebuilds the program and runs the differential check."""
    comment = "".join(f"# {line}\n" for line in note.splitlines())
    return (
        comment + render(spec)
        + "\n\nif __name__ == \"__main__\":\n"
        "    from effectfx.testing.checking import check_model\n\n"
        f"    outcome = check_model(make, backend={backend!r}, refusal={spec.refusal()!r})\n"
        "    print(outcome.report())\n"
        "    raise SystemExit(1 if outcome.failures else 0)\n"
    )


# -- shrinking ---------------------------------------------------------------------------------------
def _delete_stmt(body: Body, index: int) -> Body:
    """``body`` without statement ``index``; later reads of its outputs read its first argument."""
    gone = body.stmts[index]
    fallback = gone.args[0] if gone.args else body.params[0]
    names = {out: fallback for out in gone.outs}
    stmts = tuple(s.renamed(names) for s in body.stmts[:index] + body.stmts[index + 1:])
    # in-place statements re-read nothing else; returns follow the renaming too
    return Body(body.params, stmts, tuple(names.get(r, r) for r in body.returns))


def _map_bodies(spec: ProgramSpec, fn: Callable[[Body], Body]) -> ProgramSpec:
    return dataclasses.replace(
        spec, forward=fn(spec.forward),
        regions=tuple(dataclasses.replace(r, body=fn(r.body)) for r in spec.regions),
        block_body=fn(spec.block_body) if spec.block_body is not None else None,
    )


def _without_calls(body: Body, pred: Callable[[Stmt], bool]) -> Body:
    while True:
        index = next((i for i, s in enumerate(body.stmts) if pred(s)), None)
        if index is None:
            return body
        body = _delete_stmt(body, index)


def _replace_body(spec: ProgramSpec, where: str, body: Body) -> ProgramSpec:
    if where == "forward":
        return dataclasses.replace(spec, forward=body)
    if where == "step":
        return dataclasses.replace(spec, block_body=body)
    return dataclasses.replace(spec, regions=tuple(
        dataclasses.replace(r, body=body) if r.name == where else r for r in spec.regions))


def _drop_input(spec: ProgramSpec, i: int, instead: int) -> ProgramSpec:
    """``spec`` without input ``x<i>``: reads of it read ``x<instead>``, later inputs move down."""
    names = {f"x{i}": f"x{instead - (instead > i)}"}
    names.update({f"x{k}": f"x{k - 1}" for k in range(i + 1, len(spec.inputs))})
    forward = spec.forward
    stmts = tuple(s.renamed(names) for s in forward.stmts)
    returns = tuple(names.get(r, r) for r in forward.returns)
    return dataclasses.replace(spec, inputs=spec.inputs[:i] + spec.inputs[i + 1:],
                               forward=Body(forward.params[:-1], stmts, returns))


def _simpler_calls(s: Stmt) -> list[Stmt]:
    simpler = []
    if s.kind == "loop" and s.value > 1:
        simpler.append(dataclasses.replace(s, value=s.value - 1))
    if s.kind in ("chain", "loop", "nograd"):
        simpler.append(dataclasses.replace(s, kind="call"))
    if s.s is not None:
        simpler.append(dataclasses.replace(s, s=None))
    return simpler


def _candidates(spec: ProgramSpec) -> Iterator[ProgramSpec]:
    """Simpler variants of ``spec``, the most drastic first."""
    for r in spec.regions:  # drop a whole region (and its calls)
        without = _map_bodies(spec, lambda b, n=r.name: _without_calls(b, lambda s: s.op == n
                                                                        and s.kind in CALL_KINDS))
        yield dataclasses.replace(without, regions=tuple(x for x in without.regions if x.name != r.name))
    for where, body in list(spec.bodies()):
        for i in reversed(range(len(body.stmts))):  # drop one statement
            yield _replace_body(spec, where, _delete_stmt(body, i))
        for i, s in enumerate(body.stmts):  # simpler call shapes
            for new in _simpler_calls(s):
                stmts = body.stmts[:i] + (new,) + body.stmts[i + 1:]
                yield _replace_body(spec, where, dataclasses.replace(body, stmts=stmts))
        if len(body.returns) > 1 and where == "forward":
            for i in range(len(body.returns)):
                yield _replace_body(spec, where, dataclasses.replace(
                    body, returns=body.returns[:i] + body.returns[i + 1:]))
    for i, rg in enumerate(spec.inputs):
        if rg:
            yield dataclasses.replace(spec, inputs=spec.inputs[:i] + (False,) + spec.inputs[i + 1:])
    for i in range(len(spec.inputs)):  # drop an input; reads of it read another input
        for j in range(len(spec.inputs)):
            if j != i:
                yield _drop_input(spec, i, j)
    for i, rg in enumerate(spec.weights):
        if rg:
            yield dataclasses.replace(spec, weights=spec.weights[:i] + (False,) + spec.weights[i + 1:])
    if spec.weights:  # drop the last parameter and the matmuls reading it
        last = f"w{len(spec.weights) - 1}"
        without = _map_bodies(spec, lambda b: _without_calls(b, lambda s: s.weight == last))
        yield dataclasses.replace(without, weights=spec.weights[:-1])
    if spec.constants:
        last = f"C{spec.constants - 1}"
        without = _map_bodies(spec, lambda b: _without_calls(b, lambda s: s.weight == last))
        yield dataclasses.replace(without, constants=spec.constants - 1)
    if spec.blocks:  # drop the sub-modules, or the last one, or a requires_grad
        without = _map_bodies(spec, lambda b: _without_calls(b, lambda s: s.kind == "blocks"))
        yield dataclasses.replace(without, blocks=(), block_body=None)
        if len(spec.blocks) > 1:
            yield dataclasses.replace(spec, blocks=spec.blocks[:-1])
        for i, rg in enumerate(spec.blocks):
            if rg:
                yield dataclasses.replace(spec, blocks=spec.blocks[:i] + (False,) + spec.blocks[i + 1:])
    if spec.batch > 2:
        yield dataclasses.replace(spec, batch=2)


def shrink(spec: ProgramSpec, still_fails: Callable[[ProgramSpec], bool], budget_seconds: float = 120.0,
           max_tries: int = 400) -> ProgramSpec:
    """Greedy deletion-based minimization: keep taking the first simpler variant that still fails."""
    deadline = time.monotonic() + budget_seconds
    tries = 0
    improved = True
    seen: set[str] = set()
    while improved and time.monotonic() < deadline and tries < max_tries:
        improved = False
        for candidate in _candidates(spec):
            if time.monotonic() >= deadline or tries >= max_tries:
                break
            src = render(candidate)
            if src in seen:
                continue
            seen.add(src)
            tries += 1
            try:
                failing = still_fails(candidate)
            except Exception:
                failing = False
            if failing:
                spec, improved = candidate, True
                break
    return spec


def fails_like(kinds: frozenset[str], forms: tuple[str, ...] | None = None,
               backend: str = "eager") -> Callable[[ProgramSpec], bool]:
    """A ``still_fails`` predicate for :func:`shrink`: the candidate fails with one of ``kinds``."""

    def predicate(candidate: ProgramSpec) -> bool:
        outcome = check_program(candidate, forms, backend=backend)
        return not outcome.generator_error and bool(outcome.kinds() & kinds)

    return predicate


__all__ = ["Failure", "Outcome", "check_model", "check_program", "fails_like", "reproducer_source", "shrink"]
