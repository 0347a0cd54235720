"""Tiered compilation (``effectfx.backends.tiers``): tier 2 -- the program with its regions inlined
(``effectfx.backends.inline``), lowered as one Inductor graph per half -- replaces tier 1 at a call
boundary.  Compared with eager on every call around the switch: outputs and gradients at Inductor's
tolerance, effect logs exactly; a backward of a forward run under tier 1 still runs tier 1's backward.

Inductor compiles take seconds here: the default run compiles a tiny program; GPT-2 is ``slow``."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

import effectfx as efx
from effectfx import ops
from effectfx.backends import inductor_cache as cache
from effectfx.backends import tiers
from effectfx.backends.inline import inline_regions
from effectfx.backends.tiers import TierState, segments
from effectfx.drivers.callable import BACKEND_PASSES
from effectfx.drivers.capture import trace_program
from effectfx.errors import BackendError
from effectfx.passes.pipeline import run_passes
from effectfx.testing import recording

pytestmark = pytest.mark.filterwarnings("error::effectfx.backends.inductor_segments.InductorFallbackWarning")

RTOL = ATOL = 1e-4
R = torch.ops.efxtest


@efx.region
def inner(x):
    R.record_memory("inner")
    return x.sin() * 2


@efx.region
def outer(x):
    R.log_tensor(x, "outer")
    y = inner(x) + inner(x * 3)
    R.record_memory("outer done")
    return y


def nested(x):
    return outer(outer(x)).sum()


def tiers_of(compiled: Any) -> TierState:
    (entry,) = [e for es in compiled.cache.values() for e in es]
    assert entry.tiers is not None
    return entry.tiers


# -- the inlined graph ------------------------------------------------------------------------------------
GOLDEN_FORWARD = """
def forward(self, x):
    log_tensor_default = torch.ops.efxtest.log_tensor.default(x, 'outer')
    record_memory_default = torch.ops.efxtest.record_memory.default('inner')
    sin = torch.ops.aten.sin.default(x)
    mul = torch.ops.aten.mul.Tensor(sin, 2)
    mul_1 = torch.ops.aten.mul.Tensor(x, 3)
    record_memory_default_1 = torch.ops.efxtest.record_memory.default('inner')
    sin_1 = torch.ops.aten.sin.default(mul_1)
    mul_2 = torch.ops.aten.mul.Tensor(sin_1, 2)
    add = torch.ops.aten.add.Tensor(mul, mul_2)
    record_memory_default_2 = torch.ops.efxtest.record_memory.default('outer done')
    log_tensor_default_1 = torch.ops.efxtest.log_tensor.default(add, 'outer')
    record_memory_default_3 = torch.ops.efxtest.record_memory.default('inner')
    sin_2 = torch.ops.aten.sin.default(add)
    mul_3 = torch.ops.aten.mul.Tensor(sin_2, 2)
    mul_4 = torch.ops.aten.mul.Tensor(add, 3)
    record_memory_default_4 = torch.ops.efxtest.record_memory.default('inner')
    sin_3 = torch.ops.aten.sin.default(mul_4)
    mul_5 = torch.ops.aten.mul.Tensor(sin_3, 2)
    add_1 = torch.ops.aten.add.Tensor(mul_3, mul_5)
    record_memory_default_5 = torch.ops.efxtest.record_memory.default('outer done')
    sum_1 = torch.ops.aten.sum.default(add_1)
    return (sum_1, x, add, mul_1, mul_4)
"""

GOLDEN_BACKWARD = """
def forward(self, x, getitem, getitem_1, getitem_3, tangent_0):
    expand = torch.ops.aten.expand.default(tangent_0, [3])
    clone = torch.ops.aten.clone.default(expand, memory_format = torch.contiguous_format)
    mul_1 = torch.ops.aten.mul.Tensor(clone, 2)
    cos = torch.ops.aten.cos.default(getitem_3)
    mul_2 = torch.ops.aten.mul.Tensor(mul_1, cos)
    mul_3 = torch.ops.aten.mul.Tensor(mul_2, 3)
    mul_4 = torch.ops.aten.mul.Tensor(clone, 2)
    cos_1 = torch.ops.aten.cos.default(getitem)
    mul_5 = torch.ops.aten.mul.Tensor(mul_4, cos_1)
    add_1 = torch.ops.aten.add.Tensor(mul_3, mul_5)
    mul_6 = torch.ops.aten.mul.Tensor(add_1, 2)
    cos_2 = torch.ops.aten.cos.default(getitem_1)
    mul_7 = torch.ops.aten.mul.Tensor(mul_6, cos_2)
    mul_8 = torch.ops.aten.mul.Tensor(mul_7, 3)
    mul_9 = torch.ops.aten.mul.Tensor(add_1, 2)
    cos_3 = torch.ops.aten.cos.default(x)
    mul_10 = torch.ops.aten.mul.Tensor(mul_9, cos_3)
    add_2 = torch.ops.aten.add.Tensor(mul_8, mul_10)
    return (add_2,)
