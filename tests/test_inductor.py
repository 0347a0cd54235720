"""efx.compile(fn, backend="inductor"), tier 1 (``tiers="tier1"``: a warm cache would start in tier 2,
tests/test_tiers.py): every region body (forward and backward) is compiled once, every
call site runs the compiled body, effects run in Python exactly where eager runs them.  Compared with eager:
outputs and gradients at Inductor tolerances, effect logs exactly, over 3 SGD steps.

Inductor compiles are slow on this machine (seconds each): the default run compiles only the tiny seed
program; the region scenarios and GPT-2 are ``slow`` (``pytest -m slow tests/test_inductor.py``)."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch import nn

import effectfx as efx
from effectfx import ops
from effectfx.backends import inductor
from effectfx.backends import inductor_cache as cache
from effectfx.backends import inductor_segments as segs
from effectfx.testing import recording
from effectfx.testing.differential import compare, run_eager, run_program

# a segment falling back to un-compiled aten would still pass the comparisons: here it is an error
pytestmark = pytest.mark.filterwarnings("error::effectfx.backends.inductor_segments.InductorFallbackWarning")

RTOL = ATOL = 1e-4  # Inductor reorders float arithmetic (fusions, decompositions)
STEPS = 3


@efx.region
def seed_region(x):
    torch.ops.efxtest.record_memory("N")
    return x + x


def seed(x):
    return seed_region(seed_region(x)).sin()


def check_inductor(fn, *args) -> None:
    eager = run_eager(fn, args)
    results = run_program(lambda f, a, k: efx.compile(f, backend="inductor", tiers="tier1"), fn, args, {},
                          calls=2)
    for i, result in enumerate(results):
        compare(f"inductor call {i + 1}", eager, result, RTOL, ATOL)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_seed(requires_grad: bool) -> None:
    check_inductor(seed, torch.randn(3, requires_grad=requires_grad))


def test_expanded_tangent() -> None:
    # sum().backward() hands backward a stride-0 tangent; compiled code was built for the traced layout
    x = torch.randn(3, requires_grad=True)
    seed(x).sum().backward()
    want, x.grad = x.grad, None
    efx.compile(seed, backend="inductor", tiers="tier1")(x).sum().backward()
    torch.testing.assert_close(x.grad, want, rtol=RTOL, atol=ATOL)


def test_a_detached_input_is_a_new_tensor() -> None:
    # Inductor returns an input as is for detach; eager returns a new tensor that requires no grad
    def f(x):
        return x.detach(), x * 2

    x = torch.randn(3, requires_grad=True)
    detached, doubled = efx.compile(f, backend="inductor", tiers="tier1")(x)
    assert detached is not x and not detached.requires_grad and torch.equal(detached, x)
    check_inductor(f, x)


def lowered_bodies(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The body each region call site of ``gm`` runs, in call order."""
    return [getattr(gm, n.args[0].target) for n in gm.graph.nodes if n.target is ops.invoke_subgraph]


def segments(gm: fx.GraphModule) -> list[segs.InductorSegment | segs.SymbolicSegment]:
    return [m for m in gm.children() if isinstance(m, (segs.InductorSegment, segs.SymbolicSegment))]


def test_region_body_is_compiled_once_and_effects_stay_in_python() -> None:
    cfn = efx.compile(seed, backend="inductor", tiers="tier1")
    cfn(torch.randn(3))
    (prog,) = cfn.programs()
    assert prog.history[-1].name == "lower_to_inductor"
    root = prog.graph_module
    first, second = lowered_bodies(root)
    assert first is second  # both call sites run one lowered body ...
    (body_segment,) = segments(first)  # ... whose pure part is one compiled segment
    assert body_segment.compiled is not None
    body = first.code
    assert "self.segment_0(" in body and body.index("record_memory") < body.index("segment_0(")
    # the root's one op after the calls is a tiny segment: it runs as it is (TINY_ROOT_SEGMENT)
    assert "segment_0(" not in root.code and "sin(" in root.code and "record_memory" not in root.code


