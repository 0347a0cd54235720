"""Port of PyTorch's control-flow tests to effectfx (torch 2.13 era): test/functorch/test_control_flow.py
(TestControlFlow, TestControlFlowTraced: cond, while_loop, scan), test/higher_order_ops/test_cond.py's
eager cases and test/higher_order_ops/test_with_effects.py's effects inside control flow.

Each upstream test is rewritten the way an effectfx user writes it: ``efx.capture`` (every form in
``FORMS``) and ``efx.compile`` instead of make_fx / torch.compile / torch.export, and the yardstick is eager
PyTorch: outputs, gradients and the effect log (nothing may run at capture).  Upstream graph texts are not
copied; what they show (the branches as subgraphs, the predicate an operand, an effect inside a branch
ordered by a token) is checked on effectfx's graphs.  Where upstream swaps the predicate between calls of
one traced graph, one captured program is run on inputs taking each branch.

Skipped (one line each):
  * dynamic-shape variants (``_dynamic=True``, ``mark_dynamic``) -- effectfx captures static shapes.
  * vmap / functionalization-API cases (``test_cond_vmap_*``, ``test_cond_functionalized_*``) -- torch
    transforms over the HOP, not capture.
  * int / SymInt carries of while_loop (``test_while_loop_with_int_carry``) -- refused: a Python number
    cannot change at run time in a static graph (tested below as a refusal).
  * while_loop and scan autograd (``test_while_loop_autograd_*``, ``test_scan_compile_grad``) -- refused
    under autograd (docs/SUPPORT.md), tested below as refusals.
"""

from __future__ import annotations

import pytest
import torch
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

import effectfx as efx
from effectfx import ops
from effectfx.testing import check_against_eager
from effectfx.testing.differential import FORMS
from effectfx.testing.effect_ops import recording

R = torch.ops.efxtest


def randn(*shape: int, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(requires_grad)


def run_both_branches(fn, inputs: list[tuple]) -> None:
    """One program per form, captured on the first inputs, equals eager on every input (upstream's
    'swap the predicate between calls')."""
    for name, build in FORMS.items():
        prog = build(fn, inputs[0], {})
        for args in inputs:
            with recording() as want_log:
                want = fn(*args)
            with recording() as got_log:
                got = prog(*args)
            torch.testing.assert_close(got, want, msg=name)
            assert got_log == want_log, name


# -- TestControlFlow / test_cond ----------------------------------------------------------------------
def test_cond_traced_not_nested():
    def true_fn(x):
        return x.sin()

    def false_fn(x):
        return x.cos()

    def f(x, y):
        return torch.cond(y, true_fn, false_fn, [x])

    x = randn(4)
    run_both_branches(f, [(x, torch.tensor(False)), (x, torch.tensor(True))])
    prog = efx.capture(f, x, torch.tensor(True), functionalize=False)
    (node,) = [n for n in prog.graph_module.graph.nodes if n.target is ops.cond]
    assert node.args[0].op == "placeholder"  # the predicate is an input, not a constant


def test_cond_nested_traced():
    def true_nested(y):
        return y * y

    def false_nested(y):
        return y + y

    def true_fn(x, pred2):
        z = torch.cond(pred2, true_nested, false_nested, [x])
        return x + z

    def false_fn(x, _):
        return x.cos()

    def f(x, pred, pred2):
        return torch.cond(pred, true_fn, false_fn, [x, pred2])

    x = randn(4)
    # distinct tensors for the two predicates: one tensor passed twice is one input of the capture
    flags = [(a, b) for a in (True, False) for b in (True, False)]
    run_both_branches(f, [(x, torch.tensor(a), torch.tensor(b)) for a, b in flags])


def test_cond_closed_over_variable():
    def f(pred, x):
        return torch.cond(pred, lambda val: x * 2, lambda val: x - 2, (x + 1,))

    x = randn(3)
    run_both_branches(f, [(torch.tensor(True), x), (torch.tensor(False), x)])


def test_cond_branch_class_method():
    class Sub(torch.nn.Module):
        def foo(self, x):
            return x.cos()

        def forward(self, x):
            return self.foo(x)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sub = Sub()

        def forward(self, x):
            return torch.cond(x.sum() <= 2, self.sub.forward, self.bar, (x,))

        def bar(self, x):
            return x.sin()

    m = M()
    check_against_eager(m, randn(3) + 5)
    check_against_eager(m, randn(3) - 5)


def test_cond_autograd_simple():
    def f(x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))

    for sign in (1, -1):
        check_against_eager(f, (sign * randn(4).abs()).requires_grad_(True))