"""


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines() if line.strip())


def test_inlined_graph_golden() -> None:
    """Nested regions (outer calls inner twice) called twice: every body's nodes in place of its call, in
    program order -- effects included, each where eager runs it -- and the same inputs and outputs (the
    saved values too) as the program with regions."""
    x = torch.randn(3, requires_grad=True)
    token_free = run_passes(trace_program(nested, (x,), {}), BACKEND_PASSES["inductor"][:-1])
    inlined = token_free.map(inline_regions)
    for half, golden, before in ((inlined.forward, GOLDEN_FORWARD, token_free.forward),
                                 (inlined.backward, GOLDEN_BACKWARD, token_free.backward)):
        assert _normalized(half.code()) == _normalized(golden)
        assert not any(n.target is ops.invoke_subgraph for n in half.graph_module.graph.nodes)
        assert not list(half.subgraphs())
        assert [n.name for n in half.graph_module.graph.find_nodes(op="placeholder")] == \
            [n.name for n in before.graph_module.graph.find_nodes(op="placeholder")]
        assert len(next(reversed(half.graph_module.graph.nodes)).args[0]) == \
            len(next(reversed(before.graph_module.graph.nodes)).args[0])


def test_inline_needs_the_token_free_form() -> None:
    x = torch.randn(3)
    with pytest.raises(BackendError, match="token-free"):
        inline_regions(trace_program(nested, (x,), {}))


# -- the switch -------------------------------------------------------------------------------------------
def _call(fn: Callable, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    with recording() as log:
        y = fn(x)
        (g,) = torch.autograd.grad(y, [x])
    return y.detach(), g, list(log)


def _same(what: str, got: tuple, want: tuple) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=ATOL, msg=f"{what}: output")
    torch.testing.assert_close(got[1], want[1], rtol=RTOL, atol=ATOL, msg=f"{what}: gradient")
    assert got[2] == want[2], f"{what}: effect log"


def test_at_once_switches_at_a_call_boundary_and_a_warm_process_starts_in_tier_2() -> None:
    x = torch.randn(3, requires_grad=True)
    want = _call(nested, x)
    compiled = efx.compile(nested, backend="inductor", tiers=efx.Tiers("at-once", after=2))
    for call in range(1, 5):
        _same(f"call {call}", _call(compiled, x), want)
        state = tiers_of(compiled)
        assert state.tier == (1 if call <= 2 else 2), call
    assert state.switched_call == 3 and state.started_call == 3 and state.error is None
    (prog,) = compiled.programs()
    for half in (prog.forward, prog.backward):  # the whole half: one segment, no region left
        assert not any(n.target is ops.invoke_subgraph for n in half.graph_module.graph.nodes)
    assert len(segments(prog)) == 2 and all(s.compiled is not None for s in segments(prog))
    assert all(dict(cache.options_of(s.source)) == {} for s in segments(prog))  # Python's wrapper
    assert "runs tier 2 (regions inlined) since call 3" in str(efx.explain(compiled))

    # a forward run under tier 1, its backward after the switch: tier 1's backward, eager's gradient
    fresh = efx.compile(nested, backend="inductor", tiers=efx.Tiers("at-once", after=1))
    with recording() as log:
        y1 = fresh(x)  # tier 1
        y2 = fresh(x)  # the switch
        (g1,) = torch.autograd.grad(y1, [x])
        (g2,) = torch.autograd.grad(y2, [x])
    assert tiers_of(fresh).switched_call == 2
    assert log == want[2] * 2
    torch.testing.assert_close(g1, want[1], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(g2, want[1], rtol=RTOL, atol=ATOL)

    # a new process finds every tier-2 segment saved: it starts in tier 2 (here: the process cache cleared)
    cache.clear_cache()
    warm = efx.compile(nested, backend="inductor")
    _same("warm call 1", _call(warm, x), want)
    state = tiers_of(warm)
    assert state.tier == 2 and state.switched_call == 1 and state.outcomes == {"loaded": 2}


def test_a_warm_start_does_not_build_a_tier_2_no_process_saved(tmp_path: Any,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A run too short to build tier 2 (Note [When tier 2 pays]) leaves no tier 2 for the next process: its
    first call finds no marker and does not build tier 2 only to learn that nothing is saved."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(3, requires_grad=True)
    want = _call(nested, x)
    compiled = efx.compile(nested, backend="inductor")
    _same("call 1", _call(compiled, x), want)
    state = tiers_of(compiled)
    assert state.tier == 1 and state._tier2 is None and state.started_call is None


def two_outputs(x):
    y = outer(x)
    return y.sum(), y * 2


def test_partial_backward_under_tier_2_runs_tier_1s() -> None:
    x = torch.randn(3, requires_grad=True)
    compiled = efx.compile(two_outputs, backend="inductor", tiers="at-once")
    total, _ = compiled(x)
    assert tiers_of(compiled).tier == 2
    (got,) = torch.autograd.grad(total, [x])  # the second output gets no gradient (Note [Partial backward])
    (want,) = torch.autograd.grad(two_outputs(x)[0], [x])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_background_switches_at_a_call_boundary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "is_cached", lambda *args: False)  # a cold process: no start in tier 2
    x = torch.randn(3, requires_grad=True)
    want = _call(nested, x)
    compiled = efx.compile(nested, backend="inductor", tiers=efx.Tiers("background", after=2))
    for call in range(1, 3):
        _same(f"call {call}", _call(compiled, x), want)
    _same("call 3", _call(compiled, x), want)  # starts the build, runs tier 1
    state = tiers_of(compiled)
    assert state.started_call == 3 and state.tier == 1
    assert "tier 2 building since call 3" in str(efx.explain(compiled)) or state.wait(0)
    assert state.wait(300), state.error
    assert state.tier == 1  # ready, not yet used: the switch waits for a call's start
    for call in range(4, 6):
        _same(f"call {call}", _call(compiled, x), want)
    assert state.tier == 2 and state.switched_call == 4


def test_by_default_tier_2_is_built_once_the_calls_paid_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [When tier 2 pays]: past the 10th call, the build waits until the calls since the 11th took its
    price, twice tier 1's compiles of the program (a clock the test sets)."""
    monkeypatch.setattr(cache, "is_cached", lambda *args: False)  # a cold process: no start in tier 2
    now = [0.0]
    monkeypatch.setattr(tiers, "_clock", lambda: now[0])
    x = torch.randn(3, requires_grad=True)
    want = _call(nested, x)
    compiled = efx.compile(nested, backend="inductor")  # the default tiers
    for call in range(1, 12):
        _same(f"call {call}", _call(compiled, x), want)
    state = tiers_of(compiled)
    assert state.started_call is None and state.budget_s is not None and state.budget_s > 0
    assert "tier 2 once its calls since call 11 take" in str(efx.explain(compiled))
    now[0] = state.budget_s * 0.99
    _same("call 12", _call(compiled, x), want)
    assert state.started_call is None
    now[0] = state.budget_s
    _same("call 13", _call(compiled, x), want)  # starts the build, runs tier 1
    assert state.started_call == 13 and state.wait(300), state.error
    _same("call 14", _call(compiled, x), want)
    assert state.tier == 2 and state.switched_call == 14


