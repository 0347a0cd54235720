# ruff: noqa: E501  (golden graph text has long lines)
"""efx.callback and @efx.effect (Note [Callbacks]): any Python function as an effect, against eager.

Golden graphs of the captured and functionalized forms (one node per call site, ordered with a registered
effect op on the same key); outputs, gradients and the effect log against eager for the root, a region
called three times (one body), backward formulas, results (``result_shape=``), efx.compile with the default
and the Inductor backend, save/load; the refusals; Python's ``random`` module in captured code.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest
import torch

import effectfx as efx
from effectfx.testing import check_against_eager, recording
from effectfx.testing.effect_ops import noted, shifted

R = torch.ops.efxtest


def dedent(s: str) -> str:
    return textwrap.dedent(s).strip("\n")


@efx.region
def layer(x):
    efx.callback(noted, x, "layer", key="memory")
    return x.sin()


def program(x):
    R.record_memory("before")
    efx.callback(noted, x, "root", key="memory")
    y = efx.callback(shifted, x, "shift", result_shape=x)  # key "ordered"
    z = layer(y) + layer(x)
    R.record_memory("after")
    return z * y


# -- (a) golden graphs ------------------------------------------------------------------------------------
def test_captured_form_golden():
    prog = efx.capture(program, torch.randn(3), functionalize=False)
    assert prog.code() == dedent('''
        def forward(self, x):
            record_memory = torch.ops.efxtest.record_memory.default('before')
            on_memory = torch.ops.effectfx_callback.on_memory.default('effectfx.testing.effect_ops:noted', '[[{"tensor":0},"root"],{}]', [x], '')
            on_ordered = torch.ops.effectfx_callback.on_ordered.default('effectfx.testing.effect_ops:shifted', '[[{"tensor":0},"shift"],{}]', [x], '{"result":[[3],"float32","cpu"]}')
            getitem = on_ordered[0]
            layer_subgraph0 = self.layer_subgraph0
            invoke_subgraph = effectfx.ops.invoke_subgraph(layer_subgraph0, 'subgraph_0', getitem)
            getitem_1 = invoke_subgraph[0]
            invoke_subgraph_1 = effectfx.ops.invoke_subgraph(layer_subgraph0, 'subgraph_0', x)
            getitem_2 = invoke_subgraph_1[0]
            add = torch.ops.aten.add.Tensor(getitem_1, getitem_2)
            record_memory_1 = torch.ops.efxtest.record_memory.default('after')
            mul = torch.ops.aten.mul.Tensor(add, getitem)
            return (mul,)

        # layer_subgraph0: 'subgraph_0'
        def layer_subgraph0(self, x):
            on_memory = torch.ops.effectfx_callback.on_memory.default('effectfx.testing.effect_ops:noted', '[[{"tensor":0},"layer"],{}]', [x], '')
            sin = torch.ops.aten.sin.default(x)
            return (sin,)
    ''')


def test_functionalized_form_golden():
    prog = efx.capture(program, torch.randn(3))
    efx.verify(prog)  # one token chain per key (Note [Effect tokens])
    assert prog.code() == dedent('''
        def forward(self, token_memory, token_ordered, x):
            with_effects = effectfx.ops.with_effects(token_memory, torch.ops.efxtest.record_memory.default, 'before')
            getitem = with_effects[0]
            with_effects_1 = effectfx.ops.with_effects(getitem, torch.ops.effectfx_callback.on_memory.default, 'effectfx.testing.effect_ops:noted', '[[{"tensor":0},"root"],{}]', [x], '')
            getitem_1 = with_effects_1[0]
            with_effects_2 = effectfx.ops.with_effects(token_ordered, torch.ops.effectfx_callback.on_ordered.default, 'effectfx.testing.effect_ops:shifted', '[[{"tensor":0},"shift"],{}]', [x], '{"result":[[3],"float32","cpu"]}')
            getitem_2 = with_effects_2[0]
            getitem_3 = with_effects_2[1]
            layer_subgraph0 = self.layer_subgraph0
            invoke_subgraph = effectfx.ops.invoke_subgraph(layer_subgraph0, 'subgraph_0', getitem_1, getitem_3)
            getitem_4 = invoke_subgraph[0]
            getitem_5 = invoke_subgraph[1]
            invoke_subgraph_1 = effectfx.ops.invoke_subgraph(layer_subgraph0, 'subgraph_0', getitem_4, x)
            getitem_6 = invoke_subgraph_1[0]
            getitem_7 = invoke_subgraph_1[1]
            add = torch.ops.aten.add.Tensor(getitem_5, getitem_7)
            with_effects_3 = effectfx.ops.with_effects(getitem_6, torch.ops.efxtest.record_memory.default, 'after')
            getitem_8 = with_effects_3[0]
            mul = torch.ops.aten.mul.Tensor(add, getitem_3)
            return (getitem_8, getitem_2, mul)

        # layer_subgraph0: 'subgraph_0'
        def layer_subgraph0(self, token, x):
            with_effects = effectfx.ops.with_effects(token, torch.ops.effectfx_callback.on_memory.default, 'effectfx.testing.effect_ops:noted', '[[{"tensor":0},"layer"],{}]', [x], '')
            getitem = with_effects[0]
            sin = torch.ops.aten.sin.default(x)
            return (getitem, sin)
    ''')
    assert prog.token_keys == ("memory", "ordered")
    assert prog.region_effects == {"subgraph_0": frozenset({"memory"})}
    assert efx.effect_of(torch.ops.effectfx_callback.on_memory.default) == "memory"


# -- (b) against eager --------------------------------------------------------------------------------------
def test_root_against_eager():
    def f(x, w):
        efx.callback(noted, x, "x", key="stdout")
        R.log_tensor(x, "op")  # a registered op on the same key, between two callbacks
        h = torch.tanh(x @ w)
        efx.callback(noted, h, "h", key="stdout")
        efx.callback(noted, h, "h on memory", key="memory")
        return h.sum(-1)

    log = check_against_eager(f, torch.randn(2, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)).log
    assert [e[:2] for e in log] == [("noted", "x"), ("log_tensor", "op"), ("noted", "h"),
                                    ("noted", "h on memory")]


@efx.region
def block(x, w):
    efx.callback(noted, x, "block in", key="memory")
    y = torch.relu(x @ w)
    efx.callback(noted, y, "block out")
    return y


def test_region_called_three_times_is_one_body():
    def f(x, w):
        for _ in range(3):
            x = block(x, w)
        return x

    x, w = torch.randn(2, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    log = check_against_eager(f, x, w).log
    assert [e[1] for e in log] == ["block in", "block out"] * 3
    prog = efx.capture(f, x, w)
    assert prog.forward.region_traces == {"subgraph_0": 1} and len(prog.forward.subgraphs()) == 1


class Logged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        efx.callback(noted, grad, "Logged.backward", key="memory")
        return grad * 3


@torch.library.custom_op("efxcb::square", mutates_args=())
def square(x: torch.Tensor) -> torch.Tensor:
    return x * x


square.register_fake(lambda x: torch.empty_like(x))


def _square_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    efx.callback(noted, grad, "square's formula")
    return 2 * x * grad


square.register_autograd(_square_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


def test_backward_formulas_against_eager():
    def f(x):
        R.record_memory("forward")
        return Logged.apply(x).sum() + square(x.cos()).sum()

    log = check_against_eager(f, torch.randn(3, requires_grad=True)).log
    assert [e[1] for e in log] == ["forward", "square's formula", "Logged.backward"]
    prog = efx.capture(f, torch.randn(3, requires_grad=True))
    assert "on_memory" not in prog.forward.code() and "on_ordered" not in prog.forward.code()
    assert prog.backward.code().count("effectfx_callback.on_") == 2


def stats(x):
    return {"mean": x.mean(0), "pair": (x.amax(0), x.argmax(0))}


def test_results_are_used_in_later_math():
    spec = {"mean": efx.TensorSpec((3,)), "pair": (efx.TensorSpec((3,)), efx.TensorSpec((3,), torch.int64))}

    def f(x, w):
        y = efx.callback(shifted, x, "shift", result_shape=x)
        s = efx.callback(stats, x * w, result_shape=spec)
        assert not y.requires_grad  # opaque to autograd, as JAX's io_callback
        return (y * w).sum(0) + s["mean"] * s["pair"][0] + s["pair"][1]

    check_against_eager(f, torch.randn(4, 3, requires_grad=True), torch.randn(4, 3, requires_grad=True))


def test_a_result_as_large_as_an_argument_stays_symbolic():
    def f(x):
        return efx.callback(shifted, x, "shift", result_shape=efx.TensorSpec((x.shape[0], 3))).sum(-1)

    compiled = efx.compile(f, dynamic=True)
    for n in (2, 3, 5):
        x = torch.randn(n, 3)
        with recording() as eager_log:
            expected = f(x)
        with recording() as log:
            assert torch.allclose(compiled(x), expected)
        assert log == eager_log
    assert len(compiled.programs()) == 1


@efx.region
def _squared_and_passed(x):
    v = x * x
    efx.callback(shifted, v, "sq", key="stdout", result_shape=v)
    return v, x


class _PinsTheSize(torch.nn.Module):
    """A region's callback names its result's sizes after the argument's; a layer later pins one of them to a
    number, so the region's partial backward retrace (only the first result is used) sees the number where
    the first trace saw the symbol: found by ``effectfx fuzz --sizes``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        v, passed = _squared_and_passed(x)
        self.lin(passed)
        return v


