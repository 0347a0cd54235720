"""Port of PyTorch's test/higher_order_ops/test_print.py to effectfx (torch 2.13 era).

The subject is the print HOP, ``torch._higher_order_ops.print(format_str, *args, **kwargs)``: an ordered
effect that formats its arguments at run time.  Each test runs the function in eager and through every
form in ``FORMS`` and ``efx.compile`` (make_fx, aot_export_module and torch.compile upstream) and compares
what was printed (the effect log: same lines, same values, same order), the outputs and, where upstream
runs backward, the gradients; capture must print nothing.  Upstream's graph texts become checks of what
they show: the prints are effects on the ``"ordered"`` key, chained by one token, in forward only.

A higher-order op may be supported (then every check above applies) or refused with a named
``efx.EffectfxError`` by every form and by ``efx.compile`` before anything printed; a raw torch exception is
neither.  effectfx captures the print HOP as Python ``print`` (one ``effectfx::print`` node on ``"ordered"``,
``effectfx.hops.print_hop``), so the comparisons with eager apply.  effectfx's static shapes turn upstream's
"new input shape" runs into a second signature.

The Inductor-named tests port their observable part (values and the printed lines, in order) and run with
``backend="eager"``; their ``backend="inductor"`` variants run only with ``-m slow`` (a cold Inductor
compile takes ~20 s on this machine).

Skipped (one line each):
  * test_print_gen_schema -- the HOP's FunctionSchema generator is torch API with no effectfx meaning.
  * test_inductor_python_wrapper_uses_python_print -- inspects Inductor's generated wrapper code.
  * test_inductor_fusion_same_with_and_without_print, test_inductor_fusion_complex_pattern -- compare
    Inductor's fused kernel names with and without prints.
  * TestHopPrintDTensor (8 tests) -- need a 4-rank process group (DTensor, with_comms).
  * TestHopPrintBackward (8 tests) -- ``print_backward=`` is not in torch 2.13's print HOP.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import effectfx as efx
from effectfx import ops
from effectfx.testing.differential import FORMS

hop_print = torch._higher_order_ops.print


# -- helpers -----------------------------------------------------------------------------------------------
def randn(*shape: int, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(requires_grad)


def assert_same(a, b, what: str) -> None:
    la, lb = tree_flatten(a)[0], tree_flatten(b)[0]
    assert len(la) == len(lb), f"{what}: {a} vs {b}"
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            torch.testing.assert_close(x, y, msg=what)
        else:
            assert x == y, f"{what}: {x} vs {y}"


def printed(capsys) -> str:
    return capsys.readouterr().out


def _run(capsys, fn, args) -> tuple:
    out = fn(*args)
    forward = printed(capsys)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    diff = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = list(torch.autograd.grad(sum(o.sum() for o in diff), leaves)) if diff and leaves else []
    return out, forward, printed(capsys), grads


def _refused(capsys, fn, make_args) -> bool:
    """True if the first form refuses ``fn`` with a named error; then every form and efx.compile must
    refuse it too, printing nothing.  Raw torch exceptions propagate."""
    try:
        FORMS["captured"](fn, make_args(), {})
    except efx.EffectfxError:
        pass
    else:
        return False
    for build in FORMS.values():
        with pytest.raises(efx.EffectfxError):
            build(fn, make_args(), {})
    with pytest.raises(efx.EffectfxError):
        efx.compile(fn)(*make_args())
    assert printed(capsys) == "", "printed before refusing"
    return True


def check_prints(capsys, fn, make_args, backend: str = "eager") -> str:
    """Eager vs every form and two calls of efx.compile: the same lines printed in forward (none in
    backward), the same outputs and gradients; capture prints nothing.  Returns eager's forward text
    (also when effectfx refuses ``fn`` with a named error, which is checked instead)."""
    printed(capsys)
    ref = _run(capsys, fn, make_args())
    if _refused(capsys, fn, make_args):
        return ref[1]
    runs = []
    for name, build in FORMS.items():
        args = make_args()
        prog = build(fn, args, {})
        assert printed(capsys) == "", f"[{name}] capture printed"
        runs.append((name, _run(capsys, prog, args)))
    cfn = efx.compile(fn, backend=backend)
    runs += [(f"compile {i}", _run(capsys, cfn, make_args())) for i in range(2)]
    for name, (out, forward, backward, grads) in runs:
        assert forward == ref[1], f"[{name}] printed {forward!r}, eager {ref[1]!r}"
        assert backward == ref[2], f"[{name}] printed in backward {backward!r}, eager {ref[2]!r}"
        assert_same(out, ref[0], f"[{name}] outputs")
        assert_same(grads, ref[3], f"[{name}] gradients")
    return ref[1]


def effect_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.with_effects]


def check_print_graph(capsys, fn, *args, prints: int) -> None:
    """What upstream's aot_export_module graph shows: ``prints`` prints, each an effect on "ordered",
    chained by one token from the graph's input to its output (unless effectfx refuses the print HOP)."""
    if _refused(capsys, fn, lambda: args):
        return
    prog = efx.capture(fn, *args)
    prog = getattr(prog, "forward", prog)
    assert prog.token_keys == ("ordered",)
    chain = effect_nodes(prog.graph_module)
    assert len(chain) == prints
    for before, after in zip(chain, chain[1:]):
        assert after.args[0].args == (before, 0), "each print takes the token the previous one returned"


