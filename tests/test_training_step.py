# ruff: noqa: E501  (golden graph text has long lines)
"""A whole training step compiled (Note [Training step]): ``loss.backward()``, gradient clipping, the
optimizer and effects in one program -- outputs, every parameter, gradient and optimizer state, and the
effect log against eager's after every step; the guards on the state a step starts from; the refusals."""

from __future__ import annotations

import copy
import re
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import effectfx as efx
import effectfx.testing  # noqa: F401  (registers the efxtest:: ops)
from effectfx.errors import DataDependentControlFlowError, EffectfxError, SignatureMismatchError
from effectfx.testing import hf
from effectfx.testing.effect_ops import recording

R = torch.ops.efxtest


def _small(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2))


def _step_of(model: nn.Module, opt: torch.optim.Optimizer, clip: bool = False,
             zero: Callable[[], None] | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        R.record_memory("forward")
        loss.backward()
        R.record_memory("backward")
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        (zero or opt.zero_grad)()
        R.log_tensor(loss.detach(), "loss")
        return loss

    return step


def _state_equal(m1: nn.Module, o1: torch.optim.Optimizer, m2: nn.Module, o2: torch.optim.Optimizer,
                 exact: bool) -> None:
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-5))
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert same(p, q), name
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert same(p.grad, q.grad), name
        assert o1.state[p].keys() == o2.state[q].keys(), name
        for key, value in o1.state[p].items():
            assert same(value, o2.state[q][key]), (name, key)


def _run_both(make_opt: Callable[[nn.Module], torch.optim.Optimizer], steps: int = 5, exact: bool = True,
              **options: Any) -> Any:
    m1, m2 = _small(), _small()
    o1, o2 = make_opt(m1), make_opt(m2)
    eager, compiled = _step_of(m1, o1, **options), efx.compile(_step_of(m2, o2, **options))
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(3, 4, generator=generator)
        with recording() as want:
            expected = eager(x)
        with recording() as got:
            out = compiled(x)
        assert got == want and len(want) == 3
        assert torch.equal(out, expected) if exact else torch.allclose(out, expected, rtol=1e-5)
        assert not out.requires_grad  # its graph was the step's backward's
        _state_equal(m1, o1, m2, o2, exact)
    return compiled


def test_sgd_with_momentum_is_bitwise_eager() -> None:
    compiled = _run_both(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), clip=True)
    # the first step makes the momentum buffers; one program serves every later step
    assert compiled.stats.compiles == 2


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_adam_matches_eager(cls: type, foreach: bool) -> None:
    compiled = _run_both(lambda m: cls(m.parameters(), lr=0.01, foreach=foreach), exact=False, clip=True)
    assert compiled.stats.compiles == 2


def test_zero_grad_keeping_the_tensors() -> None:
    holder: list[torch.optim.Optimizer] = []

    def make(m: nn.Module) -> torch.optim.Optimizer:
        holder.append(torch.optim.SGD(m.parameters(), lr=0.1))
        return holder[-1]

    m1, m2 = _small(), _small()
    o1, o2 = make(m1), make(m2)
    eager = _step_of(m1, o1, zero=lambda: o1.zero_grad(set_to_none=False))
    compiled = efx.compile(_step_of(m2, o2, zero=lambda: o2.zero_grad(set_to_none=False)))
    grads = None
    for k in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k))
        eager(x)
        compiled(x)
        _state_equal(m1, o1, m2, o2, exact=True)
        if k == 1:
            grads = [p.grad for p in m2.parameters()]
        elif k > 1:  # accumulated into in place, as eager's engine does: the very tensors
            assert all(p.grad is g for p, g in zip(m2.parameters(), grads))
    assert compiled.stats.compiles == 2


def test_gradients_accumulate_across_calls_without_zero_grad() -> None:
    m1, m2 = _small(), _small()

    def accumulate(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).sum()
            loss.backward()
            return loss
        return step

    eager, compiled = accumulate(m1), efx.compile(accumulate(m2))
    for k in range(4):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k))
        eager(x)
        compiled(x)
        for p, q in zip(m1.parameters(), m2.parameters()):
            assert torch.equal(p.grad, q.grad)
    assert compiled.stats.compiles == 2  # .grad None at the first call, a tensor to add into later