def test_a_retrace_that_sees_a_pinned_size_records_the_same_callback():
    torch.manual_seed(0)
    model = _PinsTheSize()
    compiled = efx.compile(model, dynamic=True)
    for n in (3, 5):
        x = torch.randn(n, 4, requires_grad=True)
        with recording() as eager_log:
            (expected,) = torch.autograd.grad(model(x).sum(), x)
        with recording() as log:
            (got,) = torch.autograd.grad(compiled(x).sum(), x)
        assert torch.allclose(got, expected) and log == eager_log


def test_efx_effect_decorator():
    @efx.effect(key="memory")
    def note_twice(x, label):
        noted(x, label)
        noted(x * 2, label)

    assert efx.effect(noted).__wrapped__ is noted

    def f(x):
        note_twice(x, "twice")
        return torch.ops.efxtest.bump(x, "bump")

    log = check_against_eager(f, torch.randn(3)).log
    assert [e[:2] for e in log] == [("noted", "twice"), ("noted", "twice"), ("bump", "bump")]


def test_eager_calls_the_function():
    assert efx.callback(lambda a, b=1: a + b, 1, b=2) == 3  # its result, as it is
    x = torch.randn(3, requires_grad=True)
    y = efx.callback(shifted, x, "eager", result_shape=x)
    assert torch.equal(y, x.detach().cos() + 1) and not y.requires_grad
    with pytest.raises(efx.CallbackError, match=r"returned a tensor of shape \(3,\).*TensorSpec\(\(2,\)"):
        efx.callback(shifted, x, "eager", result_shape=efx.TensorSpec((2,)))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_against_eager(backend):
    def f(x, w):
        efx.callback(noted, x, "in", key="memory")
        h = block(torch.tanh(x @ w), w)
        y = efx.callback(shifted, h, "shift", key="memory", result_shape=h)
        return (h * y).sum()

    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(3, 3, requires_grad=True)
    compiled = efx.compile(f, backend=backend)
    for _ in range(2):  # (inductor: a root segment is compiled on the second call)
        results = []
        for fn in (f, compiled):
            x.grad = w.grad = None
            with recording() as log:
                out = fn(x, w)
                out.backward()
            results.append((out.detach(), x.grad.clone(), w.grad.clone(), log))
        (out0, gx0, gw0, log0), (out1, gx1, gw1, log1) = results
        assert torch.allclose(out0, out1, atol=1e-5) and torch.allclose(gx0, gx1, atol=1e-5)
        assert torch.allclose(gw0, gw1, atol=1e-5)
        assert [e[:2] for e in log0] == [e[:2] for e in log1] and len(log0) == 4