def test_a_warm_process_prices_tier_2_by_the_compiles_it_loaded(tmp_path: Any,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [When tier 2 pays]: tier 1's segments loaded from the cache count the seconds their compile took
    in the process that saved them, not the time loading them took."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    x = torch.randn(3, requires_grad=True)
    budgets = []
    for process in ("cold", "warm"):
        cache.clear_cache()  # (a new process: nothing compiled in it)
        compiled = efx.compile(nested, backend="inductor")
        for _ in range(11):
            _call(compiled, x)
        state = tiers_of(compiled)
        assert state.started_call is None, process
        outcomes = {s.outcome for s in segments(state.tier1)}
        assert (outcomes == {"loaded"}) == (process == "warm"), outcomes
        budgets.append(state.budget_s)
    cold, warm = budgets
    assert cold > 0.2 and warm == pytest.approx(cold, abs=0.02)  # (loading took ~0.05 s)


@pytest.mark.parametrize("tier2_ms", [1.0, 3.0])
def test_a_tier_2_slower_than_tier_1_goes_back_to_tier_1(tier2_ms: float,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [When tier 2 pays]: after the default switch, tier 2's calls are timed against tier 1's last ones
    (a clock the test sets: 2 ms a call in tier 1); a slower tier 2 is dropped, at a call boundary, with
    eager's results throughout."""
    monkeypatch.setattr(cache, "is_cached", lambda *args: False)
    now = [0.0]
    monkeypatch.setattr(tiers, "_clock", lambda: now[0])
    x = torch.randn(3, requires_grad=True)
    want = _call(nested, x)
    compiled = efx.compile(nested, backend="inductor")
    calls = 0

    def call(ms: float) -> None:
        nonlocal calls
        calls += 1
        _same(f"call {calls}", _call(compiled, x), want)
        now[0] += ms / 1e3

    for _ in range(11):
        call(2.0)
    state = tiers_of(compiled)
    state.budget_s = 0.02  # (the price: ten calls' worth here)
    while state.started_call is None:
        call(2.0)
    assert state.wait(300), state.error
    for _ in range(8):
        call(tier2_ms)
    if tier2_ms < 2.0:
        assert state.tier == 2 and state.compared_ms == pytest.approx((2.0, 1.0))
        assert "1.00 ms a call against tier 1's 2.00" in str(efx.explain(compiled))
    else:
        assert state.tier == 1 and "tier 2 was slower than tier 1 (3.00 against 2.00 ms" in str(state.error)
        assert "tier 2 not used: tier 2 was slower" in str(efx.explain(compiled))


def test_the_cpp_wrapper_is_an_option() -> None:
    x = torch.randn(3, requires_grad=True)
    want = _call(nested, x)
    compiled = efx.compile(nested, backend="inductor", tiers=efx.Tiers("at-once", cpp_wrapper=True))
    _same("call 1", _call(compiled, x), want)
    (prog,) = compiled.programs()
    assert tiers_of(compiled).tier == 2
    assert all(dict(cache.options_of(s.source)) == {"cpp_wrapper": True} for s in segments(prog))


def test_modes() -> None:
    assert efx.compile(nested, backend="inductor", tiers="tier1").tiers is None
    assert efx.compile(nested).tiers is None  # the default backend has one tier
    assert efx.compile(nested, backend="inductor").tiers == efx.Tiers("background")
    assert efx.Tiers("background").threshold == 10 and efx.Tiers("at-once").threshold == 0
    assert not efx.Tiers().cpp_wrapper  # Python's wrapper: a whole step's C++ wrapper compiles for minutes
    with pytest.raises(BackendError, match="tiers mode"):
        efx.compile(nested, backend="inductor", tiers="sometimes")
    with pytest.raises(BackendError, match="number of calls"):
        efx.Tiers("at-once", after=-1)


# -- GPT-2 ------------------------------------------------------------------------------------------------
def _gpt2() -> torch.nn.Module:
    import transformers

    from effectfx.testing import hf

    config = transformers.GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     attn_implementation="eager", bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return hf.log_layers(model, "gpt2")  # a region per layer, recording its name first


@pytest.mark.slow
def test_gpt2_training_across_the_switch() -> None:
    """5 SGD steps, tier 2 from the third: loss, every gradient and the effect log of each step as eager's."""
    eager_model = _gpt2()
    model = copy.deepcopy(eager_model)
    compiled = efx.compile(model, backend="inductor", tiers=efx.Tiers("at-once", after=2))
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    for step in range(1, 6):
        results = []
        for m, f in ((eager_model, eager_model), (model, compiled)):
            with recording() as log:
                loss = f(ids, labels=ids).loss
                loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in m.parameters()], list(log)))
            with torch.no_grad():
                for p in m.parameters():
                    p.sub_(0.1 * p.grad)
                    p.grad = None
        (want_loss, want_grads, want_log), (loss, grads, log) = results
        assert log == want_log == [("record_memory", "layer0"), ("record_memory", "layer1")], step
        torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=ATOL)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)
        assert tiers_of(compiled).tier == (1 if step <= 2 else 2)
    (prog,) = compiled.programs()
    assert not list(prog.forward.subgraphs()) and not list(prog.backward.subgraphs())
    assert len(segments(prog)) == 2  # the layers' effects only read labels: one segment per half


@pytest.mark.slow
def test_gpt2_symbolic_program_gets_a_tier_2() -> None:
    """dynamic=True: one symbolic program serves three lengths; its tier 2 too (sizes read from inputs)."""
    eager_model = _gpt2()
    model = copy.deepcopy(eager_model)
    compiled = efx.compile(model, backend="inductor", dynamic=True, tiers="at-once")
    for length in (8, 12, 5):
        ids = torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(length))
        with recording() as log:
            loss = compiled(ids, labels=ids).loss
            loss.backward()
        want = eager_model(ids, labels=ids).loss
        want.backward()
        assert log == [("record_memory", "layer0"), ("record_memory", "layer1")]
        torch.testing.assert_close(loss, want, rtol=RTOL, atol=ATOL)
        for p, w in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p.grad, w.grad, rtol=1e-3, atol=1e-4)
            p.grad = w.grad = None
    state = tiers_of(compiled)
    assert state.tier == 2 and state.switched_call == 1
