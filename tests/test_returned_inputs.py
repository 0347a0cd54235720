"""Identity and hooks of inputs: an output that is an input is the caller's object (``out is x``; with a
leaf that requires grad, ``out.grad`` is its gradient), and tensor hooks the compiled code registers on its
inputs run on the caller's tensors, registered at every call as eager registers them
(``containers.returned_inputs``, ``interposers.tensor_hooks``)."""

from __future__ import annotations

import pytest
import torch

import effectfx as efx

BACKENDS = ["eager", pytest.param("inductor", marks=pytest.mark.slow)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_returned_inputs_are_the_callers_objects(backend):
    def pair(x, y):
        return y, x * 2, x

    def updated(x):
        x.add_(1)
        return x, x.sum()

    x, y = torch.randn(3), torch.randn(3)
    out = efx.compile(pair, backend=backend)(x, y)
    assert out[0] is y and out[2] is x
    out = efx.compile(updated, backend=backend)(x)
    assert out[0] is x
    assert efx.compile(lambda t: t, backend=backend)(x) is x


@pytest.mark.parametrize("backend", BACKENDS)
def test_returned_leaf_that_requires_grad_has_its_gradient(backend):
    def fn(w, v):
        return w, (w * v).sum(), v

    compiled = efx.compile(fn, backend=backend)
    for _ in range(2):  # (the second call runs the cached program)
        w, v = torch.randn(3, requires_grad=True), torch.randn(3)
        a, loss, b = compiled(w, v)
        assert a is w and b is v
        (loss + (a * 3).sum()).backward()
        torch.testing.assert_close(a.grad, v + 3)

    # a tensor with history comes back as itself too: the gradient reaches what it came from
    base = torch.randn(3, requires_grad=True)
    x = base * 2
    a, loss, _ = compiled(x, torch.ones(3))
    assert a is x
    (loss + a.sum()).backward()
    torch.testing.assert_close(base.grad, torch.full((3,), 4.0))


def test_returned_parameter_is_the_module_parameter():
    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            return (x * self.weight).sum(), self.weight

    model = Scale()
    loss, weight = efx.compile(model)(torch.ones(3))
    assert weight is model.weight
    loss.backward()
    torch.testing.assert_close(weight.grad, torch.ones(3))


class Log:
    def __init__(self) -> None:
        self.calls: list[str] = []


def _hooked(log):
    def fn(w, x):
        w.register_hook(lambda g: log.calls.append("grad") or g * 2)  # changes the gradient, as in eager
        w.register_post_accumulate_grad_hook(lambda p: log.calls.append("accumulated"))
        removed = w.register_hook(lambda g: log.calls.append("removed"))
        removed.remove()
        return (w * x).sum()

    return fn


@pytest.mark.parametrize("backend", BACKENDS)
def test_hooks_registered_on_inputs_run_on_the_callers_tensor_every_call(backend):
    eager_log, log = Log(), Log()
    eager, compiled = _hooked(eager_log), efx.compile(_hooked(log), backend=backend)
    eager_calls, calls = eager_log.calls, log.calls
    w_eager = torch.randn(3, requires_grad=True)
    w = w_eager.detach().clone().requires_grad_()
    for k in range(3):
        x = torch.randn(3, generator=torch.Generator().manual_seed(k))
        eager(w_eager, x).backward()
        compiled(w, x).backward()
        # eager registers the hooks at every call: the k-th backward runs k+1 of each, doubling k+1 times
        assert calls == eager_calls
        torch.testing.assert_close(w.grad, w_eager.grad)
    assert eager_calls.count("grad") == eager_calls.count("accumulated") == 6
    assert "removed" not in eager_calls
    assert compiled.stats.compiles == 1


def test_hook_on_a_parameter_in_a_compiled_module_forward():
    calls: dict[str, list] = {"eager": [], "efx": []}

    class Model(torch.nn.Module):
        def __init__(self, tag: str) -> None:
            super().__init__()
            self.tag = tag
            self.lin = torch.nn.Linear(3, 2)

        def forward(self, x):
            self.lin.weight.register_post_accumulate_grad_hook(lambda p: calls[self.tag].append(p.grad.sum()))
            return self.lin(x).sum()

    eager, model = Model("eager"), Model("efx")
    model.load_state_dict(eager.state_dict())
    compiled = efx.compile(model)
    for k in range(2):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(k))
        eager(x).backward()
        compiled(x).backward()
    assert len(calls["efx"]) == len(calls["eager"]) == 3
    torch.testing.assert_close(calls["efx"], calls["eager"])


def test_hook_closing_over_a_traced_tensor_is_refused_and_hooks_are_not_saved(tmp_path):
    def closing(w, x):
        scale = x.sum()
        w.register_hook(lambda g: g * scale)
        return (w * x).sum()

    with pytest.raises(efx.CaptureError, match="closing over a tensor of the trace"):
        efx.compile(closing)(torch.randn(3, requires_grad=True), torch.randn(3))

    prog = efx.remove_effect_tokens(efx.capture(_hooked(Log()), torch.randn(3, requires_grad=True),
                                                torch.randn(3)))
    with pytest.raises(efx.SerializationError, match="registers tensor hooks"):
        prog.forward.save(tmp_path / "p.efx")