def test_save_and_load_in_another_process(tmp_path):
    def f(x):
        efx.callback(noted, x, "saved", key="collective:tp")
        return efx.callback(shifted, x, "shift", result_shape=x) * 2

    x = torch.arange(3.0)
    efx.remove_effect_tokens(efx.capture(f, x)).save(tmp_path / "p.zip")
    script = textwrap.dedent(f'''
        import torch
        import effectfx as efx
        from effectfx.testing import recording
        prog = efx.load({str(tmp_path / "p.zip")!r})
        with recording() as log:
            out = prog(torch.arange(3.0))
        print(out.tolist())
        print(log)
    ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    with recording() as log:
        expected = f(x)
    assert done.stdout.splitlines() == [str(expected.tolist()), str(log)]


def test_a_lambda_is_refused_at_save(tmp_path):
    def f(x):
        efx.callback(lambda t: noted(t, "lambda"), x)
        return x + 1

    prog = efx.remove_effect_tokens(efx.capture(f, torch.randn(3)))
    with recording() as log:
        prog(torch.randn(3))  # in memory, it runs
    assert [e[1] for e in log] == ["lambda"]
    with pytest.raises(efx.SerializationError, match=r"f.<locals>.<lambda> \(defined at .*test_callback.py:\d+\), called at .*efx.callback\(lambda"):
        prog.save(tmp_path / "p.zip")


def test_refusals_name_the_argument_and_line():
    def opaque(x):
        efx.callback(noted, x, object())
        return x

    with pytest.raises(efx.CallbackError, match=r"test_callback.py:\d+ \(in opaque\).*args\[1\] is a object"):
        efx.capture(opaque, torch.randn(3))

    def closure(x):
        y = x * 2
        efx.callback(lambda: noted(y, "stale"))
        return y

    with pytest.raises(efx.CallbackError, match="closes over a tensor the captured code computed"):
        efx.capture(closure, torch.randn(3))

    def writes(t):
        t.add_(1)

    def f(x):
        efx.callback(writes, x * 1)
        return x

    for run in (f, efx.compile(f)):
        with pytest.raises(efx.CallbackError, match="wrote one of its tensor arguments"):
            run(torch.randn(3))

    with pytest.raises(efx.RegistryError, match="efx.callback: bad effect key"):
        efx.callback(noted, torch.randn(3), "x", key="no spaces")


def test_a_result_unlike_result_shape_fails_at_run_time():
    def f(x):
        return efx.callback(shifted, x, "shift", result_shape=efx.TensorSpec((3,), torch.float64))

    prog = efx.capture(f, torch.randn(3))
    with pytest.raises(efx.CallbackError, match=r"returned a tensor of shape \(3,\), torch.float32.*float64"):
        prog(torch.randn(3))


@efx.region
def named(x, name):
    efx.callback(noted, x, name)
    return x + 1


def test_a_string_a_region_passes_is_baked_per_value():
    def f(x):
        return named(named(x, "first"), "second")

    log = check_against_eager(f, torch.randn(3)).log
    assert [e[1] for e in log] == ["first", "second"]


def note_a(x):
    noted(x, "a")


def note_b(x):
    noted(x, "b")


@efx.region
def calls(x, fn):
    efx.callback(fn, x)
    return x + 1


def test_one_body_per_function():
    def f(x):
        return calls(calls(calls(x, note_a), note_b), note_a)

    log = check_against_eager(f, torch.randn(3)).log
    assert [e[1] for e in log] == ["a", "b", "a"]
    assert efx.capture(f, torch.randn(3)).region_traces == {"subgraph_0": 1, "subgraph_1": 1}


class Layer(torch.nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.i = i
        self.lin = torch.nn.Linear(3, 3)

    def note(self, x):
        noted(x, f"layer {self.i}")

    @efx.region
    def forward(self, x):
        efx.callback(self.note, x)
        return self.lin(x)


def test_a_method_of_the_module_is_its_own_function():
    layers = torch.nn.ModuleList([Layer(i) for i in range(3)])

    def f(x):
        for layer in layers:
            x = layer(layer(x))
        return x

    log = check_against_eager(f, torch.randn(3)).log
    assert [e[1] for e in log] == ["layer 0", "layer 0", "layer 1", "layer 1", "layer 2", "layer 2"]
    assert efx.capture(f, torch.randn(3)).forward.region_traces == {f"subgraph_{i}": 1 for i in range(3)}


def test_under_vmap_is_refused():
    def inside(x):
        return torch.vmap(lambda t: (efx.callback(noted, t, "vmap"), t * 2)[1])(x)

    with pytest.raises(efx.CallbackError, match="under a torch.func transform"):
        efx.compile(inside)(torch.randn(2, 3))

    def f(x):
        efx.callback(noted, x, "vmap")
        return x * 2

    with pytest.raises(efx.CallbackError, match="run under torch.vmap"):
        torch.vmap(efx.compile(f))(torch.randn(2, 3))


# -- (c) Python's random module ---------------------------------------------------------------------------
@pytest.mark.parametrize("draw", [
    lambda x: x * random.random(),
    lambda x: x + random.uniform(0.0, 1.0),
    lambda x: x[random.randint(0, 2)],
    lambda x: (random.shuffle([1, 2, 3]), x)[1],
    lambda x: (random.seed(0), x)[1],
])
def test_python_random_is_refused_naming_the_line(draw):
    with pytest.raises(efx.UnsupportedOperatorError, match=r"random module at .*test_callback.py:\d+ \(in <lambda>\)"):
        efx.compile(draw)(torch.randn(3))
    # outside a capture: the module as it was, not an interposer's dispatch
    assert not hasattr(random.random, "__effectfx_interposer__") and "random" not in vars(random.Random)


def test_a_generator_of_the_codes_own_draws_the_same_each_call():
    def f(x):
        return x * random.Random(0).random()

    x = torch.randn(3)
    assert torch.equal(efx.compile(f)(x), f(x))


def draw_uniform():
    return torch.tensor(random.random())


def test_a_draw_through_a_callback_is_per_call():
    def f(x):
        return x * efx.callback(draw_uniform, result_shape=efx.TensorSpec(()))

    x = torch.ones(2)
    random.seed(7)
    expected = [f(x) for _ in range(3)]
    compiled = efx.compile(f)
    random.seed(7)
    got = [compiled(x) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert not torch.equal(got[0], got[1])
