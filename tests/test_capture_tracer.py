"""The tracer's edges: in-place ops without a functional twin, data access on fake tensors."""

from __future__ import annotations

import pytest
import torch

import effectfx as efx
from effectfx.testing import check_against_eager


def _dropout(x):
    return torch.nn.functional.dropout(x.sin(), 0.5, training=True) * 2


def test_inplace_without_functional_twin_stays_in_place() -> None:
    """dropout's bernoulli_ has no functional overload: the in-place op is kept on its fresh buffer."""
    prog = efx.capture(_dropout, torch.randn(6), functionalize=False)
    code = prog.code()
    assert "bernoulli_ = torch.ops.aten.bernoulli_.float(empty_like)" in code
    assert "div = torch.ops.aten.div.Scalar(bernoulli_, 0.5)" in code  # div_ had a twin: functionalized


@pytest.mark.parametrize("requires_grad", [False, True])
def test_dropout_matches_eager_with_the_same_seed(requires_grad: bool) -> None:
    x = torch.randn(64, requires_grad=requires_grad)
    cf = efx.compile(_dropout)
    for _ in range(2):
        torch.manual_seed(7)
        got = cf(x)
        torch.manual_seed(7)
        want = _dropout(x)
        torch.testing.assert_close(got, want)
        if requires_grad:
            (g1,) = torch.autograd.grad(got.sum(), x)
            (g2,) = torch.autograd.grad(want.sum(), x)
            torch.testing.assert_close(g1, g2)


def test_numpy_in_captured_code_is_a_capture_error_naming_the_line() -> None:
    def f(x):
        return torch.from_numpy((x * 2).numpy())  # <- numpy

    with pytest.raises(efx.CaptureError) as info:
        efx.capture(f, torch.randn(2))
    assert "test_capture_tracer.py" in str(info.value) and "numpy" in str(info.value)


def test_random_ops_follow_the_global_generator() -> None:
    torch.manual_seed(0)
    check_against_eager(lambda x: x + torch.randn(3), torch.randn(3), forms=(), compile=False)
    prog = efx.capture(lambda x: x + torch.randn(3), torch.randn(3))
    x = torch.randn(3)
    torch.manual_seed(3)
    a = prog(x)
    torch.manual_seed(3)
    torch.testing.assert_close(a, x + torch.randn(3))


class Masked(torch.nn.Module):
    """A plain (unregistered) tensor attribute: it differs per instance, like a parameter."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.mask = torch.full((3,), value)

    @efx.region
    def forward(self, x):
        torch.ops.efxtest.record_memory("masked")
        return x * self.mask


def test_plain_tensor_attributes_are_operands_by_name() -> None:
    """Two instances share one body, each passing its own mask (a by-identity lift would reuse the first)."""
    a, b = Masked(2.0), Masked(5.0)
    f = lambda x: b(a(x))  # noqa: E731
    prog = efx.capture(f, torch.randn(3))
    assert prog.region_traces == {"subgraph_0": 1}
    check_against_eager(f, torch.randn(3))


def test_compiled_module_sees_a_reassigned_tensor_attribute() -> None:
    m = Masked(2.0)
    cm = efx.compile(m)
    x = torch.randn(3)
    torch.testing.assert_close(cm(x), x * 2.0)
    m.mask = torch.full((3,), 7.0)
    torch.testing.assert_close(cm(x), x * 7.0)


def _setitem(x):
    y = x * 1
    y[0] = 5.0
    return y * 2


def test_setitem_on_an_intermediate_writes_back_through_the_base() -> None:
    """Proves the write-back rule: a write into a view becomes as_strided_scatter into its base."""
    code = efx.capture(_setitem, torch.randn(3), functionalize=False).code()
    assert code.splitlines() == [
        "def forward(self, x, lifted):",  # the 5.0 PyTorch wraps in a tensor: a constant input
        "    mul = torch.ops.aten.mul.Tensor(x, 1)",
        "    lift_fresh = torch.ops.aten.lift_fresh.default(lifted)",
        "    select = torch.ops.aten.select.int(mul, 0, 0)",
        "    copy = torch.ops.aten.copy.default(select, lift_fresh)",
        "    as_strided_scatter = torch.ops.aten.as_strided_scatter.default(mul, copy, [], [], 0)",
        "    mul_1 = torch.ops.aten.mul.Tensor(as_strided_scatter, 2)",
        "    return (mul_1,)",
    ]


@pytest.mark.parametrize("fn", [
    _setitem,
    lambda x: (lambda y: (y[:, :2].mul_(3), y.t().relu())[1])(x.sin()),   # write into a slice, read a view
    lambda x: (lambda y, v: (y.mul_(3), v + 1)[1])(*(lambda y: (y, y[1]))(x * 2)),  # base written, view read
    lambda x: (lambda y: (y.detach().add_(1), y)[1])(x * 2),              # through a detached alias
])
def test_writes_through_aliases_match_eager(fn) -> None:
    shape = (3,) if fn is _setitem else (3, 4)
    check_against_eager(fn, torch.randn(*shape, requires_grad=True))
    check_against_eager(fn, torch.randn(*shape))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_fast_fakes_are_the_fakes_torch_makes(requires_grad: bool) -> None:
    """The tracer builds fakes without FakeTensor's constructor (a third of the cost): same class, state,
    device, metadata and behaviour under the fake mode as the ones FakeTensor itself builds."""
    from torch._subclasses.fake_tensor import FakeTensor

    from effectfx.capture.tracer import Tracer
    from effectfx.graph.traced import TensorMeta
    from effectfx.hops.region import call_region

    tracer = Tracer(call_region)
    meta = TensorMeta((3, 4), (1, 3), torch.float64, torch.device("cpu"), requires_grad)
    fast = tracer.new_fake(meta)
    storage = torch.empty_strided((3, 4), (1, 3), dtype=torch.float64, device="meta")
    slow = FakeTensor(tracer.fake_mode, storage, torch.device("cpu")).requires_grad_(requires_grad)
    assert type(fast) is FakeTensor
    assert fast.__dict__.keys() == slow.__dict__.keys()
    assert TensorMeta.of(fast) == TensorMeta.of(slow) == meta
    assert fast.device == torch.device("cpu") and fast.fake_mode is tracer.fake_mode
    with tracer.fake_mode:
        out = fast.t() @ fast
    assert isinstance(out, FakeTensor) and out.shape == (4, 4) and out.requires_grad == requires_grad
    assert torch._C._dispatch_keys(fast) == torch._C._dispatch_keys(slow)
