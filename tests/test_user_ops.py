"""Users' ops at capture: custom ops that write an ``out`` argument, sizes computed from
Python constants, and CompositeImplicitAutograd effect ops whose Python kernel has side effects of its own."""

from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import effectfx as efx
import effectfx.testing.fuzz_ops  # noqa: F401  (registers the efxfuzz:: ops)
from effectfx.testing import check_against_eager
from effectfx.testing.differential import check_mutations_against_eager, fresh_args

_SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> str:
    """``test_user_ops.py:<line>`` of the line ending in ``# <- marker``."""
    (lineno,) = [i + 1 for i, line in enumerate(_SOURCE) if line.rstrip().endswith(f"# <- {marker}")]
    return f"{Path(__file__).name}:{lineno}"


# -- (a) custom ops writing a Tensor(a!) argument ------------------------------------------------------
@torch.library.custom_op("efxuser::fill_out", mutates_args=("out",))
def fill_out(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2)


@fill_out.register_fake
def _(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


@torch.library.custom_op("efxuser::scale_into", mutates_args=("out",))
def scale_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Writes ``out`` and returns a value of its own."""
    out.copy_(x * 2)
    return x * 3


@scale_into.register_fake
def _(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("efxuser::fill_all", mutates_args=("outs",))
def fill_all(x: torch.Tensor, outs: list[torch.Tensor]) -> None:
    for i, out in enumerate(outs):
        out.copy_(x + i)


@fill_all.register_fake
def _(x: torch.Tensor, outs: list[torch.Tensor]) -> None:
    return None


def into_a_fresh_buffer(x):
    buf = torch.zeros_like(x)
    fill_out(x, buf)
    return buf + 1


def value_and_out(x):
    buf = torch.empty(3)
    y = scale_into(x, buf)
    return y * buf, buf


def into_a_row(x):
    base = torch.zeros(2, 3)
    fill_out(x, base[1])  # a view: written back into its base
    return base * 1


def into_a_list(x):
    a, b = torch.zeros(3), torch.ones(3)
    fill_all(x, [a, b])
    return a * b


@efx.region
def block(x):
    buf = torch.zeros_like(x)
    return scale_into(x, buf) + buf


@pytest.mark.parametrize("fn", [into_a_fresh_buffer, value_and_out, into_a_row, into_a_list,
                                lambda x: block(block(x))],
                         ids=["fresh buffer", "value and out", "a row", "a list", "region"])
def test_custom_op_writing_its_out_argument_matches_eager(fn) -> None:
    check_against_eager(fn, torch.randn(3))


def test_custom_op_writing_its_out_argument_under_autograd() -> None:
    # torch allows no autograd formula for a mutating custom op: eager's gradient is that of the rest
    def f(x):
        buf = torch.zeros_like(x)
        fill_out(x.detach(), buf)
        return buf + x * 2

    check_against_eager(f, torch.randn(3, requires_grad=True))


def test_custom_op_writing_an_argument_writes_the_callers_tensor() -> None:
    def f(x, out):
        fill_out(x, out)
        return x + 1

    check_mutations_against_eager(f, fresh_args((torch.randn(3), torch.zeros(3))))


def test_custom_op_out_is_auto_functionalized() -> None:
    """Recorded as torch.compile and torch.export record it: ``auto_functionalized`` runs the op on a clone
    of what it writes and returns the op's results, then that clone, to which ``buf`` is rebound."""
    code = efx.capture(into_a_fresh_buffer, torch.randn(3)).code()
    assert code == textwrap.dedent("""\
        def forward(self, x):
            zeros_like = torch.ops.aten.zeros_like.default(x, pin_memory = False)
            detach_1 = torch.ops.aten.detach.default(zeros_like)
            auto_functionalized = torch.ops.higher_order.auto_functionalized(torch.ops.efxuser.fill_out.default, x = x, out = detach_1)
            getitem = auto_functionalized[1]
            add = torch.ops.aten.add.Tensor(getitem, 1)
            return (add,)""")  # noqa: E501


def test_foreach_in_place_matches_eager() -> None:
    # was silently wrong: a written list was not seen as a write (the graph read the old values)
    def f(x):
        a, b = x * 1, x * 2
        torch._foreach_add_([a, b], 1.0)
        return a + b

    check_against_eager(f, torch.randn(3))
    with pytest.raises(efx.UnsupportedMutationError, match=r"'self\[0\]' while its argument 'self\[1\]'"):
        efx.capture(lambda x: (lambda a: (torch._foreach_add_([a, a], 1.0), a)[1])(x * 1), torch.randn(3))


def test_in_place_op_without_functional_form_on_a_fresh_factory_tensor() -> None:
    """``torch.empty(3)`` hands Python a ``detach()`` of the tensor it made (C++ factories do when anything
    else holds the tensor: the tracer does); nobody else can see that tensor, so the result is no view."""
    def f(x):
        return x * torch.empty(3).bernoulli_(0.5) + torch.empty(3).normal_()

    x = torch.randn(3)
    cf = efx.compile(f)
    for _ in range(2):
        torch.manual_seed(5)
        got = cf(x)
        torch.manual_seed(5)
        torch.testing.assert_close(got, f(x))
    code = efx.capture(f, x).code()
    assert "bernoulli_ = torch.ops.aten.bernoulli_.float(detach_1)" in code
    assert "as_strided" not in code


def test_a_tensor_literal_updated_in_place_is_new_on_every_call() -> None:
    # was: the update was written back into the program's lifted copy of the literal (3.0 on call 2)
    def f(x):
        t = torch.tensor([1.0])
        t.add_(1)
        return x + t

    check_against_eager(f, torch.zeros(1), calls=3)
    prog = efx.capture(f, torch.zeros(1))
    assert [prog(torch.zeros(1)).item() for _ in range(2)] == [2.0, 2.0]
    with pytest.raises(efx.UnsupportedMutationError, match="bernoulli_.*torch.tensor") as info:
        efx.capture(lambda x: x * torch.tensor([0.5, 0.5]).bernoulli_(), torch.randn(2))  # <- literal
    assert line_of("literal") in str(info.value)


def test_aliased_writes_are_still_refused() -> None:
    with pytest.raises(efx.UnsupportedMutationError, match="efxuser.fill_out.*'out'.*'x' shares") as info:
        efx.capture(lambda x: (lambda b: (fill_out(b, b), b)[1])(x * 1), torch.randn(3))  # <- overlap
    assert line_of("overlap") in str(info.value) and "clone()" in str(info.value)
    with pytest.raises(efx.UnsupportedMutationError, match="bernoulli_.*no functional form.*a view") as info:
        efx.capture(lambda x: (lambda y: (y.detach().bernoulli_(0.5), y)[1])(torch.zeros(3)),  # <- detached
                    torch.randn(3))
    assert line_of("detached") in str(info.value)


# -- (b) tensors computed from Python constants only ---------------------------------------------------
def four() -> torch.Tensor:
    return torch.div(1024, 256, rounding_mode="trunc")


@pytest.mark.parametrize("fn", [
    lambda x: x + torch.ones(64, four()).sum(),
    lambda x: x.view(4, four()) * 2,
    lambda x: x.view(torch.tensor(1024) // 256, -1) + 1,
    lambda x: x.view(2, -1) * torch.arange(4).sum().item(),
    lambda x: x * 2 if torch.tensor([1.0, 2.0]).sum() > 2 else x,
    lambda x: x * int((lambda t: (t.add_(1), t)[1])(torch.arange(4))[2]),  # updated in place first
    lambda x: x * int((lambda t: (t[1:].fill_(7), t)[1])(torch.zeros(4))[2]),  # through a view
], ids=["ones", "view", "tensor literal", "item", "if", "in place", "view written"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_values_of_constant_tensors_are_known(fn, grad: bool) -> None:
    check_against_eager(fn, torch.randn(16, requires_grad=grad))


def test_a_constant_size_is_baked_in() -> None:
    code = efx.capture(lambda x: x.view(4, four()) + torch.ones(4, four()), torch.randn(16)).code()
    assert code == textwrap.dedent("""\
        def forward(self, x):
            view = torch.ops.aten.view.default(x, [4, 4])
            ones = torch.ops.aten.ones.default([4, 4], device = device(type='cpu'), pin_memory = False)
            detach_1 = torch.ops.aten.detach.default(ones)
            add = torch.ops.aten.add.Tensor(view, detach_1)
            return (add,)""")


GLOBAL = torch.tensor(3)


@efx.region
def scaled(x, n):
    return x * int(n)


@pytest.mark.parametrize("fn", [
    lambda x: x * int(x.sum()),                                          # an input
    lambda x: x * int(torch.randint(0, 5, (1,))),                        # random
    lambda x: x * int(torch.ones(2000).sum()),                           # too large to compute at capture
    lambda x: x * int(torch.empty(1).fill_(2)),                          # empty: whatever memory held
    lambda x: x * int((lambda t: (t.add_(x.sum()), t)[1])(torch.zeros(1))),         # updated from x
    lambda x: x * int((lambda t: (t[:1].add_(x.sum()), t)[1])(torch.zeros(2))[0]),  # ... through a view
    lambda x: x * int(GLOBAL),                                           # a global: an input of the program
    lambda x: scaled(x, torch.tensor(2)),                                # a region's operand
], ids=["input", "random", "large", "empty", "written", "written view", "global", "operand"])
def test_values_that_are_not_constants_stay_refused(fn) -> None:
    with pytest.raises(efx.DataDependentControlFlowError, match="uses the value of a tensor"):
        efx.capture(fn, torch.randn(3))


# -- (c) a CompositeImplicitAutograd effect op whose Python kernel has side effects of its own -------------
SEEN: list[str] = []
_lib = torch.library.Library("efxuserc", "FRAGMENT")
_lib.define("noted(Tensor x, str label) -> Tensor")
_lib.define("pure(Tensor x, str label) -> Tensor")


def _noted(x: torch.Tensor, label: str) -> torch.Tensor:
    SEEN.append(label)  # a side effect no op makes
    return x.sin() * 2


def _helper(x: torch.Tensor) -> torch.Tensor:
    torch.ops.efxfuzz.ping(x, "p")  # an effect op: part of the one node
    return x * 2


_lib.impl("noted", _noted, "CompositeImplicitAutograd")
_lib.impl("pure", lambda x, label: print(f"[{label}]", x) or _helper(x).cos(), "CompositeImplicitAutograd")
efx.register_effect("efxuserc::noted")
efx.register_effect("efxuserc::pure")


def noted_twice(x):
    return torch.ops.efxuserc.noted(x, "a") + torch.ops.efxuserc.noted(x, "b")  # <- noted


def test_kernel_side_effects_are_announced_once_per_op() -> None:
    SEEN.clear()
    with pytest.warns(efx.CaptureSideEffectWarning) as caught:
        prog = efx.capture(noted_twice, torch.randn(3))
    warned = [w for w in caught if issubclass(w.category, efx.EffectfxWarning)]
    assert len(warned) == 1 and warned[0].filename == __file__
    text = str(warned[0].message)
    assert "efxuserc.noted" in text and line_of("noted") in text and "'SEEN' (a list)" in text
    assert "once at capture" in text and "every call" in text and "custom_op" in text
    assert SEEN == ["a", "b"]  # what the warning says: the kernel ran at capture, on fakes
    prog(torch.randn(3))
    assert SEEN == ["a", "b", "a", "b"]  # and it runs at every call, as eager


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_kernels_without_side_effects_of_their_own_are_not_announced(grad: bool) -> None:
    handle = efx.register_effect(torch.ops.aten.absolute.default)  # a C++ kernel
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", efx.EffectfxWarning)
            x = torch.randn(3, requires_grad=grad)
            check_against_eager(lambda x: torch.ops.efxuserc.pure(x, "p") * 2, x)  # ops and print only
            check_against_eager(lambda x: torch.ops.efxfuzz.logged(x, "f"), x)  # effectfx's own test op
            check_against_eager(lambda x: torch.absolute(x) + 1, x)
    finally:
        handle.remove()
