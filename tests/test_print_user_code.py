"""``print`` in captured code prints what eager prints: under the print options the program
sets (``torch.set_printoptions``, ``printoptions(...)``) or sets outside between calls, under
``torch.func`` transforms (``vmap``, ``grad``, ``jvp``: eager shows ``BatchedTensor(...)`` and
``GradTrackingTensor(...)``), and under selective activation checkpointing, whose recompute prints again in
backward.

Each differential test runs eager and then every form of ``FORMS``, ``efx.compile`` and a saved and loaded
program, two calls each, every call from the same print options, and compares what was printed in forward
and in backward (stdout, interleaved with an effect op that prints), the outputs, the gradients and the
print options the call leaves behind; capture prints nothing and changes no print option.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functionalize, grad, jvp, vmap
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import effectfx as efx
from effectfx.testing import check_against_eager
from effectfx.testing.differential import FORMS

pytestmark = pytest.mark.filterwarnings("error::effectfx.UnfaithfulPrintWarning")  # exact, or it says so
_SOURCE = Path(__file__).read_text().splitlines()
printoptions = torch._tensor_str.printoptions
get_printoptions = torch._tensor_str.get_printoptions


def line_of(marker: str) -> str:
    """``test_print_user_code.py:<line>`` of the line ending in ``# <- marker``."""
    (lineno,) = [i + 1 for i, line in enumerate(_SOURCE) if line.rstrip().endswith(f"# <- {marker}")]
    return f"{Path(__file__).name}:{lineno}"


@torch.library.custom_op("efxprinttest::mark", mutates_args=())
def mark(label: str) -> None:
    print(f"<{label}>")  # at run time: interleaved with the program's prints in stdout


mark.register_fake(lambda label: None)
efx.register_effect(mark, key="memory")  # another key than print's: order across keys is kept too


@pytest.fixture(autouse=True)
def default_printoptions():
    torch.set_printoptions(profile="default")
    yield
    torch.set_printoptions(profile="default")


