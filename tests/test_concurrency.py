"""Concurrency: a compiled callable used from several threads at once.

Each signature is compiled once (``cfn.stats.compiles``), and every thread gets correct results, correct
gradients and its complete effect log.  The effect ops here log ``(thread id, label, fingerprint)`` to one
shared list, so each thread's log can be checked on its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import effectfx as efx

THREAD_LOG: list[tuple[int, str, float]] = []  # list.append is atomic under the GIL


def _fingerprint(x: torch.Tensor) -> float:
    return round(float(x.detach().double().sum()), 4)


@torch.library.custom_op("efxfuzz::thread_log", mutates_args=())
def thread_log(x: torch.Tensor, label: str) -> None:
    THREAD_LOG.append((threading.get_ident(), label, _fingerprint(x)))


thread_log.register_fake(lambda x, label: None)
efx.register_effect(thread_log, key="memory")


@torch.library.custom_op("efxfuzz::thread_note", mutates_args=())
def thread_note(label: str) -> None:
    THREAD_LOG.append((threading.get_ident(), label, 0.0))


thread_note.register_fake(lambda label: None)
efx.register_effect(thread_note, key="stdout")


@torch.library.custom_op("efxfuzz::thread_scale", mutates_args=())
def thread_scale(x: torch.Tensor, s: float) -> torch.Tensor:
    """``x * s``; its backward logs ``(thread, "grad", fingerprint of the incoming gradient)``."""
    return x * s


thread_scale.register_fake(lambda x, s: torch.empty_like(x))


def _thread_scale_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.s = inputs[1]


def _thread_scale_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    torch.ops.efxfuzz.thread_log(grad, f"grad x{ctx.s}")
    return grad * ctx.s, None


thread_scale.register_autograd(_thread_scale_backward, setup_context=_thread_scale_setup)


def _mine(start: int) -> list[tuple[str, float]]:
    me = threading.get_ident()
    return [(label, fp) for tid, label, fp in THREAD_LOG[start:] if tid == me]


# -- the program ---------------------------------------------------------------------------------------------
@efx.region
def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch.ops.efxfuzz.thread_log(x, "block in")
    y = torch.tanh(torch.ops.efxfuzz.thread_scale(x * w, 2.0))
    torch.ops.efxfuzz.thread_note("block out")
    return y


def program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = block(x, w)
    torch.ops.efxfuzz.thread_log(x, "root")
    return x.sum(-1)


def _eager(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, list]:
    """Outputs, gradient w.r.t. x (if it requires grad) and the effect log of one eager call."""
    start = len(THREAD_LOG)
    out = program(x, w)
    grad = None
    if out.requires_grad:
        (grad,) = torch.autograd.grad(out.sum(), [x])
    log = _mine(start)
    del THREAD_LOG[start:]  # single-threaded here: nobody else is logging
    return out.detach(), grad, log


def _inputs(seed: int, shape: tuple[int, ...], requires_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).requires_grad_(requires_grad)
    return x, torch.randn(shape[-1:], generator=g)


SIGNATURES = [((3, 4), True), ((2, 5), False)]


def _hammer(cfn: Callable[..., Any], threads: int, calls: int) -> list[str]:
    """Run ``cfn`` from ``threads`` threads, ``calls`` calls each (alternating signatures, different values
    per call); return a description of every difference from eager."""
    cases = {}
    for t in range(threads):
        for c in range(calls):
            shape, rg = SIGNATURES[(t + c) % len(SIGNATURES)]
            x, w = _inputs(1000 * t + c, shape, rg)
            cases[t, c] = (x, w, *_eager(x, w))
    barrier = threading.Barrier(threads)

    def worker(t: int) -> list[str]:
        problems = []
        barrier.wait()  # every thread makes its first call at the same time: all race to compile
        for c in range(calls):
            x, w, expected, expected_grad, expected_log = cases[t, c]
            start = len(THREAD_LOG)
            out = cfn(x, w)
            grad = None
            if out.requires_grad:
                (grad,) = torch.autograd.grad(out.sum(), [x])
            log = _mine(start)
            if not torch.allclose(out, expected):
                problems.append(f"thread {t} call {c}: outputs differ")
            if (grad is None) != (expected_grad is None) or (
                grad is not None and not torch.allclose(grad, expected_grad)
            ):
                problems.append(f"thread {t} call {c}: gradients differ")
            if log != expected_log:
                problems.append(f"thread {t} call {c}: effect log\n  eager: {expected_log}\n  got:   {log}")
        return problems

    with ThreadPoolExecutor(max_workers=threads) as pool:
        results = list(pool.map(worker, range(threads)))
    return [p for problems in results for p in problems]


def test_eager_log_is_complete() -> None:
    x, w = _inputs(0, (3, 4), True)
    _, grad, log = _eager(x, w)
    assert grad is not None
    assert [label for label, _ in log] == ["block in", "block out"] * 3 + ["root"] + ["grad x2.0"] * 3


def test_compiled_callable_from_many_threads() -> None:
    cfn = efx.compile(program)
    problems = _hammer(cfn, threads=4, calls=10)
    assert not problems, "\n".join(problems)
    assert cfn.stats.compiles == len(SIGNATURES)  # each signature compiled exactly once
    assert cfn.stats.calls == 40
    assert len(cfn.cache) == len(SIGNATURES)


def test_compiled_module_from_many_threads() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4) / 2)

        @efx.region
        def layer(self, x: torch.Tensor) -> torch.Tensor:
            torch.ops.efxfuzz.thread_log(x, "layer")
            return torch.ops.efxfuzz.thread_scale(torch.tanh(x @ self.w), 0.5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(self.layer(x))

    net = Net()
    cfn = efx.compile(net)
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(40)]
    expected = {}
    for i, x in enumerate(xs):
        start = len(THREAD_LOG)
        out = net(x)
        (gw,) = torch.autograd.grad(out.sum(), [net.w])
        expected[i] = (out.detach(), gw, _mine(start))
        del THREAD_LOG[start:]
    barrier = threading.Barrier(4)

    def worker(t: int) -> list[str]:
        barrier.wait()
        problems = []
        for i in range(t, len(xs), 4):
            start = len(THREAD_LOG)
            out = cfn(xs[i])
            (gw,) = torch.autograd.grad(out.sum(), [net.w])
            want_out, want_gw, want_log = expected[i]
            if not (torch.allclose(out, want_out) and torch.allclose(gw, want_gw)):
                problems.append(f"input {i}: outputs or gradients differ")
            if _mine(start) != want_log:
                problems.append(f"input {i}: effect log\n  eager: {want_log}\n  got:   {_mine(start)}")
        return problems

    with ThreadPoolExecutor(max_workers=4) as pool:
        problems = [p for ps in pool.map(worker, range(4)) for p in ps]
    assert not problems, "\n".join(problems)
    assert cfn.stats.compiles == 1


def test_concurrent_captures_of_shared_regions() -> None:
    """Many threads capturing (not compiling) programs that share one region: every Program is right and
    the region's known effects hold one consistent set per cache key."""
    barrier = threading.Barrier(4)

    def worker(t: int) -> list[str]:
        barrier.wait()
        problems = []
        for c in range(3):
            shape, rg = SIGNATURES[(t + c) % len(SIGNATURES)]
            x, w = _inputs(77 * t + c, shape, rg)
            prog = efx.capture(program, x, w)
            start = len(THREAD_LOG)
            out = prog(x, w)
            log = _mine(start)
            start = len(THREAD_LOG)
            want = program(x.detach(), w)  # eager, no backward: the forward log only
            want_log = _mine(start)
            if not torch.allclose(out, want):
                problems.append(f"thread {t} capture {c}: outputs differ")
            if log != want_log:
                problems.append(f"thread {t} capture {c}: effect log\n  eager: {want_log}\n  got:   {log}")
        return problems

    with ThreadPoolExecutor(max_workers=4) as pool:
        problems = [p for ps in pool.map(worker, range(4)) for p in ps]
    assert not problems, "\n".join(problems)
    known = block.__effectfx_region__.known_effects
    assert known and all(keys <= {"memory", "stdout"} for keys in known.values())