def test_cond_autograd_parameter_in_one_branch():
    lin = torch.nn.Linear(4, 4)

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda x: self.lin(x), lambda x: x * 2, (x,)).sum()

    for sign in (1, -1):
        check_against_eager(M(), (sign * randn(4).abs()).requires_grad_(True))


# -- while_loop -----------------------------------------------------------------------------------------
def test_while_loop_simple():
    def f(i, x):
        return while_loop(lambda i, x: i.sum() < 10, lambda i, x: (i + 1, x.sin()), (i, x))

    x = randn(3, 4)
    run_both_branches(f, [(torch.zeros(1), x), (torch.full((1,), 7.0), x), (torch.full((1,), 20.0), x)])


def test_while_loop_nested_in_cond():
    def f(pred, i, x):
        def loop(i, x):
            return while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (i, x))[1]

        return torch.cond(pred, loop, lambda i, x: x.neg(), (i, x))

    x = randn(3)
    run_both_branches(f, [(torch.tensor(p), torch.tensor(0), x) for p in (True, False)])


def test_while_loop_with_int_carry_is_refused():
    def f(x):
        return while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (0, x))

    with pytest.raises(efx.UnsupportedOperatorError, match="int"):
        efx.capture(f, randn(3))


def test_while_loop_autograd_is_refused():
    def f(x):
        return while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (torch.tensor(0), x))[1]

    with recording() as log, pytest.raises(efx.UnsupportedOperatorError, match="while_loop"):
        efx.capture(f, randn(3, requires_grad=True))
    assert log == []


# -- scan -----------------------------------------------------------------------------------------------
def test_scan_simple_cumsum():
    def add(x, y):
        nxt = x + y
        return nxt, nxt.clone()

    def f(init, xs):
        return scan(add, init, xs)

    check_against_eager(f, torch.zeros(1), torch.arange(5.0).reshape(5, 1))


def test_scan_dim_and_reverse():
    def combine(c, x):
        return c * 0.5 + x, (c + x).clone()

    def f(init, xs):
        return scan(combine, init, xs, dim=1, reverse=True)

    check_against_eager(f, torch.zeros(2, 4), randn(2, 3, 4))


def test_scan_pytree_carry():
    def combine(c, x):
        a, b = c["a"], c["b"]
        return {"a": a + x, "b": b * 2}, (a * x).clone()

    def f(a, b, xs):
        return scan(combine, {"a": a, "b": b}, xs)

    check_against_eager(f, torch.zeros(3), torch.ones(2), randn(4, 3))


def test_scan_autograd_is_refused():
    def f(init, xs):
        return scan(lambda c, x: (c + x, c.clone()), init, xs)

    with pytest.raises(efx.UnsupportedOperatorError, match="scan"):
        efx.capture(f, torch.zeros(3, requires_grad=True), randn(4, 3))


# -- test_with_effects: effects inside control flow ---------------------------------------------------
def test_effects_in_cond_branches():
    """An effect op inside each branch: only the taken branch's runs, ordered with the effects around it."""

    def f(x):
        R.record_memory("pre")
        y = torch.cond(x.sum() > 0, lambda x: R.bump(x, "true"),
                       lambda x: (R.log_tensor(x, "false"), x - 1)[1], (x,))
        R.record_memory("post")
        return y

    run_both_branches(f, [(randn(3).abs(),), (-randn(3).abs(),)])


def test_print_in_cond_branch(capfd):
    """torch's ordered aten::_print inside a branch prints at run time only, when the branch runs."""

    def f(x):
        def yes(x):
            torch.ops.aten._print("yes branch")
            return x + 1

        return torch.cond(x.sum() > 0, yes, lambda x: x - 1, (x,))

    import ctypes

    def out():
        ctypes.CDLL(None).fflush(None)
        return capfd.readouterr().out

    x = randn(3).abs()
    out()
    prog = efx.remove_effect_tokens(efx.capture(f, x))
    assert out() == ""
    prog(x)
    assert out() == "yes branch\n"
    prog(-x)
    assert out() == ""
