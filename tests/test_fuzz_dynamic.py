"""Generated programs called on other batch sizes (Note [Symbolic shapes]): after its static calls, the
compiled module runs at B+1, B+3, B+2, and so does a module compiled with ``dynamic=True``; every call is
compared with eager's and the captures are counted (``checking.check_model(sizes=...)``; ``effectfx fuzz
--sizes`` runs it on many programs).  A harness that cannot fail proves nothing, so broken compilers are
shown to be caught; the bugs of effectfx's core this found are minimized below (xfail, strict)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings

import effectfx as efx
from effectfx.cli import main as cli_main
from effectfx.testing import effect_ops
from effectfx.testing.checking import (
    DYNAMIC,
    SIZES_CHANGED,
    batch_sizes,
    check_model,
    check_program,
    reproducer_source,
)
from effectfx.testing.generator import programs
from effectfx.testing.program import Body, ProgramSpec, RegionSpec, Stmt, build_source
from effectfx.testing.render import build, render

# left out of the sample: a print of a size pins it (each size is its own capture, as it must: the sample
# counts captures; test_print_of_a_size_under_symbolic_capture below checks what it prints)
PINS_SIZES = ("stats",)
ONE_EACH = {SIZES_CHANGED: 1, DYNAMIC: 1}  # captures for the sizes: the symbolic one, each way

SAMPLE = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SAMPLE
@given(programs(exclude=PINS_SIZES))
def test_generated_programs_match_eager_on_other_batch_sizes(spec: ProgramSpec) -> None:
    note(render(spec))
    outcome = check_program(spec, forms=(), sizes=True)  # (the forms are test_fuzz.py's)
    assert not outcome.failures, outcome.report()
    if spec.refusal() is None:  # (a refused program is refused before any call)
        sizes = len(batch_sizes(spec.batch))
        assert outcome.sized == 2 * sizes + 1, outcome.report()  # both ways, and dynamic=True's first call
        assert outcome.specialized or outcome.captures == ONE_EACH, outcome.report()


@pytest.mark.slow
@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(programs(exclude=PINS_SIZES))
def test_many_generated_programs_on_other_batch_sizes(spec: ProgramSpec) -> None:
    note(render(spec))
    outcome = check_program(spec, sizes=True)  # (every form too)
    assert not outcome.failures, outcome.report()
    assert spec.refusal() is not None or outcome.specialized or outcome.captures == ONE_EACH, outcome.report()


def test_batch_sizes_avoid_one_and_the_programs_own() -> None:
    for b in (2, 3):
        sizes = batch_sizes(b)
        assert len(set(sizes)) == len(sizes) >= 3 and min(sizes) >= 2 and b not in sizes
        assert list(sizes) != sorted(sizes)  # not in order: a guard like s0 < B+3 would show


def test_inputs_of_another_batch_size() -> None:
    spec = _batch_spec()
    src = render(spec)
    (_, default), (_, same) = build(spec), build_source(src, 0)
    assert all(torch.equal(a, b) for a, b in zip(default, same))  # the default is unchanged
    _, resized = build_source(src, 1, batch=5)
    assert [(t.shape, t.requires_grad) for t in resized] == [((5, 4), t.requires_grad) for t in default]
    assert "B, D = 2, 4" in src  # the source itself is the same program


# -- fixed programs -------------------------------------------------------------------------------------
def _batch_spec() -> ProgramSpec:
    """Code over the batch dimension: a region method keeping a running average and a counter, updating its
    argument through a view, running a BatchNorm (training) and pinging its statistics; a function region
    summing over the batch (``colsum``), in a loop, logging its result; a print and a matmul at the root."""
    r0 = RegionSpec("r0", "method", Body(("x0",), (
        Stmt("buffer", "ema", ("x0",)), Stmt("buffer", "count", ()),
        Stmt("mutate", "view", ("x0",), value=2.0), Stmt("bn", "bn", ("x0",), ("v0",)),
        Stmt("bufread", "bnstat", (), (), "r0.4"),
    ), ("v0",)))
    r1 = RegionSpec("r1", "function", Body(("x0",), (
        Stmt("reduce", "colsum", ("x0",), ("v0",)), Stmt("effect", "log_tensor", ("v0",), (), "r1.1"),
    ), ("v0",)))
    forward = Body(("x0", "x1"), (
        Stmt("unary", "half", ("x0",), ("v0",)), Stmt("call", "r0", ("v0",), ("v1",)),
        Stmt("loop", "r1", ("v1",), ("v2",), value=2.0), Stmt("print", "plain", ("v2",), (), "forward.3"),
        Stmt("matmul", "matmul", ("v2",), ("v3",), weight="w0"), Stmt("binary", "add", ("v3", "x1"), ("v4",)),
    ), ("v4",))
    return ProgramSpec(2, 4, ("stdout",), (True, False), (True,), 0, (r0, r1), forward, seed=7)


def test_a_program_over_the_batch_dimension() -> None:
    spec = _batch_spec()
    assert {"bn", "buffer:ema", "mutate:view", "reduce", "loop", "region updates buffers"} <= spec.features()
    outcome = check_program(spec, sizes=True)
    assert not outcome.failures, outcome.report()
    assert outcome.captures == ONE_EACH and not outcome.specialized
    assert outcome.sized == 7 and f"({outcome.sized} on other batch sizes)" in outcome.report()


def test_the_reproducer_with_sizes_is_standalone(tmp_path: Any) -> None:
    text = reproducer_source(_batch_spec(), "a note", sizes=True)
    assert "sizes=(3, 5, 4), sized=sized)" in text and "def sized(variant, batch):" in text
    path = tmp_path / "repro.py"
    path.write_text(text)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(7 on other batch sizes)" in done.stdout


# -- the harness catches what it should ---------------------------------------------------------------------
REAL_COMPILE = efx.compile


class _LosingAtOtherSizes:
    """A deliberately broken ``efx.compile``: a call at another batch size than the first loses its last
    effect."""

    def __init__(self, fn: Any, **kwargs: Any) -> None:
        self.compiled, self.first = REAL_COMPILE(fn, **kwargs), None

    def __call__(self, *args: Any) -> Any:
        out = self.compiled(*args)
        self.first = self.first or args[0].shape[0]
        if args[0].shape[0] != self.first and effect_ops.LOG:
            effect_ops.LOG.pop()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.compiled, name)


def test_a_lost_effect_at_another_size_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _batch_spec()
    monkeypatch.setattr(efx, "compile", _LosingAtOtherSizes)
    outcome = check_program(spec, forms=(), sizes=True)
    assert outcome.kinds() == {f"effect logs differ [{SIZES_CHANGED}]", f"effect logs differ [{DYNAMIC}]"}, \
        outcome.report()
    assert check_program(spec, forms=()).kinds() == frozenset()  # only the calls at other sizes see it


def test_a_capture_per_size_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile that never makes a size symbolic (``dynamic=False`` whatever it is asked) captures once
    per size: a failure, not a specialization (its programs pinned nothing, they are static)."""
    monkeypatch.setattr(efx, "compile", lambda fn, **kw: REAL_COMPILE(fn, **{**kw, "dynamic": False}))
    outcome = check_program(_batch_spec(), forms=(), sizes=True)
    assert outcome.kinds() == {f"captured again for new sizes [{SIZES_CHANGED}]",
                               f"captured again for new sizes [{DYNAMIC}]"}, outcome.report()
    assert outcome.captures == {SIZES_CHANGED: 3, DYNAMIC: 4} and not outcome.specialized