# -- TestHopPrint ------------------------------------------------------------------------------------------
def test_base_print(capsys):
    def f(x):
        x = x + x
        hop_print("moo")
        x = x * x
        hop_print("moo")
        return x

    assert check_prints(capsys, f, lambda: (randn(3, 3),)) == "moo\nmoo\n"


def _args_kwargs(x):
    x = x + x
    hop_print("moo kwargs {x} {y}", x=1, y=2)
    hop_print("moo args {} {}", 1, 2)
    hop_print("moo mixed {} {y}", 1, y=2)
    x = x * x
    return x


def test_args_kwargs_print(capsys):
    text = check_prints(capsys, _args_kwargs, lambda: (randn(3, 3),))
    assert text == "moo kwargs 1 2\nmoo args 1 2\nmoo mixed 1 2\n"
    # upstream's make_fx graph on a new input: the captured form, reused on other values
    if not _refused(capsys, _args_kwargs, lambda: (randn(3, 3),)):
        captured = efx.capture(_args_kwargs, randn(3, 3), functionalize=False)
        printed(capsys)
        captured(randn(3, 3, seed=1))
        assert printed(capsys) == text


def test_args_kwargs_with_tensor(capsys):
    def f(x):
        x = x + x
        hop_print("tensor: {t} value: {v}", t=x, v=42)
        hop_print("tensor: {} value: {}", x, 42)
        return x

    x = torch.tensor([1.0, 2.0, 3.0])
    text = check_prints(capsys, f, lambda: (x.clone(),))
    assert text == f"tensor: {x + x} value: 42\ntensor: {x + x} value: 42\n"


class PrintsAroundAdd(nn.Module):
    def forward(self, x):
        hop_print("moo {x} {y}", x=1, y=2)
        hop_print("moo {x}", x=x)
        res = x + x
        hop_print("values: {} {}", 3, 4)
        hop_print("yeehop {x}", x=x.shape[0])
        return (res,)


def test_print_with_proxy_graph(capsys):
    m = PrintsAroundAdd()
    text = check_prints(capsys, m, lambda: (randn(3),))
    new_inp = randn(3, seed=1)  # static shapes: a new input of the captured shape
    assert text == f"moo 1 2\nmoo {randn(3)}\nvalues: 3 4\nyeehop 3\n"
    if not _refused(capsys, m, lambda: (randn(3),)):
        captured = efx.capture(m, randn(3), functionalize=False)  # prints called directly
        assert not effect_nodes(captured.graph_module)
        printed(capsys)
        captured(new_inp)
        assert printed(capsys) == f"moo 1 2\nmoo {new_inp}\nvalues: 3 4\nyeehop 3\n"


class PrintsWithSideEffect(nn.Module):
    def forward(self, x):
        hop_print("moo {x} {y}", x=1, y=2)
        res = x + x
        hop_print("values {} {}", 3, res)
        return (res,)


def test_print_with_side_effect(capsys):
    m = PrintsWithSideEffect()
    check_print_graph(capsys, m, randn(3), prints=2)
    assert check_prints(capsys, m, lambda: (randn(3),)) == f"moo 1 2\nvalues 3 {randn(3) * 2}\n"


