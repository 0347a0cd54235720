# ruff: noqa: E501  (golden graph text has long lines)
"""The print higher-order op in captured code: ``torch._higher_order_ops.print`` is an
ordered effect that prints at run time only, with run-time values, exactly as eager prints.

It is captured as Python ``print`` is (``effectfx.hops.print_hop``, ``effectfx.interposers.python_print``): one
``effectfx::print`` node, a ``with_effects`` on the ``"ordered"`` key once functionalized.  Each differential
test compares what eager printed -- stdout at the file-descriptor level, so ``aten::_print`` (C stdio) is
interleaved in its true order -- with every form of ``FORMS``, two calls of ``efx.compile`` and a saved and
loaded program; capture prints nothing.
"""

from __future__ import annotations

import ctypes
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten

import effectfx as efx
from effectfx import ops
from effectfx.testing.differential import FORMS

hop_print = torch._higher_order_ops.print
_LIBC = ctypes.CDLL(None)


def printed(capfd: pytest.CaptureFixture) -> str:
    """stdout since the last call; aten::_print writes through C stdio, which Python does not flush."""
    sys.stdout.flush()
    _LIBC.fflush(None)
    return capfd.readouterr().out


def _run(capfd: pytest.CaptureFixture, call, args: tuple, params: list) -> tuple[list, str, list, str]:
    """(outputs, forward's stdout, gradients of ``args`` and ``params``, backward's stdout) of
    ``call(*args)``."""
    outs = [o for o in tree_flatten(call(*args))[0] if isinstance(o, torch.Tensor)]
    forward = printed(capfd)
    leaves = [a for a in args if a.requires_grad] + params
    diff = [o for o in outs if o.requires_grad]
    grads = list(torch.autograd.grad([o.sum() for o in diff], leaves)) if diff and leaves else []
    return outs, forward, grads, printed(capfd)


def check_prints(capfd: pytest.CaptureFixture, fn, make_args, tmp_path: Path) -> str:
    """Eager's stdout (forward and backward), outputs and gradients equal those of every form, of two calls
    of efx.compile and of the token-free program saved and loaded; capture prints nothing.  Returns eager's
    forward stdout."""
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    printed(capfd)
    eager = _run(capfd, fn, make_args(), params)
    runs = {}
    for name, build in FORMS.items():
        args = make_args()
        prog = build(fn, args, {})
        assert printed(capfd) == "", f"[{name}] capture printed"
        runs[name] = _run(capfd, prog, args, params)
    compiled = efx.compile(fn)
    for i in (1, 2):
        runs[f"compile call {i}"] = _run(capfd, compiled, make_args(), params)
    assert printed(capfd) == "", "efx.compile printed outside its calls"
    efx.remove_effect_tokens(efx.capture(fn, *make_args())).save(tmp_path / "p.zip")
    loaded = efx.load(tmp_path / "p.zip")
    assert printed(capfd) == "", "capture, save or load printed"
    runs["saved and loaded"] = _run(capfd, loaded, make_args(), [])  # it owns copies of the parameters
    for name, (outs, forward, grads, backward) in runs.items():
        assert forward == eager[1], f"[{name}] printed {forward!r}\neager printed {eager[1]!r}"
        assert backward == eager[3], f"[{name}] printed in backward {backward!r}, eager {eager[3]!r}"
        assert len(outs) == len(eager[0]) and all(torch.allclose(a, b) for a, b in zip(outs, eager[0])), name
        expected = eager[2] if name != "saved and loaded" else eager[2][: len(eager[2]) - len(params)]
        assert len(grads) == len(expected) and all(torch.allclose(a, b) for a, b in zip(grads, expected)), name
    return eager[1]