def test_a_changed_learning_rate_is_seen() -> None:
    m1, m2 = _small(), _small()
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    eager, compiled = _step_of(m1, o1), efx.compile(_step_of(m2, o2))
    for k in range(4):
        for opt in (o1, o2):
            opt.param_groups[0]["lr"] = 0.1 if k < 2 else 0.05
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k))
        eager(x)
        compiled(x)
        # a changed lr is an input (Note [Float inputs]): SGD's update is then a multiply and an add, not
        # eager's fused ``add_(alpha=-lr)``, equal to ~1 ulp
        _state_equal(m1, o1, m2, o2, exact=k < 2)
    assert compiled.stats.compiles == 2
    assert "param_groups" not in compiled.programs()[0].code()  # (a value: guarded, not an input)
    why = efx.explain(compiled).programs[1].why
    assert "0.1 -> 0.05" in why


def test_a_tensor_learning_rate_with_a_scheduler_outside_is_one_program() -> None:
    m1, m2 = _small(), _small()
    o1 = torch.optim.Adam(m1.parameters(), lr=torch.tensor(0.01))
    o2 = torch.optim.Adam(m2.parameters(), lr=torch.tensor(0.01))
    s1, s2 = (torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (o1, o2))
    eager, compiled = _step_of(m1, o1), efx.compile(_step_of(m2, o2))
    for k in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k))
        eager(x)
        compiled(x)
        s1.step()
        s2.step()
        _state_equal(m1, o1, m2, o2, exact=False)
    assert compiled.stats.compiles == 2


def test_hooks_on_parameter_gradients_run_as_in_eager() -> None:
    calls: dict[str, list[str]] = {"eager": [], "efx": []}

    def hooked(tag: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _small()
        model[0].weight.register_hook(lambda g: g * 2)  # a tensor hook changes the gradient
        model[2].bias.register_post_accumulate_grad_hook(lambda p: calls[tag].append("accumulated"))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    (m1, o1), (m2, o2) = hooked("eager"), hooked("efx")
    eager, compiled = _step_of(m1, o1), efx.compile(_step_of(m2, o2))
    for k in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k))
        eager(x)
        compiled(x)
        _state_equal(m1, o1, m2, o2, exact=True)
    # the post-accumulate hook runs in Python while the step is traced: once per capture, not per call
    assert calls["eager"] == ["accumulated"] * 3 and len(calls["efx"]) == compiled.stats.compiles