def test_print_with_input_mutations(capsys):
    def f(x):
        hop_print("moo {x} {y}", x=x, y=2)
        res = x + x
        x.add_(res)
        res = x + x
        hop_print("moo {x} {y}", x=x, y=res)
        return (res,)

    # the input is written in place (Note [Mutations]): each print shows the value it had at that point
    x = randn(3)
    text = check_prints(capsys, f, lambda: (randn(3),))
    assert text == f"moo {x} 2\nmoo {x * 3} {x * 6}\n"
    for name, build in FORMS.items():
        arg = randn(3)
        build(f, (arg,), {})(arg)
        assert torch.allclose(arg, x * 3), name  # written back as eager's add_ left it
    printed(capsys)


def _reordered(x):
    x1 = x + x
    hop_print("moo kwargs {x}", x=x1)
    x2 = x1 * x1
    hop_print("moo args {}", x2)
    x3 = x2 + x2
    return (x1, x3)


INDUCTOR = pytest.param("inductor", marks=pytest.mark.slow)


@pytest.mark.parametrize("backend", ["eager", INDUCTOR])
def test_reorder_print_no_graph_break(capsys, backend):
    for shape in ((3, 3), (2, 2)):  # the second shape is a second signature (a recompile upstream)
        x = randn(*shape)
        text = check_prints(capsys, _reordered, lambda: (x.clone(),), backend=backend)  # noqa: B023
        assert text == f"moo kwargs {x * 2}\nmoo args {x * 2 * x * 2}\n"


@pytest.mark.parametrize("backend", ["eager", INDUCTOR])
def test_constant_mutation(capsys, backend):
    # upstream's .item() calls only force graph breaks under Dynamo (their values are unused); they are
    # left out, what remains is Python list mutation interleaved with prints of its elements
    def f(x):
        alist = [x]
        alist.append(x + 1)
        hop_print("moo {x}", x=alist[-1])
        res = alist.pop()
        hop_print("moo {x}", x=alist[-1])
        return res

    text = check_prints(capsys, f, lambda: (torch.tensor([1]),), backend=backend)
    assert text == "moo tensor([2])\nmoo tensor([1])\n"


@pytest.mark.parametrize("backend", ["eager", INDUCTOR])
def test_inductor_fusion_with_intermediate_print(capsys, backend):
    def f(a, b, c):
        x = a * b
        hop_print("intermediate x: {}", x)
        y = x + c
        return y**2

    a, b, c = (randn(4, seed=i) for i in range(3))
    text = check_prints(capsys, f, lambda: (a, b, c), backend=backend)
    assert text == f"intermediate x: {a * b}\n"


@pytest.mark.parametrize("backend", ["eager", INDUCTOR])
def test_inductor_multiple_intermediate_prints(capsys, backend):
    def f(a, b, c):
        x = a * b
        hop_print("after mul: {}", x)
        y = x + c
        hop_print("after add: {}", y)
        z = y**2
        hop_print("after pow: {}", z)
        return z

    a, b, c = (randn(4, seed=i) for i in range(3))
    text = check_prints(capsys, f, lambda: (a, b, c), backend=backend)
    x = a * b
    assert text == f"after mul: {x}\nafter add: {x + c}\nafter pow: {(x + c) ** 2}\n"


def test_print_aot_autograd_graph(capsys):
    m = PrintsWithSideEffect()
    text = check_prints(capsys, m, lambda: (randn(3, requires_grad=True),))  # forward prints, backward not
    assert text.startswith("moo 1 2\nvalues 3 tensor(")
    if not _refused(capsys, m, lambda: (randn(3, requires_grad=True),)):
        prog = efx.capture(m, randn(3, requires_grad=True))
        assert len(effect_nodes(prog.forward.graph_module)) == 2 and prog.forward.token_keys == ("ordered",)
        assert effect_nodes(prog.backward.graph_module) == [] and prog.backward.token_keys == ()


def test_print_inductor_graph(capsys):
    # upstream checks the graph Inductor receives: tokens made and sunk inside, i.e. the unlifted form
    m = PrintsWithSideEffect()
    x = randn(3)
    if _refused(capsys, m, lambda: (x,)):
        return
    unlifted = efx.unlift_tokens(efx.capture(m, x))
    gm = unlifted.graph_module
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x"]
    assert len(effect_nodes(gm)) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(ops.make_token) == targets.count(ops.sink_tokens) == 1
    printed(capsys)
    expected = m(x)
    eager = printed(capsys)
    assert_same(unlifted(x), expected, "unlifted")
    assert printed(capsys) == eager
