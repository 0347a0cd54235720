"""Symbolic sizes behave as Python ints wherever the captured code asks (Note [Symbolic shapes]):
``isinstance`` holds without a guard (``effectfx.interposers.sym_numbers``), size arithmetic given to tensor
ops stays symbolic (``graph.symbols``: ``/``, ``math.floor``, ``math.ceil``, ``round``), and what needs a
value -- ``range``, ``int()``, text, an expression with no node form -- gets it with a guard."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import pytest
import torch
from torch.fx.experimental.symbolic_shapes import is_concrete_int

import effectfx as efx


def _checks(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    assert isinstance(n, int) and isinstance(x.size(0), int) and isinstance(n, numbers.Integral)
    assert isinstance(n / 2, float) and isinstance(n > 1, bool)
    assert not isinstance(n, (float, bool, str))
    assert type(n) is torch.SymInt or type(n) is int  # (the type itself stays torch's: Dynamo's too)
    return x * n


@pytest.mark.parametrize("dynamic, captures", [(True, 1), (None, 2)])
def test_isinstance_int_holds_for_a_symbolic_size_without_specializing(dynamic: bool | None,
                                                                      captures: int) -> None:
    compiled = efx.compile(_checks, dynamic=dynamic)
    for n in (3, 5, 9, 4):
        x = torch.randn(n, 2)
        torch.testing.assert_close(compiled(x), _checks(x))
    # dynamic=True: one symbolic program for every size; automatic: static first, then one symbolic
    assert compiled.stats.compiles == captures


def test_torch_code_still_sees_a_symbol_and_nothing_stays_changed() -> None:
    seen = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(is_concrete_int(x.shape[0]))  # torch's own isinstance(s, int): the truth
        return x + 1

    efx.compile(f, dynamic=True)(torch.randn(5))
    assert seen == [False]
    for cls in (torch.SymInt, torch.SymFloat, torch.SymBool):  # put back after the capture
        assert "__getattribute__" not in vars(cls)


SYMBOLIC: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "true division": lambda x: x * (x.shape[0] / 2),
    "math.floor": lambda x: x * math.floor(x.shape[0] / 2),
    "math.ceil": lambda x: x[: math.ceil(x.shape[0] / 4)].sum(0) * math.ceil(x.shape[0] / 3),
    "floor of a negative": lambda x: x * math.floor((x.shape[0] - 10) / 4),
    "round, ties to even": lambda x: x * round(x.shape[0] / 2) + round(x.shape[0] / 4),
    "math.trunc": lambda x: x * math.trunc((x.shape[0] - 8) / 3),
    "arange of a ceil": lambda x: torch.arange(math.ceil(x.shape[0] / 4)).sum() + x,
}


@pytest.mark.parametrize("name", list(SYMBOLIC))
def test_size_arithmetic_given_to_tensor_ops_stays_symbolic(name: str) -> None:
    fn = SYMBOLIC[name]
    compiled = efx.compile(fn, dynamic=True)
    for n in (5, 6, 7, 9, 10, 14):
        x = torch.arange(float(n * 2)).reshape(n, 2)
        torch.testing.assert_close(compiled(x), fn(x), msg=f"{name}, size {n}")
    assert compiled.stats.compiles == 1  # no size was pinned


def test_an_expression_with_no_graph_form_is_its_value_with_a_guard() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x * round(x.shape[0] / 3, 2)  # (a decimal round has no node form)

    compiled = efx.compile(f, dynamic=True)
    for n in (5, 7, 5):
        x = torch.randn(n)
        torch.testing.assert_close(compiled(x), f(x))
    assert compiled.stats.compiles == 2


def test_range_over_size_arithmetic_guards_the_value_it_needs() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(x.shape[1:])
        for i in range(math.ceil(x.shape[0] / 4)):
            total = total + x[i]
        return total + torch.arange(math.ceil(x.shape[0] / 4)).sum()

    compiled = efx.compile(f, dynamic=True)
    for n in (5, 7, 9, 8):
        x = torch.randn(n, 3)
        torch.testing.assert_close(compiled(x), f(x))
    assert compiled.stats.compiles == 2  # ceil(n / 4): 2 for 5..8, 3 for 9


def test_text_of_size_arithmetic_prints_as_eager(capsys: pytest.CaptureFixture[str]) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        print(f"{n} rows, {n / 2:.1f} halves, {math.sqrt(n):.3f}")
        return x + 1

    compiled = efx.compile(f, dynamic=True)
    for n in (5, 7):
        compiled(torch.randn(n))
        got = capsys.readouterr().out
        f(torch.randn(n))
        assert got == capsys.readouterr().out == f"{n} rows, {n / 2:.1f} halves, {math.sqrt(n):.3f}\n"


GOLDEN_SIZES = """\
def forward(self, x):
    sym_size_int = torch.ops.aten.sym_size.int(x, 0)
    floordiv = sym_size_int // 2
    view = torch.ops.aten.view.default(x, [floordiv, -1])
    truediv = sym_size_int / 2
    mul = torch.ops.aten.mul.Tensor(view, truediv)
    return (mul,)"""


def _halves(x: torch.Tensor) -> torch.Tensor:
    n = x.size(0)
    assert isinstance(n, int)  # (a symbolic size is an int to the user's code)
    return x.reshape(n // 2, -1) * (n / 2)


def test_golden_size_arithmetic_stays_in_the_graph() -> None:
    """``//`` and ``/`` of a symbolic size are graph nodes, not a baked-in value: one program serves every
    even size, with eager's values."""
    compiled = efx.compile(_halves, dynamic=True)
    for n in (4, 6, 8):
        x = torch.arange(float(n * 3)).reshape(n, 3)
        torch.testing.assert_close(compiled(x), _halves(x))
    assert compiled.stats.compiles == 1
    assert compiled.programs()[-1].code() == GOLDEN_SIZES