@pytest.mark.parametrize("threads", [2, 8])
def test_first_call_race_compiles_once(threads: int) -> None:
    cfn = efx.compile(program)
    problems = _hammer(cfn, threads=threads, calls=2)
    assert not problems, "\n".join(problems)
    assert cfn.stats.compiles == len(SIGNATURES)


def test_grad_mode_is_per_thread() -> None:
    """Grad mode is thread-local: threads calling under ``torch.no_grad()`` and threads calling with grad use
    two signatures, each compiled once, and each thread gets what eager gives it."""
    cfn = efx.compile(program)
    x, w = _inputs(5, (3, 4), True)
    _, want_grad, want_log = _eager(x, w)
    with torch.no_grad():
        want_nograd_log = _eager(x, w)[2]
    barrier = threading.Barrier(4)

    def worker(t: int) -> list[str]:
        barrier.wait()
        problems = []
        for c in range(5):
            start = len(THREAD_LOG)
            if t % 2:
                with torch.no_grad():
                    out = cfn(x, w)
                if out.requires_grad or _mine(start) != want_nograd_log:
                    problems.append(f"thread {t} call {c} (no_grad): {out.requires_grad} {_mine(start)}")
            else:
                (grad,) = torch.autograd.grad(cfn(x, w).sum(), [x])
                if not torch.allclose(grad, want_grad) or _mine(start) != want_log:
                    problems.append(f"thread {t} call {c}: {_mine(start)}")
        return problems

    with ThreadPoolExecutor(max_workers=4) as pool:
        problems = [p for ps in pool.map(worker, range(4)) for p in ps]
    assert not problems, "\n".join(problems)
    assert cfn.stats.compiles == 2