def inputs(*shape: int, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(requires_grad)


def _call(capsys: pytest.CaptureFixture, call: Callable, args: tuple, outside: dict) -> tuple:
    """(outputs, gradients, forward's text, options after it, backward's text, options after it)."""
    torch.set_printoptions(profile="default")
    torch.set_printoptions(**outside)
    outs = [o for o in tree_flatten(call(*args))[0] if isinstance(o, torch.Tensor)]
    forward, after_forward = capsys.readouterr().out, get_printoptions()
    diff = [o for o in outs if o.requires_grad]
    wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = list(torch.autograd.grad([o.sum() for o in diff], wrt)) if diff and wrt else []
    return outs, grads, forward, after_forward, capsys.readouterr().out, get_printoptions()


def _saved(fn: Callable, args: tuple, tmp_path: Path) -> Callable:
    efx.remove_effect_tokens(efx.capture(fn, *args)).save(tmp_path / "p.zip")
    return efx.load(tmp_path / "p.zip")


def check_text(capsys: pytest.CaptureFixture, fn: Callable, make_args: Callable[[], tuple],
               outside: tuple[dict, ...] = ({}, {}, {}), tmp_path: Path | None = None) -> list[str]:
    """Eager's calls (call i after setting the options ``outside[i]`` outside it; the third runs a graph's
    generated code) against every form, efx.compile and (with ``tmp_path``) a saved and loaded program:
    the text printed in forward and in backward, outputs, gradients and the print options left after
    forward and after backward.  Returns eager's forward texts."""
    capsys.readouterr()

    def calls(call: Callable) -> list[tuple]:
        return [_call(capsys, call, make_args(), options) for options in outside]

    eager = calls(fn)
    builders = dict(FORMS)
    if tmp_path is not None:
        builders["saved and loaded"] = lambda f, args, kwargs: _saved(f, args, tmp_path)
    runs = {}
    for name, build in builders.items():
        torch.set_printoptions(profile="default")
        torch.set_printoptions(**outside[0])
        before = get_printoptions()
        prog = build(fn, make_args(), {})
        assert capsys.readouterr().out == "", f"[{name}] capture printed"
        assert get_printoptions() == before, f"[{name}] capture changed the print options"
        runs[name] = calls(prog)
    runs["compile"] = calls(efx.compile(fn))
    for name, got in runs.items():
        for i, (e, g) in enumerate(zip(eager, got)):
            where = f"[{name}, call {i + 1}]"
            assert g[2] == e[2], f"{where} printed\n{g[2]}\neager printed\n{e[2]}"
            assert g[4] == e[4], f"{where} printed in backward\n{g[4]}\neager printed\n{e[4]}"
            left = (g[3], g[5])
            assert left == (e[3], e[5]), f"{where} left the options {left}; eager {e[3]}, {e[5]}"
            assert len(g[0]) == len(e[0]) and all(torch.allclose(a, b) for a, b in zip(g[0], e[0])), where
            assert len(g[1]) == len(e[1]) and all(torch.allclose(a, b) for a, b in zip(g[1], e[1])), where
    return [e[2] for e in eager]


# -- (a) print options set by the program ------------------------------------------------------------------
@efx.region
def shown_short(x):
    torch.set_printoptions(precision=1, linewidth=40)
    y = x * 3
    print("region", y)  # grad_fn=<MulBackward0> wraps at the run-time linewidth, as in eager
    return y


def sets_options(x):
    print("default", x)
    torch.set_printoptions(precision=2)
    mark("after set")
    print("precision 2", x.sin(), [x.sum()])
    y = shown_short(x) + shown_short(x * 2)
    print("after region", y)
    torch.set_printoptions(profile="full", threshold=math.inf, sci_mode=True)
    print("full", y.exp())
    return y.sum()  # the options stay as set: eager leaves them so after the call


def test_set_printoptions_inside_prints_as_eager_and_leaves_the_options_as_eager(
        capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    texts = check_text(capsys, sets_options, lambda: (inputs(9, requires_grad=True),), tmp_path=tmp_path)
    assert "tensor([ 1.00, -0.29" in texts[0] and "1.0549e+06" in texts[0] and texts[0].count("region") == 3


def test_grad_fn_after_a_wrapped_dtype_at_the_linewidth_set_inside(capsys: pytest.CaptureFixture) -> None:
    def f(x):
        torch.set_printoptions(linewidth=50)
        print(x * 2)  # dtype= wraps onto a line of its own, and grad_fn= fits after it there
        return x

    make = lambda: (inputs(3).double().requires_grad_(),)  # noqa: E731
    texts = check_text(capsys, f, make)
    assert "\n       dtype=torch.float64" in texts[0]


def test_set_printoptions_inside_a_region_body_shared_by_calls(capsys: pytest.CaptureFixture) -> None:
    def f(x):
        return shown_short(shown_short(x)) + 1

    check_text(capsys, f, lambda: (inputs(6),), outside=({}, {"precision": 6, "linewidth": 120}, {}))


def reads_context(x):
    print("outside", x)
    with printoptions(precision=1):
        mark("inside")
        print("inside", x * 2)
        with printoptions(sci_mode=True):
            print("nested", x)
    print("restored", x)  # the options of the call's caller, whatever they are at run time
    return x + 1


def test_printoptions_context_restores_the_run_time_options(capsys: pytest.CaptureFixture) -> None:
    """The options set outside, between calls, are the ones the prints outside the context show and the ones
    its exit restores -- at run time, not those of the capture."""
    texts = check_text(capsys, reads_context, lambda: (inputs(4),),
                       outside=({}, {"precision": 6, "linewidth": 30}, {"sci_mode": True}))
    assert texts[0].count("\n") < texts[1].count("\n")  # the second call's outside lines wrap


def test_printoptions_context_under_checkpoint_recompute(capsys: pytest.CaptureFixture) -> None:
    def f(x):
        return checkpoint(reads_context, x, use_reentrant=False).sin()

    check_text(capsys, f, lambda: (inputs(4, requires_grad=True),), outside=({}, {"precision": 6}, {}))


def test_reading_the_print_options_inside_warns() -> None:
    def reads(x):
        options = get_printoptions()  # <- reads
        print(options["precision"])
        return x + 1

    with pytest.warns(efx.UnfaithfulPrintWarning, match="get_printoptions") as warned:
        efx.capture(reads, torch.randn(2))
    assert line_of("reads") in str(warned[0].message)

    def writes(x):
        torch._tensor_str.PRINT_OPTS.precision = 1  # <- writes
        return x + 1

    with pytest.warns(efx.UnfaithfulPrintWarning, match="PRINT_OPTS.precision = 1") as warned:
        efx.capture(writes, torch.randn(2))
    assert line_of("writes") in str(warned[0].message) and get_printoptions()["precision"] == 4


def test_set_printoptions_with_an_unrecordable_value_is_refused() -> None:
    def sets(x):
        torch.set_printoptions(precision=torch.tensor(2))  # <- badvalue
        return x + 1

    with pytest.raises(efx.UnsupportedOperatorError, match="set_printoptions") as raised:
        efx.capture(sets, torch.randn(2))
    assert line_of("badvalue") in str(raised.value)
    assert get_printoptions()["precision"] == 4


# -- (b), (c) print under torch.func transforms ------------------------------------------------------------
def shows(r):
    y = r.sin()
    print("r", r, "y", y, [y.sum()])
    return y


def test_print_under_vmap(capsys: pytest.CaptureFixture) -> None:
    def f(x):
        return vmap(shows)(x) + vmap(shows, in_dims=1)(x).T + vmap(vmap(shows))(x.unsqueeze(0))[0]

    texts = check_text(capsys, f, lambda: (inputs(3, 3),))
    assert "BatchedTensor(lvl=2, bdim=0, value=\n    BatchedTensor(lvl=1, bdim=0" in texts[0]
    assert "bdim=1" in texts[0]


def test_print_under_vmap_of_tensors_that_require_grad(capsys: pytest.CaptureFixture) -> None:
    texts = check_text(capsys, lambda x: vmap(shows)(x), lambda: (inputs(2, 3, requires_grad=True),))
    assert "grad_fn=<SinBackward0>" in texts[0] and "requires_grad=True" in texts[0]


def test_print_under_grad_and_jvp(capsys: pytest.CaptureFixture) -> None:
    def scalar(r):
        y = r.sin()
        print("r", r, "y", y, f"{y.sum():.3f}", f"{y.sum()}")  # grad's 0-dim tensors format as numbers
        return y.sum()

    def f(x):
        g = grad(scalar)(x)
        t = jvp(shows, (x,), (torch.ones_like(x),))[1]
        batched = vmap(grad(lambda r: shows(r).sum()))(x.expand(2, 3))
        return g + t + batched.sum(0) + grad(lambda v: vmap(shows)(v).sum())(x.expand(2, 3)).sum(0)

    texts = check_text(capsys, f, lambda: (inputs(3),))
    grad_line = "r GradTrackingTensor(lvl=1, value=\n    tensor([ 1.5410"
    assert grad_line in texts[0] and " -0.110 -0.110" in texts[0]
    assert "GradTrackingTensor(lvl=2, value=\n    BatchedTensor(lvl=1, bdim=0" in texts[0]  # vmap(grad)
    assert "BatchedTensor(lvl=2, bdim=0, value=\n    GradTrackingTensor(lvl=1" in texts[0]  # grad(vmap)


def test_print_under_functionalize(capsys: pytest.CaptureFixture) -> None:
    def updates(t):
        y = t.clone()
        y.add_(1)
        y[0].mul_(3)
        print("y", y, y[1])
        return y

    texts = check_text(capsys, lambda x: functionalize(updates)(x), lambda: (inputs(2, 3),))
    assert texts[0].startswith("y FunctionalTensor(lvl=1, value=\\\ntensor([[")


def test_print_of_a_forward_ad_dual_tensor_warns() -> None:
    def dual(x):
        with fwAD.dual_level():
            y = fwAD.make_dual(x, torch.ones_like(x)).sin()
            print(y)  # <- dual
            return fwAD.unpack_dual(y).tangent

    with pytest.warns(efx.UnfaithfulPrintWarning, match="tangent=") as warned:
        efx.capture(dual, torch.randn(3))
    assert line_of("dual") in str(warned[0].message)


def test_formatting_a_batched_number_fails_as_in_eager() -> None:
    def f(x):
        return vmap(lambda r: print(f"{r.sum():.2f}") or r)(x)

    with pytest.raises(RuntimeError, match="vmap: It looks like you're"):
        f(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="vmap: It looks like you're"):
        efx.capture(f, torch.randn(2, 3))


# -- (d) selective activation checkpointing ----------------------------------------------------------------
_W = inputs(3, 3, seed=1, requires_grad=True)


def _save_all(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


def _recompute_sin(ctx, op, *args, **kwargs):
    recompute = op is torch.ops.aten.sin.default
    return CheckpointPolicy.PREFER_RECOMPUTE if recompute else CheckpointPolicy.PREFER_SAVE


def checkpointed(x):
    mark("body")
    print("body", x.sum())
    y = torch.mm(x, _W).sin()
    print("y", y)
    return y


@pytest.mark.parametrize("policy", [_save_all, _recompute_sin])
def test_print_under_selective_checkpoint_prints_again_in_backward(
        capsys: pytest.CaptureFixture, policy: Callable) -> None:
    context = functools.partial(create_selective_checkpoint_contexts, policy)

    def f(x):
        mark("before")
        y = checkpoint(checkpointed, x, use_reentrant=False, context_fn=context)
        print("after", y.sum())
        return y.cos()

    @efx.region
    def block(x):
        return checkpoint(checkpointed, x, use_reentrant=False, context_fn=context)

    check_text(capsys, f, lambda: (inputs(3, 3, requires_grad=True),))
    check_text(capsys, lambda x: block(block(x)), lambda: (inputs(3, 3, requires_grad=True),))
    check_against_eager(f, inputs(3, 3, requires_grad=True))
    capsys.readouterr()
    f(inputs(3, 3, requires_grad=True)).sum().backward()
    assert capsys.readouterr().out.count("body tensor") == 2  # once in forward, once in the recompute


# -- (b) a program called under vmap -----------------------------------------------------------------------
def test_print_in_a_program_called_under_vmap(capsys: pytest.CaptureFixture) -> None:
    def f(x, y):
        print("x", x, "y", y, [x * y])
        return x * y

    x, y = inputs(2, 4, 3), inputs(3, seed=1)
    compiled, captured = efx.compile(f), efx.capture(f, x[0, 0], y)
    once = functools.partial(vmap, in_dims=(0, None))
    for outer in (lambda g: vmap(once(g), in_dims=(0, None)), lambda g: vmap(once(g), in_dims=(1, None))):
        capsys.readouterr()
        expected = outer(f)(x, y)
        eager = capsys.readouterr().out
        assert "BatchedTensor(lvl=2, bdim=0, value=\n    BatchedTensor(lvl=1, bdim=" in eager
        for program in (compiled, captured, compiled, compiled):
            assert torch.equal(outer(program)(x, y), expected)
            assert capsys.readouterr().out == eager
