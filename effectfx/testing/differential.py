"""Differential checks: run a program in eager and through effectfx, compare outputs, grads and effects.

``FORMS`` maps a form's name to a function building a callable from ``(fn, args, kwargs)``; passes that
add forms (unlifted, token-free, ...) register themselves here, so every differential test and the fuzzer
cover them automatically.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

import effectfx as efx

from .effect_ops import recording

Builder = Callable[[Callable[..., Any], tuple, dict], Callable[..., Any]]

FORMS: dict[str, Builder] = {
    "captured": lambda fn, a, k: efx.capture(fn, *a, functionalize=False, **k),
    "functionalized": lambda fn, a, k: efx.capture(fn, *a, **k),
    "unlifted": lambda fn, a, k: efx.unlift_tokens(efx.capture(fn, *a, **k)),
    "token-free": lambda fn, a, k: efx.remove_effect_tokens(efx.capture(fn, *a, **k)),
}


class EagerMismatch(AssertionError):
    """effectfx disagreed with eager PyTorch."""


@dataclass
class RunResult:
    outputs: list[Any]
    grads: list[torch.Tensor | None]
    log: list[tuple]
    capture_log: list[tuple]
    after: list[torch.Tensor] = field(default_factory=list)  # the arguments, then the state, after the call


def _grad_outputs(t: torch.Tensor, i: int) -> torch.Tensor:
    # deterministic and asymmetric, so swapped or summed gradients do not cancel out
    n = max(t.numel(), 1)
    return (torch.arange(n, dtype=t.dtype).reshape(t.shape) % 7 - 3 + 0.5 * (i + 1)).to(t.dtype)


def _wrt(fn: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if isinstance(module, torch.nn.Module):
        leaves += [p for p in module.parameters() if p.requires_grad]
    return leaves


def _run(call: Callable[[], Any], wrt: list[torch.Tensor], first_only: bool = False
         ) -> tuple[list[Any], list[Any], list[tuple]]:
    with recording() as log:
        out = call()
        outs = tree_flatten(out)[0]
        diff = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        if first_only:  # the others' formulas must not run (Note [Partial backward])
            diff = diff[:1]
        grads: list[Any] = []
        if diff and wrt:
            grads = list(torch.autograd.grad(diff, wrt, [_grad_outputs(o, i) for i, o in enumerate(diff)],
                                             allow_unused=True))
    return outs, grads, log


def run_eager(fn: Callable[..., Any], args: tuple, kwargs: dict | None = None) -> RunResult:
    kwargs = kwargs or {}
    outs, grads, log = _run(lambda: fn(*args, **kwargs), _wrt(fn, args, kwargs))
    return RunResult(outs, grads, log, [])


def run_program(build: Builder, fn: Callable[..., Any], args: tuple, kwargs: dict | None = None,
                calls: int = 1) -> list[RunResult]:
    kwargs = kwargs or {}
    with recording() as capture_log:
        prog = build(fn, args, kwargs)
    results = []
    for _ in range(calls):
        outs, grads, log = _run(lambda: prog(*args, **kwargs), _wrt(fn, args, kwargs))
        results.append(RunResult(outs, grads, log, list(capture_log)))
        capture_log = []
    return results


def _close(a: Any, b: Any, rtol: float, atol: float) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.requires_grad == b.requires_grad
                and torch.allclose(a.detach(), b.detach(), rtol=rtol, atol=atol, equal_nan=True))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-3)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y, rtol, atol) for x, y in zip(a, b))
    return a == b


def compare(name: str, eager: RunResult, got: RunResult, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    problems = []
    if got.capture_log:
        problems.append(f"capture ran effects: {got.capture_log}")
    if not _close(eager.outputs, got.outputs, rtol, atol):
        problems.append(f"outputs differ:\n  eager: {eager.outputs}\n  {name}: {got.outputs}")
    if len(eager.grads) != len(got.grads) or not all(
        (a is None and (b is None or not b.any())) or (b is None and not a.any()) or _close(a, b, rtol, atol)
        for a, b in zip(eager.grads, got.grads)
        if a is not None or b is not None
    ):
        problems.append(f"gradients differ:\n  eager: {eager.grads}\n  {name}: {got.grads}")
    if not _close(eager.log, got.log, rtol, atol):
        problems.append(f"effect logs differ:\n  eager: {eager.log}\n  {name}: {got.log}")
    if not _close(eager.after, got.after, rtol, atol):
        problems.append(f"arguments or buffers differ after the call:\n  eager: {eager.after}\n"
                        f"  {name}: {got.after}")
    if problems:
        raise EagerMismatch(f"[{name}] " + "\n".join(problems))


def pinned_sizes(compiled: Any, known: set[int], calls: list[tuple[str, tuple]]) -> tuple[list[str], str]:
    """Why ``compiled``'s programs other than ``known`` (by ``id``) cannot serve every one of ``calls``
    ((name, args)) -- a shape guard a call's sizes break, or an op that pinned a size the calls vary in
    (``efx.explain``'s "specialized", the size static in the program's signature): Note [Symbolic shapes];
    and a description of those programs.  A program static in a varying size that names no such op
    explains nothing: it should have made that size a symbol."""
    inputs = [tree_flatten(args)[0] for _, args in calls]
    varying = {(k, d) for k, leaf in enumerate(inputs[0]) if isinstance(leaf, torch.Tensor)
               for d in range(leaf.dim()) if len({leaves[k].shape[d] for leaves in inputs}) > 1}
    reports = efx.explain(compiled).programs  # (in the order of ``programs()``)
    pinned, described = [], []
    for program, report in zip(compiled.programs(), reports):
        if id(program) in known:
            continue
        described.append(f"{report.title}: {report.why}; symbolic {list(report.symbolic)}, "
                         f"guards {list(report.shape_guards)}, specialized {list(report.specialized)}")
        signature = (program.forward if isinstance(program, efx.TrainingProgram) else program).signature
        if any(type(meta.shape[d]) is int for k, meta in signature.tensor_meta for d in range(len(meta.shape))
               if (k, d) in varying):
            pinned += [f"{report.title}: {text}" for text in report.specialized]
        for (name, _), leaves in zip(calls, inputs) if signature.checks is not None else ():
            failed = signature.checks.failed([leaves[k] for k, _ in signature.tensor_meta])
            if failed:
                pinned.append(f"{report.title}: {name} breaks its shape guards "
                              f"({', '.join(signature.guard_text(g) for g in failed)})")
    return pinned, "\n".join(described)


def check_against_eager(fn: Callable[..., Any], *args: Any, forms: tuple[str, ...] | None = None,
                        compile: bool = True, calls: int = 2, **kwargs: Any) -> RunResult:
    """Run ``fn`` in eager, through every form in ``FORMS`` (or ``forms``) and through ``efx.compile``
    (``calls`` times, to exercise the cache); raise :class:`EagerMismatch` on any difference."""
    eager = run_eager(fn, args, kwargs)
    for name in forms if forms is not None else tuple(FORMS):
        for result in run_program(FORMS[name], fn, args, kwargs):
            compare(name, eager, result)
    if compile:
        for i, result in enumerate(run_program(lambda f, a, k: efx.compile(f), fn, args, kwargs, calls)):
            compare(f"compile call {i + 1}", eager, result)
    return eager


# -- code that updates its arguments or state in place (Note [Mutations]) --------------------------------
def state_of(fn: Callable[..., Any]) -> tuple[torch.Tensor, ...]:
    """The buffers of ``fn`` when it is a module (or a module's bound method): the state it may update."""
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    return tuple(module.buffers()) if isinstance(module, torch.nn.Module) else ()


def fresh_args(args: tuple) -> Callable[[], tuple]:
    """A ``make_args`` giving new copies of ``args`` (same values, same ``requires_grad``) on every call, so
    a run that updates its arguments in place leaves the next run's alone."""

    def make() -> tuple:
        return tuple(a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                     for a in args)

    return make


class StartingState:
    """The values ``state`` had when this was made, and the global generator's: each system under
    comparison starts from them (Note [Random numbers])."""

    def __init__(self, state: tuple[torch.Tensor, ...]) -> None:
        self.state = tuple(state)
        self.start = [t.detach().clone() for t in self.state]
        self.rng = torch.get_rng_state()

    def reset(self) -> None:
        torch.set_rng_state(self.rng)
        with torch.no_grad():
            for t, s in zip(self.state, self.start):
                t.copy_(s)

    def unchanged(self) -> bool:
        return all(torch.equal(t, s) for t, s in zip(self.state, self.start))


def run_sequence(call: Callable[..., Any], fn: Callable[..., Any], make_args: Callable[[], tuple],
                 start: StartingState, calls: int = 1, first_only: bool = False) -> list[RunResult]:
    """``call`` on ``calls`` fresh ``make_args()`` in turn, from ``start``'s state; each result holds the
    arguments, the state and the global generator's state after its call (``RunResult.after``).
    Gradients are taken with respect to the arguments and ``fn``'s parameters that require grad, of every
    output that requires grad, or of the first only (``first_only``)."""
    start.reset()
    results = []
    for _ in range(calls):
        args = make_args()
        outs, grads, log = _run(lambda args=args: call(*args), _wrt(fn, args, {}), first_only)
        after = [a.detach().clone() for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
        after += [t.detach().clone() for t in start.state] + [torch.get_rng_state()]
        results.append(RunResult(outs, grads, log, [], after))
    return results


def run_form(name: str, build: Builder, fn: Callable[..., Any], make_args: Callable[[], tuple],
             start: StartingState, calls: int = 1) -> list[RunResult]:
    """Build ``fn`` with ``build`` from ``start``'s state (capturing must run no effect and change neither
    the state nor its example arguments), then :func:`run_sequence` it."""
    start.reset()
    example = make_args()
    before = [a.detach().clone() for a in tree_flatten(example)[0] if isinstance(a, torch.Tensor)]
    with recording() as capture_log:
        prog = build(fn, example, {})
    args_unchanged = all(torch.equal(a, b) for a, b in
                         zip([a for a in tree_flatten(example)[0] if isinstance(a, torch.Tensor)], before))
    if capture_log or not start.unchanged() or not args_unchanged:
        raise EagerMismatch(f"[{name}] capture ran effects ({capture_log}) or changed the state or its "
                            f"arguments")
    return run_sequence(prog, fn, make_args, start, calls)


def check_mutations_against_eager(fn: Callable[..., Any], make_args: Callable[[], tuple],
                                  state: tuple[torch.Tensor, ...] = (), calls: int = 2) -> None:
    """For code that updates its arguments or ``state`` (buffers, tensors it closes over) in place
    (Note [Mutations]): eager, then every form and ``efx.compile``, each from the same starting ``state``
    and fresh ``make_args()``, ``calls`` times; outputs, gradients, effect logs, and the arguments and
    ``state`` after every call must equal eager's.  Capturing must change nothing."""
    start = StartingState(state)
    eager = run_sequence(fn, fn, make_args, start, calls)
    builders: dict[str, Builder] = {**FORMS, "compile": lambda f, a, k: efx.compile(f)}
    for name, build in builders.items():
        for i, (want, got) in enumerate(zip(eager, run_form(name, build, fn, make_args, start, calls))):
            compare(f"{name} call {i + 1}", want, got)
    start.reset()
