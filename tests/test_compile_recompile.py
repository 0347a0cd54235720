"""efx.compile's cache and inspection (point 5): what reuses a program, what recompiles,
and that every cached program still agrees with eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx.testing import recording

R = torch.ops.efxtest


class Block(nn.Module):
    def __init__(self, d: int = 4, p: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    @efx.region
    def forward(self, x):
        R.record_memory("train" if self.training else "eval")
        return self.drop(torch.relu(self.lin(x))) + x


class Model(nn.Module):
    def __init__(self, n: int = 2, d: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.factor = 2

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x * self.factor


def pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    m = Model()
    return m, copy.deepcopy(m)


def same_run(eager_fn, compiled_fn, x: torch.Tensor) -> torch.Tensor:
    """Outputs, effect logs (and input grads when x requires grad) agree; returns the compiled output."""
    xe = x.detach().clone().requires_grad_(x.requires_grad)
    xc = x.detach().clone().requires_grad_(x.requires_grad)
    with recording() as elog:
        eout = eager_fn(xe)
        if eout.requires_grad:
            eout.sum().backward()
    with recording() as clog:
        cout = compiled_fn(xc)
        if cout.requires_grad:
            cout.sum().backward()
    assert clog == elog
    assert torch.allclose(eout, cout, rtol=1e-5, atol=1e-6)
    assert eout.requires_grad == cout.requires_grad
    if x.requires_grad:
        assert torch.allclose(xe.grad, xc.grad, rtol=1e-5, atol=1e-6)
    return cout


def test_same_signature_reuses_the_program():
    eager, model = pair()
    cm = efx.compile(model)
    for seed in range(3):
        same_run(eager, cm, torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)))
    assert cm.stats.compiles == 1
    assert cm.stats.calls == 3
    assert len(cm.programs()) == 1


def test_shape_change_recompiles_and_old_shape_is_cached():
    eager, model = pair(1)
    cm = efx.compile(model)
    same_run(eager, cm, torch.randn(3, 4))
    same_run(eager, cm, torch.randn(5, 4))
    assert cm.stats.compiles == 2
    same_run(eager, cm, torch.randn(3, 4))
    same_run(eager, cm, torch.randn(5, 4))
    assert cm.stats.compiles == 2
    assert cm.stats.calls == 4


def test_dtype_change_recompiles():
    @efx.region
    def r(x):
        R.record_memory("r")
        return x * 3

    f = lambda x: r(r(x))  # noqa: E731
    cf = efx.compile(f)
    same_run(f, cf, torch.randn(3))
    out = same_run(f, cf, torch.randn(3, dtype=torch.float64))
    assert out.dtype == torch.float64
    assert cf.stats.compiles == 2


def test_requires_grad_change_recompiles():
    eager, model = pair(2)
    model.requires_grad_(False)
    eager.requires_grad_(False)
    cm = efx.compile(model)
    same_run(eager, cm, torch.randn(2, 4))
    assert not isinstance(cm.programs()[0], efx.TrainingProgram)
    same_run(eager, cm, torch.randn(2, 4).requires_grad_())
    assert cm.stats.compiles == 2
    assert sum(isinstance(p, efx.TrainingProgram) for p in cm.programs()) == 1


def test_freezing_parameters_recompiles():
    eager, model = pair(3)
    cm = efx.compile(model)
    x = torch.randn(2, 4)
    same_run(eager, cm, x)
    model.zero_grad(set_to_none=True)
    model.blocks[0].requires_grad_(False)
    eager.blocks[0].requires_grad_(False)
    with recording():
        cm(x).sum().backward()
    assert cm.stats.compiles == 2
    assert model.blocks[0].lin.weight.grad is None
    assert model.blocks[1].lin.weight.grad is not None


def test_no_grad_gives_an_inference_program():
    eager, model = pair(4)
    cm = efx.compile(model)
    x = torch.randn(2, 4)
    same_run(eager, cm, x)  # training program
    with torch.no_grad():
        out = same_run(eager, cm, x)
    assert out.grad_fn is None and not out.requires_grad
    assert cm.stats.compiles == 2
    kinds = sorted(type(p).__name__ for p in cm.programs())
    assert kinds == ["Program", "TrainingProgram"]
    inference = next(p for p in cm.programs() if not isinstance(p, efx.TrainingProgram))
    assert "backward" not in inference.code()
    with torch.no_grad():
        same_run(eager, cm, x)
    assert cm.stats.compiles == 2


def test_eval_and_train_recompile():
    eager, model = pair(5)
    cm = efx.compile(model)
    x = torch.randn(2, 4)
    with recording() as log:
        cm(x)
    assert log[0] == ("record_memory", "train")
    eager.eval()
    model.eval()
    same_run(eager, cm, x)
    with recording() as log:
        cm(x)
    assert log == [("record_memory", "eval")] * 2
    assert cm.stats.compiles == 2
    eager.train()
    model.train()
    same_run(eager, cm, x)
    assert cm.stats.compiles == 2  # the train() program was cached


def test_dropout_eval_is_deterministic_after_recompile():
    torch.manual_seed(6)
    model = Model()
    model.blocks[0].drop.p = 0.5
    cm = efx.compile(model)
    x = torch.randn(4, 4)
    model.eval()
    with recording(), torch.no_grad():
        expected = model(x)
        a, b = cm(x), cm(x)
    assert torch.equal(a, b) and torch.allclose(a, expected)


def test_non_tensor_argument_change_recompiles():
    @efx.region
    def r(x, k: int):
        R.record_memory(f"k={k}")
        return x * k

    f = lambda x, k: r(x, k) + r(x, k + 1)  # noqa: E731
    cf = efx.compile(f)
    x = torch.randn(3)
    for k in (1, 2, 1):
        with recording() as elog:
            expected = f(x, k)
        with recording() as log:
            got = cf(x, k)
        assert log == elog and torch.allclose(got, expected)
    assert cf.stats.compiles == 2


def test_plain_module_attribute_change_recompiles():
    eager, model = pair(7)
    cm = efx.compile(model)
    x = torch.randn(2, 4)
    same_run(eager, cm, x)
    model.factor = 5
    eager.factor = 5
    same_run(eager, cm, x)


# -- inspection -------------------------------------------------------------------------------------
def test_programs_are_inspectable():
    eager, model = pair(8)
    cm = efx.compile(model)
    x = torch.randn(2, 4, requires_grad=True)
    with recording():
        cm(x).sum().backward()
    (prog,) = cm.programs()
    assert isinstance(prog, efx.TrainingProgram)
    assert isinstance(prog.forward, efx.Program) and isinstance(prog.backward, efx.Program)
    assert prog.forward.region_traces == {"subgraph_0": 1}
    assert prog.backward.region_traces == {"subgraph_0": 1}
    assert prog.region_traces == prog.forward.region_traces
    text = str(prog)
    assert str(prog.forward) in text and str(prog.backward) in text
    assert "(forward)" in str(prog.forward) and "(backward)" in str(prog.backward)
    assert "def Block_forward_subgraph0(" in str(prog.forward)
    assert "def Block_forward_subgraph0_backward(" in str(prog.backward)
    assert "compiled signature" in repr(cm)
    # a printed program is runnable code: every graph module has code
    for gm in (prog.forward.graph_module, *prog.forward.subgraphs().values(),
               prog.backward.graph_module, *prog.backward.subgraphs().values()):
        assert gm.code.strip().startswith("def forward(")


def test_compile_of_a_plain_function_and_a_bound_method():
    @efx.region
    def r(x):
        R.record_stdout("r")
        return x.exp()

    def f(x):
        return r(x) * r(x)

    x = torch.randn(3, requires_grad=True)
    same_run(f, efx.compile(f), x)
    eager, model = pair(9)
    same_run(eager.forward, efx.compile(model.forward), torch.randn(2, 4))


def test_stride_change_recompiles_or_matches_eager():
    f = lambda x: x.reshape(-1) * 2  # noqa: E731
    cf = efx.compile(f)
    cf(torch.randn(3, 4))
    b = torch.randn(4, 3).t()
    assert torch.allclose(cf(b), f(b))


def test_reassigned_parameter_is_seen():
    lin = nn.Linear(2, 2)
    cf = efx.compile(lin)
    x = torch.randn(1, 2)
    cf(x)
    lin.weight = nn.Parameter(torch.zeros(2, 2))
    assert torch.allclose(cf(x), lin(x))


def test_reassigned_buffer_is_seen():
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.ones(2))

        def forward(self, x):
            return x + self.b

    m = WithBuffer()
    cm = efx.compile(m)
    x = torch.randn(1, 2)
    cm(x)
    m.b = torch.full((2,), 5.0)
    assert torch.allclose(cm(x), m(x))


LOG_LEVEL = 0  # read by _logged_by_global below: a plain global the compiled function names directly


def _logged_by_global(x):
    if LOG_LEVEL > 0:
        R.record_stdout("global")
    return x * 2


def test_plain_global_named_by_the_function_recompiles():
    global LOG_LEVEL
    cf = efx.compile(_logged_by_global)
    x = torch.randn(3)
    with recording() as log:
        cf(x)
    assert log == []
    LOG_LEVEL = 1
    try:
        with recording() as log:
            cf(x)
        assert log == [("record_stdout", "global")]
        assert cf.stats.compiles == 2
    finally:
        LOG_LEVEL = 0


def test_closed_over_plain_value_recompiles():
    scale = [2.0]

    def f(x):
        return x * scale[0]

    cf = efx.compile(f)
    x = torch.randn(3)
    torch.testing.assert_close(cf(x), x * 2.0)
    scale[0] = 5.0
    torch.testing.assert_close(cf(x), x * 5.0)
    assert cf.stats.compiles == 2


def test_numbers_of_other_types_are_other_signatures():
    """1, 1.0 and True compare equal in Python but trace differently (int tensors: x * 1.0 is float)."""
    cf = efx.compile(lambda x, k: x * k)
    x = torch.arange(3)
    for k in (1, 1.0, True):
        out = cf(x, k)
        assert out.dtype == (x * k).dtype and torch.equal(out, x * k)
    assert cf.stats.compiles == 3


# -- the same tensor passed twice ----------------------------------------------------------------------------
def _weighted(x, a, b):
    R.record_memory("weighted")
    return x + a * 2 + b * 3


def _update_then_read(a, b):
    a.add_(1)
    return b * 2


def test_same_tensor_twice_is_a_signature_of_its_own() -> None:
    # found while porting upstream cond tests: a program captured with (x, t, t) read one input for both
    x, t, t1, t2 = (torch.randn(3) for _ in range(4))
    compiled = efx.compile(_weighted)
    for args in [(x, t, t), (x, t1, t2), (x, t, t)]:
        with recording() as log:
            got = compiled(*args)
        assert torch.equal(got, _weighted(*args)) and log == [("record_memory", "weighted")]
    assert compiled.stats.compiles == 2
    # an in-place update through one argument is seen through the other, as in eager
    a = torch.zeros(2)
    assert torch.equal(efx.compile(_update_then_read)(a, a), torch.full((2,), 2.0))
    assert torch.equal(a, torch.ones(2))


def test_captured_program_refuses_another_aliasing() -> None:
    x, t, t1, t2 = (torch.randn(3) for _ in range(4))
    prog = efx.capture(_weighted, x, t, t)
    assert torch.equal(prog(x, t, t), _weighted(x, t, t))
    with pytest.raises(efx.SignatureMismatchError, match=r"same tensor \(or views of it\) as inputs 1 and 2"):
        prog(x, t1, t2)


def test_argument_updated_in_place_with_a_view_of_it_passed_too_is_refused() -> None:
    # eager's view sees the update; the graph's copy of it would not
    compiled = efx.compile(_update_then_read)
    assert torch.equal(compiled(torch.zeros(4), torch.zeros(2)), torch.zeros(2))
    t = torch.zeros(4)
    with pytest.raises(efx.UnsupportedMutationError, match="'b' is another view of the same memory"):
        compiled(t, t[:2])
    assert torch.equal(t, torch.zeros(4))  # refused before anything ran


def _leaf_aware(x):
    return x * (2.0 if x.is_leaf else 3.0)


def test_an_input_with_a_history_is_its_own_signature() -> None:
    """A tensor that requires grad and was computed (``x.is_leaf`` False) is not the leaf the program was
    captured for: code may look, and the trace follows what it saw."""
    compiled = efx.compile(_leaf_aware)
    x = torch.randn(3, requires_grad=True)
    for arg in (x, x * 1.0, x):
        got, want = compiled(arg), _leaf_aware(arg)
        torch.testing.assert_close(got, want)
        grads = [torch.autograd.grad(o.sum(), [x], retain_graph=True) for o in (got, want)]
        torch.testing.assert_close(*grads)
    assert compiled.stats.compiles == 2
    assert "requires_grad True -> non-leaf" in str(efx.explain(compiled))


class _ParameterViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("pos", torch.randn(1, 8))

    def forward(self, x):
        return x @ self.w.t() + self.pos[:, : x.shape[1]]


def test_compiled_under_inference_mode_like_eager() -> None:
    """Captured under ``torch.inference_mode()`` as under no_grad (views of a parameter failed with a raw
    RuntimeError: inference tensors have no version counter); the results are inference tensors."""
    model = _ParameterViews()
    compiled = efx.compile(model)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        want = model(x)
        for _ in range(3):
            got = compiled(x)
            torch.testing.assert_close(got, want)
            assert got.is_inference() and not got.requires_grad
    assert compiled(x).requires_grad  # grad mode: another signature, a training program
    assert compiled.stats.compiles == 2


class _View:
    def __init__(self, scale: float) -> None:
        self.scale = scale


class _Config:
    def __init__(self) -> None:
        self.scale = 2.0

    @property
    def view(self) -> _View:  # a new object at every read, as transformers' config.per_layer_config
        return _View(self.scale)


class _Viewed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _Config()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.config.view.scale


def test_a_property_making_a_new_object_per_read_is_guarded_by_what_is_read_through_it() -> None:
    """Once guarded by identity, which a fresh object fails at every call: every call captured again."""
    model = _Viewed()
    compiled = efx.compile(model)
    x = torch.randn(2, 3)
    for _ in range(3):
        assert torch.allclose(compiled(x), model.lin(x) * 2.0)
    assert compiled.stats.compiles == 1
    model.config.scale = 3.0  # read through the view: a guard of the program
    assert torch.allclose(compiled(x), model.lin(x) * 3.0) and compiled.stats.compiles == 2