def inputs(*shape: int, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(requires_grad)


# -- the programs ------------------------------------------------------------------------------------------
@efx.region
def shout(x, tag):
    y = x * 2
    hop_print("shout {} {tag} mean={m:.3f}", y, tag=tag, m=y.mean())
    return y + 1


def root_only(x):
    hop_print("start {x} n={n}", x=x, n=3)
    torch.ops.aten._print("aten print")
    y = x.sin()
    print("python", y)
    hop_print("{!r} then {} and {}", y, y.sum(), [1, "a"])
    return y * 2


def three_calls(x):
    hop_print("before {}", x)
    z = shout(shout(shout(x, "same"), "same"), "same")
    torch.ops.aten._print("between")
    hop_print("after {}", z.sum())
    return z


class Printing(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        hop_print("weight {}", self.lin.weight)
        h = self.lin(x)
        hop_print("h = {h}", h=h)
        return shout(h.tanh(), "train").sum()


# -- golden graph --------------------------------------------------------------------------------------------
GOLDEN = '''
def forward(self, token, x):
    with_effects = effectfx.ops.with_effects(token, torch.ops.effectfx.print.default, 'before {}\\n', [x], ['r'], 1, False)
    getitem = with_effects[0]
    shout_subgraph0 = self.shout_subgraph0
    invoke_subgraph = effectfx.ops.invoke_subgraph(shout_subgraph0, 'subgraph_0', getitem, x)
    getitem_1 = invoke_subgraph[0]
    getitem_2 = invoke_subgraph[1]
    invoke_subgraph_1 = effectfx.ops.invoke_subgraph(shout_subgraph0, 'subgraph_0', getitem_1, getitem_2)
    getitem_3 = invoke_subgraph_1[0]
    getitem_4 = invoke_subgraph_1[1]
    invoke_subgraph_2 = effectfx.ops.invoke_subgraph(shout_subgraph0, 'subgraph_0', getitem_3, getitem_4)
    getitem_5 = invoke_subgraph_2[0]
    getitem_6 = invoke_subgraph_2[1]
    with_effects_1 = effectfx.ops.with_effects(getitem_5, torch.ops.aten._print.default, 'between')
    getitem_7 = with_effects_1[0]
    sum_1 = torch.ops.aten.sum.default(getitem_6)
    with_effects_2 = effectfx.ops.with_effects(getitem_7, torch.ops.effectfx.print.default, 'after {}\\n', [sum_1], ['f:'], 1, False)
    getitem_8 = with_effects_2[0]
    return (getitem_8, getitem_6)

# shout_subgraph0: 'subgraph_0'
def shout_subgraph0(self, token, x):
    mul = torch.ops.aten.mul.Tensor(x, 2)
    mean = torch.ops.aten.mean.default(mul)
    with_effects = effectfx.ops.with_effects(token, torch.ops.effectfx.print.default, 'shout {} same mean={}\\n', [mul, mean], ['r', 'f:.3f'], 1, False)
    getitem = with_effects[0]
    add = torch.ops.aten.add.Tensor(mul, 1)
    return (getitem, add)
'''


def test_print_hop_is_one_ordered_effect_node(capfd: pytest.CaptureFixture) -> None:
    printed(capfd)
    prog = efx.capture(three_calls, inputs(3))
    assert printed(capfd) == ""  # capture prints nothing
    assert prog.code().strip() == textwrap.dedent(GOLDEN).strip()
    assert prog.token_keys == ("ordered",)
    captured = efx.capture(three_calls, inputs(3), functionalize=False)
    targets = [n.target for n in captured.graph_module.graph.nodes if n.op == "call_function"]
    assert torch.ops.higher_order.print not in targets
    assert targets.count(torch.ops.effectfx.print.default) == 2


# -- differential: root, a region called three times, training -------------------------------------------
def test_print_hop_at_the_root(capfd: pytest.CaptureFixture, tmp_path: Path) -> None:
    x = inputs(3)
    text = check_prints(capfd, root_only, lambda: (x.clone(),), tmp_path)
    y = x.sin()
    assert text == (f"start {x} n=3\naten print\npython {y}\n{y!r} then {y.sum()} and [1, 'a']\n")
    # run-time values: the program prints the values it is called with, not the captured ones
    prog = efx.capture(root_only, x)
    printed(capfd)
    root_only(x + 1)
    eager = printed(capfd)
    prog(x + 1)
    assert printed(capfd) == eager


def test_print_hop_in_a_region_called_three_times(capfd: pytest.CaptureFixture, tmp_path: Path) -> None:
    text = check_prints(capfd, three_calls, lambda: (inputs(3),), tmp_path)
    assert text.count("shout tensor(") == 3 and text.index("between") < text.index("after")
    prog = efx.capture(three_calls, inputs(3))
    assert len(prog.bodies) == 1 and prog.bodies[0].calls == 3  # one body serves the three calls


def test_print_hop_in_training(capfd: pytest.CaptureFixture, tmp_path: Path) -> None:
    model = Printing()
    text = check_prints(capfd, model, lambda: (inputs(2, 3, requires_grad=True),), tmp_path)
    assert "weight Parameter containing:\ntensor([[" in text and "requires_grad=True" in text
    assert "h = tensor([[" in text and "grad_fn=<AddmmBackward0>" in text
    assert "shout tensor(" in text and "grad_fn=<MulBackward0>" in text
    prog = efx.capture(model, inputs(2, 3, requires_grad=True))
    assert len([n for n in prog.forward.graph_module.graph.nodes if n.target is ops.with_effects]) == 2
    assert prog.backward.token_keys == ()  # forward prints only, as in eager


def test_print_hop_under_no_grad_of_a_tensor_that_requires_grad(capfd: pytest.CaptureFixture,
                                                                 tmp_path: Path) -> None:
    def fn(x):
        with torch.no_grad():
            y = x * 3
        hop_print("x {} y {}", x, y)
        return (x + y).sum()

    text = check_prints(capfd, fn, lambda: (inputs(3, requires_grad=True),), tmp_path)
    assert text.count("requires_grad=True") == 1