class _BranchOnBatch(torch.nn.Module):
    """Code that branches on the batch size: a capture is only valid on its side of the branch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.log_tensor(x, "in")
        return (x @ self.w) * (2.0 if x.shape[0] > 4 else 3.0)


def test_code_branching_on_a_size_is_a_finding_not_a_failure() -> None:
    def make(variant: int, batch: int = 2) -> tuple[torch.nn.Module, tuple]:
        g = torch.Generator().manual_seed(variant)
        return _BranchOnBatch(), (torch.randn(batch, 4, generator=g, requires_grad=True),)

    outcome = check_model(make, forms=(), sizes=(3, 5, 4), sized=lambda v, b: make(v, b)[1])
    assert not outcome.failures, outcome.report()
    # 3 and 4 share a capture, 5 is on the other side: two captures each way, each one explained
    assert outcome.captures == {SIZES_CHANGED: 2, DYNAMIC: 2}, outcome.report()
    assert len(outcome.specialized) == 2 and all("breaks its shape guards" in s for s in outcome.specialized)


def test_the_fuzz_command_with_sizes(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    argv = ["fuzz", "--programs", "4", "--seed", "2", "--sizes", "--out", str(tmp_path)]
    code = cli_main(argv + [f"--exclude={kind}" for kind in PINS_SIZES])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "other batch sizes  : " in out and "mismatches         : 0" in out
    assert f"capture(s) for the sizes [{DYNAMIC}]" in out and "specialized        : 0" in out


# -- found by ``effectfx fuzz --sizes`` (bugs of effectfx's core, minimized by hand) -----------------------
def test_print_of_a_size_under_symbolic_capture(capsys: pytest.CaptureFixture[str]) -> None:
    """Found by ``effectfx fuzz --sizes``: a print of a size showed the symbol's name ('(s77, s27)').  Text
    made of a size now pins it (a guard): each size prints its own, as eager, and explain says why."""
    def f(x):
        print("shape", tuple(x.shape), f"rows={x.shape[0]}")
        return x * 2

    compiled = efx.compile(f, dynamic=True)
    for rows in (3, 5, 3):
        compiled(torch.randn(rows, 4))
    assert capsys.readouterr().out == "shape (3, 4) rows=3\nshape (5, 4) rows=5\nshape (3, 4) rows=3\n"
    assert compiled.stats.compiles == 2
    assert any("text made of the size" in s for s in efx.explain(compiled).programs[0].specialized)


W = torch.nn.Parameter(torch.randn(4, 4))


@efx.region
def _doubled(x):
    return x * 2


@efx.region
def _no_grad_inside(x):
    with torch.no_grad():
        v = _doubled(x)
    return v @ W


def test_a_region_under_no_grad_inside_a_region_with_symbolic_sizes() -> None:
    """Found by ``effectfx fuzz --sizes``: the first call's result fed only code under no_grad, so no gradient
    reached its region call, whose backward then traced a backward for none of its outputs (and failed)."""
    x = torch.randn(3, 4)
    _no_grad_inside(_no_grad_inside(x)).sum().backward()
    expected, W.grad = W.grad, None
    efx.compile(lambda x: _no_grad_inside(_no_grad_inside(x)), dynamic=True)(x).sum().backward()
    assert torch.allclose(W.grad, expected)