# -- the region scenarios ---------------------------------------------------------------------------------
class Inner(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    @efx.region
    def forward(self, x):
        torch.ops.efxtest.record_stdout("inner")
        return torch.ops.efxtest.scale(torch.tanh(self.lin(x)), 0.5)  # records an effect in backward


class Outer(nn.Module):
    """A region calling a region, with effects on three keys, one of them reading a value Inductor
    computed and one returning a tensor the rest of the body uses (two segments)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = Inner(width)
        self.lin = nn.Linear(width, width)

    @efx.region
    def forward(self, x):
        torch.ops.efxtest.record_memory("outer")
        y = self.inner(x)
        torch.ops.efxtest.log_tensor(y, "y")
        z = torch.ops.efxtest.bump(y * 2, "z")
        torch.ops.efxtest.record_collective_tp("tp")
        return torch.relu(self.lin(z)) + x


class Model(nn.Module):
    def __init__(self, n: int = 3, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.outers = nn.ModuleList(Outer(width) for _ in range(n))
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for outer in self.outers:
            x = outer(x)
        with torch.no_grad():  # a region called under no_grad: an inference body inside training
            side = self.outers[0](x)
        torch.ops.efxtest.record_stdout("done")
        return self.head(x).sigmoid() * 2 + side


@dataclass
class Step:
    outputs: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    log: list[tuple]


def train(model: nn.Module, call: Callable, x: torch.Tensor, steps: int = STEPS) -> list[Step]:
    """``steps`` SGD steps; each records outputs, gradients (inputs and parameters) and effects."""
    params = [p for p in model.parameters() if p.requires_grad]
    wrt = ([x] if x.requires_grad else []) + params
    out = []
    for _ in range(steps):
        with recording() as log:
            y = call(x)
            grads = list(torch.autograd.grad(y, wrt, torch.linspace(-1, 1, y.numel()).reshape(y.shape),
                                             allow_unused=True)) if y.requires_grad else []
        out.append(Step([y.detach()], grads, list(log)))
        with torch.no_grad():
            for p, g in zip(params, grads[len(wrt) - len(params):]):
                if g is not None:
                    p.sub_(0.1 * g)
    return out


def assert_same_training(eager: list[Step], got: list[Step]) -> None:
    from effectfx.testing.differential import RunResult

    for i, (e, g) in enumerate(zip(eager, got)):
        compare(f"inductor step {i + 1}", RunResult(e.outputs, e.grads, e.log, []),
                RunResult(g.outputs, g.grads, g.log, []), RTOL, ATOL)


def train_both(build: Callable[[], nn.Module], x: torch.Tensor) -> tuple[list[Step], list[Step],
                                                                          efx.CompiledCallable]:
    eager_model = build()
    model = copy.deepcopy(eager_model)
    compiled = efx.compile(model, backend="inductor", tiers="tier1")
    eager = train(eager_model, eager_model, x)
    got = train(model, compiled, x)
    assert_same_training(eager, got)
    assert compiled.stats.compiles == 1
    return eager, got, compiled


@pytest.mark.slow
def test_nested_regions_several_keys_no_grad_and_backward_effects() -> None:
    x = torch.randn(2, 8, requires_grad=True)
    eager, _, compiled = train_both(Model, x)
    kinds = {entry[0] for entry in eager[0].log}
    assert {"record_memory", "record_stdout", "record_collective_tp", "log_tensor", "bump"} <= kinds
    assert ("record_memory", "grad 0.5") in eager[0].log  # an effect in backward
    (prog,) = compiled.programs()
    fwd = lowered_bodies(prog.forward.graph_module)
    assert len(fwd) == 4 and fwd[0] is fwd[1] is fwd[2] and fwd[3] is not fwd[0]  # training, no_grad
    assert len({id(b) for b in lowered_bodies(fwd[0])} | {id(b) for b in lowered_bodies(fwd[3])}) == 2
    assert len(segments(fwd[0])) == 2  # split by bump, which reads one and whose result the rest uses
    bwd = lowered_bodies(prog.backward.graph_module)
    assert len(bwd) == 3 and bwd[0] is bwd[1] is bwd[2] and segments(bwd[0])


@pytest.mark.slow
def test_inference_and_compiles_do_not_grow_with_call_sites() -> None:
    x = torch.randn(2, 8)
    counts = []
    for n in (1, 3):
        cache.clear_cache()
        before = cache.STATS.compiles + cache.STATS.loads  # loaded: compiled by an earlier run
        model = Model(n).requires_grad_(False)
        check_inductor(model, x)
        counts.append(cache.STATS.compiles + cache.STATS.loads - before)
    assert counts[0] == counts[1]


@pytest.mark.slow
def test_body_reused_across_signatures() -> None:
    @efx.region
    def body(x):
        torch.ops.efxtest.record_memory("body")
        return torch.sin(x) * 2

    def f(x, k):
        return body(x) * k

    compiled = efx.compile(f, backend="inductor", tiers="tier1")
    x = torch.randn(4)
    compiled(x, 2.0)
    stats = cache.STATS
    before = (stats.compiles + stats.loads, stats.hits)
    with recording() as log:
        got = compiled(x, 3.0)  # a new signature: the body's segment is found; the root's (one op) is tiny
    torch.testing.assert_close(got, f(x, 3.0))
    assert log == [("record_memory", "body")]
    assert compiled.stats.compiles == 2
    assert stats.compiles + stats.loads - before[0] == 0 and stats.hits - before[1] >= 1


@pytest.mark.slow
def test_random_ops_run_as_eager_runs_them() -> None:
    class Drop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @efx.region
        def forward(self, x):
            torch.ops.efxtest.record_memory("drop")
            return torch.nn.functional.dropout(torch.relu(self.lin(x)), 0.5)

    torch.manual_seed(0)
    model = nn.Sequential(Drop(), Drop())
    x = torch.randn(4, 8, requires_grad=True)
    compiled = efx.compile(model, backend="inductor", tiers="tier1")
    torch.manual_seed(1)
    eager = run_eager(model, (x,))
    torch.manual_seed(1)
    (got,) = run_program(lambda f, a, k: compiled, model, (x,), {})
    compare("inductor dropout", eager, got, RTOL, ATOL)  # the same draws from the global generator


@pytest.mark.slow
def test_gpt2_three_training_steps() -> None:
    from effectfx.testing import hf

    eager_model = hf.build("gpt2", seed=0)
    model = copy.deepcopy(eager_model)
    compiled = efx.compile(model, backend="inductor", tiers="tier1")
    ids = torch.randint(0, hf.VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    eager = train(eager_model, lambda i: eager_model(i, labels=i).loss, ids)
    got = train(model, lambda i: compiled(i, labels=i).loss, ids)
    assert_same_training(eager, got)
    (prog,) = compiled.programs()
    for half in (prog.forward, prog.backward):
        bodies = lowered_bodies(half.graph_module)
        assert len(bodies) == hf.LAYERS and all(b is bodies[0] for b in bodies)
        assert all(s.compiled is not None for s in segments(bodies[0]))


@pytest.mark.slow
def test_gpt2_over_four_lengths_compiles_each_body_once_more(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Symbolic sizes (Note [Symbolic shapes]): the first length is static, the second captures a
    symbolic program and compiles its bodies, the third its root's segments (deferred to their second
    run), for every length: the fourth compiles nothing."""
    from effectfx.testing import hf

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing saved: the counts are this run's
    cache.clear_cache()

    eager_model = hf.build("gpt2", seed=0)
    model = copy.deepcopy(eager_model)
    compiled = efx.compile(model, backend="inductor", tiers="tier1")
    generator = torch.Generator().manual_seed(1)
    compiled_segments = []
    for length in (8, 9, 12, 15):
        ids = torch.randint(0, hf.VOCAB, (2, length), generator=generator)
        eager = train(eager_model, lambda i: eager_model(i, labels=i).loss, ids, steps=1)
        got = train(model, lambda i: compiled(i, labels=i).loss, ids, steps=1)
        assert_same_training(eager, got)
        compiled_segments.append(cache.STATS.compiles + cache.STATS.loads)
    assert compiled.stats.compiles == 2
    assert compiled_segments[1] < compiled_segments[2] == compiled_segments[3]
    symbolic = compiled.programs()[-1]
    for half in (symbolic.forward, symbolic.backward):
        bodies = lowered_bodies(half.graph_module)
        assert len(bodies) == hf.LAYERS and all(b is bodies[0] for b in bodies)
        assert segments(bodies[0]) and all(s.compiled is not None for s in segments(bodies[0]))
    cache.clear_cache()


@pytest.mark.slow
def test_fuzzer_sample(tmp_path: Path) -> None:
    """Generated programs (nested regions, several keys, no_grad, backward effects, prints) through
    efx.compile with the Inductor backend: outputs, gradients and effect logs as eager's."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "effectfx", "fuzz", "--programs", "12", "--seed", "3",
                           "--backend", "inductor", "--forms", "token-free", "--out", str(tmp_path),
                           "--max-repros", "1", "--shrink-seconds", "30"],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "mismatches         : 0" in done.stdout


# -- fallbacks and refusals -------------------------------------------------------------------------------
def test_a_segment_inductor_cannot_compile_runs_uncompiled(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    import torch._inductor

    def refuse(*args, **kwargs):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(torch._inductor, "standalone_compile", refuse)
    monkeypatch.setattr(cache, "artifact_path", lambda source, inputs: tmp_path / "none.bin")
    cache.clear_cache()

    @efx.region
    def falls_back(x):
        torch.ops.efxtest.record_memory("fb")
        return x.cos() * 3

    def fn(x):
        return falls_back(falls_back(x))

    x = torch.randn(3, requires_grad=True)
    eager = run_eager(fn, (x,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (got,) = run_program(lambda f, a, k: efx.compile(f, backend="inductor", tiers="tier1"), fn, (x,), {})
    compare("fallback", eager, got)  # un-compiled: exactly the default backend's ops
    assert any(issubclass(w.category, segs.InductorFallbackWarning) and "falls_back" in str(w.message)
               and "no kernel for you" in str(w.message) for w in caught)
    cache.clear_cache()  # no refused segment survives into other tests


def test_a_new_process_loads_the_saved_segments() -> None:
    x = torch.randn(3)
    efx.compile(seed, backend="inductor", tiers="tier1")(x)  # compiles, or loads what an earlier run saved
    cache.clear_cache()  # what a new process starts with
    before = dataclasses.replace(cache.STATS)
    check_inductor(seed, x)
    assert cache.STATS.compiles == before.compiles and cache.STATS.loads > before.loads


def rooted(x):
    """The seed's regions between two root segments of more than TINY_ROOT_SEGMENT ops."""
    y = seed_region(seed_region((x * 2 + 1).tanh().sin() * 3))
    return (y.cos() * 2 - 1).exp().neg()


def test_the_roots_segments_compile_on_their_second_run(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # the first call runs the root's pure work un-compiled (the bodies compiled); the second compiles it;
    # every call is eager's: outputs, gradients, effects
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing saved: the root's deferred
    cache.clear_cache()
    x = torch.randn(3, requires_grad=True)
    eager = run_eager(rooted, (x,))
    cfn = efx.compile(rooted, backend="inductor", tiers="tier1")
    outcomes = []
    for i in range(3):
        (got,) = run_program(lambda f, a, k: cfn, rooted, (x,), {})
        compare(f"inductor call {i + 1}", eager, got, RTOL, ATOL)
        forward, backward = (cfn.programs()[0].forward.graph_module, cfn.programs()[0].backward.graph_module)
        outcomes.append([s.outcome for g in (forward, backward) for s in segments(g)])
    assert outcomes[0] == ["deferred"] * len(outcomes[0]) and len(outcomes[0]) >= 3
    assert outcomes[1] == outcomes[2] == ["compiled"] * len(outcomes[0])
    body = lowered_bodies(forward)[0]
    assert [s.outcome for s in segments(body)] == ["compiled"]  # a body's compile is never deferred

    # a process that finds them saved (the warm second process) runs them compiled from its first call
    cache.clear_cache()
    again = efx.compile(rooted, backend="inductor", tiers="tier1")
    (got,) = run_program(lambda f, a, k: again, rooted, (x,), {})
    compare("inductor, saved segments", eager, got, RTOL, ATOL)
    prog = again.programs()[0]
    assert [s.outcome for g in (prog.forward.graph_module, prog.backward.graph_module)
            for s in segments(g)] == ["loaded"] * len(outcomes[0])
    cache.clear_cache()


def test_needs_token_free_form() -> None:
    with pytest.raises(efx.BackendError, match="token-free"):
        inductor.lower_to_inductor(efx.capture(seed, torch.randn(3)))


def _loss_and_values(x):
    y = seed_region(x).sin()
    return y.sum(), x.cos()  # the second output's backward is not reached from the first's


def test_segments_compile_on_first_use_so_an_unused_full_backward_costs_nothing() -> None:
    # backpropagating the loss only takes the partial backward (Note [Partial backward]): the full
    # backward's segments, lowered with the program, never run and are never compiled
    x = torch.randn(3, requires_grad=True)
    compiled = efx.compile(_loss_and_values, backend="inductor", tiers="tier1")
    loss, _ = compiled(x)
    loss.backward()
    eager_x = x.detach().clone().requires_grad_()
    _loss_and_values(eager_x)[0].backward()
    torch.testing.assert_close(x.grad, eager_x.grad, rtol=RTOL, atol=ATOL)
    (prog,) = compiled.programs()
    assert segments(prog.backward.graph_module)  # lowered ...
    assert all(s._found is None for s in segments(prog.backward.graph_module))  # ... never compiled
    partial, _ = next(iter(prog.partial.values()))
    assert all(s._found is not None for s in segments(partial.graph_module))