def test_backward_of_some_inputs_only() -> None:
    model, reference = _small(), _small()

    def step(m: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            loss = m(x).sum()
            loss.backward(inputs=[m[2].weight], retain_graph=True)
            return loss
        return run

    compiled = efx.compile(step(model))
    x = torch.randn(3, 4)
    compiled(x)
    step(reference)(x)
    assert model[0].weight.grad is None and reference[0].weight.grad is None
    assert torch.equal(model[2].weight.grad, reference[2].weight.grad)


@pytest.mark.parametrize(("kind", "backend"), [
    ("gpt2", "eager"), ("llama", "eager"), pytest.param("gpt2", "inductor", marks=pytest.mark.slow)])
def test_real_models_train_like_eager(kind: str, backend: str) -> None:
    """Five steps of AdamW with gradient clipping, a memory record per layer (a region), one after the
    backward and a loss log inside the step: one body per layer region, two programs."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer, Callable[..., Any]]:
        model = hf.build(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = model(**batch).loss
            loss.backward()
            R.record_memory("after backward")
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            R.log_tensor(loss.detach(), "loss")
            return loss

        return model, opt, step

    (m1, o1, eager), (m2, o2, step) = make(), make()
    compiled = efx.compile(step, backend=backend)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        batch = hf.batch(kind, generator)
        with recording() as want:
            expected = eager(batch)
        with recording() as got:
            out = compiled(batch)
        assert got[:-1] == want[:-1] and len(got) == hf.LAYERS + 2
        assert got[-1][:3] == want[-1][:3] and got[-1][3] == pytest.approx(want[-1][3], abs=1e-3)
        assert torch.allclose(out, expected, atol=1e-5)
        _state_equal(m1, o1, m2, o2, exact=False)
    assert compiled.stats.compiles == 2
    for prog in compiled.programs():
        assert list(prog.region_traces.values()) == [1]  # one trace of the layer serves every layer


# -- the graph ---------------------------------------------------------------------------------------------
STEP_GOLDEN = '''
def forward(self, token_memory, token_profiler, x, lifted, lifted_1):
    t = torch.ops.aten.t.default(lifted)
    addmm = torch.ops.aten.addmm.default(lifted_1, x, t)
    scale = torch.ops.efxtest.scale.default(addmm, 3.0)
    sum_1 = torch.ops.aten.sum.default(scale)
    with_effects = effectfx.ops.with_effects(token_memory, torch.ops.efxtest.record_memory.default, 'forward')
    getitem = with_effects[0]
    ones_like = torch.ops.aten.ones_like.default(sum_1, pin_memory = False)
    detach_1 = torch.ops.aten.detach.default(ones_like)
    expand = torch.ops.aten.expand.default(detach_1, [3, 2])
    with_effects_1 = effectfx.ops.with_effects(getitem, torch.ops.efxtest.record_memory.default, 'grad 3.0')
    getitem_1 = with_effects_1[0]
    mul = torch.ops.aten.mul.Tensor(expand, 3.0)
    t_1 = torch.ops.aten.t.default(mul)
    mm = torch.ops.aten.mm.default(t_1, x)
    t_2 = torch.ops.aten.t.default(mm)
    sum_2 = torch.ops.aten.sum.dim_IntList(mul, [0], True)
    view = torch.ops.aten.view.default(sum_2, [2])
    t_3 = torch.ops.aten.t.default(t_2)
    with_effects_2 = effectfx.ops.with_effects(getitem_1, torch.ops.efxtest.record_memory.default, 'backward')
    getitem_2 = with_effects_2[0]
    with_effects_3 = effectfx.ops.with_effects(token_profiler, torch.ops.effectfx.range_enter.default, 'Optimizer.step#SGD.step')
    getitem_3 = with_effects_3[0]
    _foreach_add = torch.ops.aten._foreach_add.List([lifted, lifted_1], [t_3, view], alpha = -0.5)
    getitem_4 = _foreach_add[0]
    getitem_5 = _foreach_add[1]
    with_effects_4 = effectfx.ops.with_effects(getitem_3, torch.ops.effectfx.range_exit.default)
    getitem_6 = with_effects_4[0]
    with_effects_5 = effectfx.ops.with_effects(getitem_2, torch.ops.efxtest.record_memory.default, 'updated')
    getitem_7 = with_effects_5[0]
    detach_2 = torch.ops.aten.detach.default(sum_1)
    return (getitem_7, getitem_6, detach_2, t_3, view, getitem_4, getitem_5)
'''


def _normalized(code: str) -> str:
    return re.sub(r"[ \t]+$", "", code.strip(), flags=re.M)


def test_golden_step_threads_one_token_chain_through_forward_backward_and_update() -> None:
    """A forward, its backward (an effect raised by an autograd formula: ``efxtest::scale``'s) and an SGD
    update (torch.optim's multi-tensor path: one node for every parameter): one ``memory`` chain through
    all three, in eager's order; the new parameters and gradients are outputs after the loss (the
    parameters written back, the gradients set as ``.grad``)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = R.scale(lin(x), 3.0).sum()
        R.record_memory("forward")
        loss.backward()
        R.record_memory("backward")
        opt.step()
        R.record_memory("updated")
        return loss

    x = torch.randn(3, 4)
    prog = efx.capture(step, x)
    assert _normalized(prog.code()) == _normalized(textwrap.dedent(STEP_GOLDEN))
    assert prog.token_keys == ("memory", "profiler")  # (the optimizer's record_function range)
    assert lin.weight.grad is None  # the capture leaves Python state as it found it


def test_a_captured_step_refuses_other_starting_state() -> None:
    lin = nn.Linear(4, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = lin(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    prog = efx.capture(step, torch.randn(3, 4))
    assert not opt.state  # nothing the trace made leaks into the optimizer
    prog(torch.randn(3, 4))  # the first step: momentum buffers made
    assert set(opt.state[lin.weight]) == {"momentum_buffer"}
    with pytest.raises(SignatureMismatchError, match="optimizer state"):
        prog(torch.randn(3, 4))
    with pytest.raises(EffectfxError, match="training step"):
        prog.save("/dev/null")


# -- refusals ----------------------------------------------------------------------------------------------
def _refused(fn: Callable[..., Any], *args: Any) -> str:
    with pytest.raises(EffectfxError) as info:
        efx.compile(fn)(*args)
    return str(info.value)


def test_loss_item_for_control_flow_names_the_line() -> None:
    lin = nn.Linear(4, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = lin(x).sum()
        loss.backward()
        if loss.item() > 0:  # the user's line
            opt.step()
        return loss

    with pytest.raises(DataDependentControlFlowError, match=r"if loss.item\(\) > 0"):
        efx.compile(step)(torch.randn(3, 4))


def test_backward_into_an_argument_is_refused() -> None:
    lin = nn.Linear(4, 2)
    message = _refused(lambda x: lin(x).sum().backward(), torch.randn(3, 4, requires_grad=True))
    assert "arguments" in message and "torch.autograd.grad" in message


@efx.region
def _backward_inside(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = lin(x).sum()
    loss.backward()
    return loss


def test_backward_inside_a_region_is_refused() -> None:
    lin = nn.Linear(4, 2)
    message = _refused(lambda x: _backward_inside(lin, x), torch.randn(3, 4))
    assert "region" in message and "outside the region" in message


def test_a_plain_forward_ignores_gradients_set_outside() -> None:
    """Without a backward or an optimizer inside, a compiled function is not guarded on ``.grad``: eager
    training around it never captures again."""
    model = _small()
    compiled = efx.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for k in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k))
        for m, o in ((compiled, opt), (reference, ref_opt)):
            m(x).sum().backward()
            o.step()
    assert compiled.stats.compiles == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))



@pytest.mark.parametrize("how", ["scheduler", "by hand"])
def test_python_state_changed_inside_is_refused_and_put_back(how: str) -> None:
    """An LR scheduler's step, or a decay written by hand: Python state no program replays."""
    lin = nn.Linear(4, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = lin(x).sum()
        loss.backward()
        opt.step()
        if how == "scheduler":
            sched.step()
        else:
            opt.param_groups[0]["lr"] *= 0.5
        return loss

    message = _refused(step, torch.randn(3, 4))
    assert "outside the compiled step" in message
    assert ("scheduler StepLR" in message and "sched.step()" in message if how == "scheduler"
            else "param_groups[0]['lr']" in message)
    assert opt.param_groups[0]["lr"] == 0.1 and lin.weight.grad is None and not opt.state


def test_micro_batches_accumulate_in_one_step() -> None:
    """Two backwards in one step (gradient accumulation): the second adds into the first's gradients."""
    m1, m2 = _small(), _small()
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def stepper(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], torch.Tensor]:
        def step(x: torch.Tensor) -> torch.Tensor:
            for part in x.chunk(2):
                (model(part).pow(2).mean() / 2).backward()
                R.record_memory("micro-batch")
            opt.step()
            opt.zero_grad()
            return x
        return step

    eager, compiled = stepper(m1, o1), efx.compile(stepper(m2, o2))
    for k in range(3):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(k))
        with recording() as want:
            eager(x)
        with recording() as got:
            compiled(x)
        assert got == want and len(got) == 2
        _state_equal(m1, o1, m2, o2, exact=True)
    assert compiled.stats.compiles == 1  # SGD without momentum keeps no state
