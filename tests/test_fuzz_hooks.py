"""Module hooks in generated programs (``effectfx.testing.module_hooks``): the generator draws each kind of
hook, the renderer prints them as standalone source, the harness registers and removes hooks between the
calls of a compiled program as it does on eager's, and a compiled program that would not see such a change
is caught.  Also the minimized reproducers of what the first 2000-program run with hooks found (xfail:
bugs of effectfx's core, reported, not yet fixed)."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings

import effectfx as efx
from effectfx.testing import run_eager
from effectfx.testing.checking import _candidates, check_program, reproducer_source
from effectfx.testing.differential import StartingState, fresh_args, run_sequence
from effectfx.testing.generator import programs
from effectfx.testing.module_hooks import HookSpec
from effectfx.testing.program import Body, ProgramSpec, RegionSpec, Stmt, load_source
from effectfx.testing.render import build, render

HOOK_FEATURES = [
    "hook:forward", "hook:pre", "hook:backward", "hook on blocks", "hook on blocks.lin",
    "hook on blocks.ident", "hook on lin", "hook on ident", "hook on model", "hook effect:log",
    "hook effect:record", "hook effect:ping", "hook effect:bump", "hook effect:none", "hook returns a value",
    "hook sharing:own", "hook sharing:equal", "hook sharing:one", "hook added between calls",
    "hook removed between calls", "hook inside a region", "child:lin", "child:ident",
    "blocks called as modules",
]


@functools.cache
def sample(n: int = 300, exclude: tuple[str, ...] = ("random", "noted", "shifted")) -> list[ProgramSpec]:
    """The first ``n`` programs hypothesis generates (no shrinking, deterministic); without dropout,
    checkpointing and efx.callback's statements by default (tests/test_fuzz.py covers them), so the hooks
    drawn stay those counted here."""
    found: list[ProgramSpec] = []

    @settings(max_examples=n, database=None, deadline=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(programs(exclude=exclude))
    def collect(spec: ProgramSpec) -> None:
        found.append(spec)

    collect()
    return found


def test_generator_draws_every_kind_of_hook() -> None:
    seen: Counter[str] = Counter()
    for spec in sample():
        seen.update(spec.features())
    missing = [f for f in HOOK_FEATURES if seen[f] == 0]
    assert not missing, f"never generated: {missing}\n{seen}"
    with_hooks = [spec for spec in sample() if spec.hooks]
    assert len(with_hooks) >= 50
    assert seen["hook inside a region"] >= 20 and seen["hook added between calls"] >= 20


def test_generated_hooks_are_well_formed() -> None:
    for spec in sample():
        src = render(spec)
        for i, h in enumerate(spec.hooks):
            assert f"def hook{i}(name, s):" in src
            if h.target == "model":  # efx.capture(model) traces forward, not the hooks around it: only late
                assert h.added >= 1
            if h.target.startswith("blocks"):
                assert h.layers and max(h.layers) < len(spec.blocks)
                assert any(s.kind == "blocks" for s in spec.forward.stmts)
            else:
                assert not h.layers
            if h.target.startswith("blocks."):
                assert h.target.split(".")[1] in spec.children("block")
            if h.kind == "backward":
                assert h.effect != "bump"
            assert h.effect or h.s is not None  # it does something
            assert h.removed == 0 or h.removed > h.added
        assert ("def between(model, call):" in src) == bool(spec.sequence())


def test_exclude_hooks() -> None:
    for spec in sample(100, exclude=("hook",)):
        assert not spec.hooks and "_hook(" not in render(spec)
    for spec in sample(100, exclude=("backward_hook", "late_hook", "child")):
        assert all(h.kind != "backward" and not h.added and not h.removed for h in spec.hooks)
        assert not any(s.kind == "child" for _, b in spec.bodies() for s in b.stmts)


# -- a small program with hooks, printed --------------------------------------------------------------------
def _hooked_spec() -> ProgramSpec:
    """Two blocks called as modules, whose region calls a Linear child: a forward hook on each child logs
    its layer's name and scales the output by its layer's number; one pre-hook function on both blocks
    records, registered between calls 1 and 2 and removed before call 3."""
    step = Body(("x0",), (Stmt("child", "lin", ("x0",), ("v0",)), Stmt("unary", "tanh", ("v0",), ("v1",))),
                ("v1",))
    forward = Body(("x0",), (Stmt("blocks", "call", ("x0",), ("v0",)),), ("v0",))
    hooks = (HookSpec("blocks.lin", "forward", "log", 0.5, "own", (0, 1)),
             HookSpec("blocks", "pre", "record", None, "one", (0, 1), added=1, removed=2))
    return ProgramSpec(2, 4, ("memory", "stdout"), (True,), (), 0, (), forward, 3, (True, True), step, hooks)


GOLDEN = '''\
"""A program generated by effectfx.testing.generator (python -m effectfx fuzz)."""
import sys

import torch

import effectfx as efx
import effectfx.testing  # noqa: F401  (registers the efxtest:: effect ops)
import effectfx.testing.fuzz_ops  # noqa: F401  (registers the efxfuzz:: ops)

B, D = 2, 4
_g = torch.Generator().manual_seed(3)


def linear(g):
    """A torch.nn.Linear(D, D) with weights from ``g``."""
    lin = torch.nn.utils.skip_init(torch.nn.Linear, D, D)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(D, D, generator=g) / D ** 0.5)
        lin.bias.copy_(torch.randn(D, generator=g) / D ** 0.5)
    return lin


class Block(torch.nn.Module):
    def __init__(self, seed, requires_grad):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(D, D, generator=g) / D ** 0.5, requires_grad=requires_grad)
        self.lin = linear(g)

    @efx.region
    def step(self, x0):
        v0 = self.lin(x0)
        v1 = torch.tanh(v0)
        return v1

    forward = step  # blk(x): the region, with the module's hooks around it


class Fuzzed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.blocks = torch.nn.ModuleList([Block(13, True), Block(14, True)])

    def forward(self, x0):
        v0 = x0
        for blk in self.blocks:
            v0 = blk(v0)
        return v0


def hook0(name, s):
    """A forward hook on blocks.lin: logs out, returns out times s."""
    def hook(module, args, out):
        torch.ops.efxtest.log_tensor(out, name)
        return out * s
    return hook


def hook1(name, s):
    """A forward pre-hook on blocks: records its name."""
    def hook(module, args):
        torch.ops.efxtest.record_memory(name)
    return hook


def register(model, hook):
    """Registers hook ``hook`` on its modules; returns the handles (make, between call it)."""
    if hook == 0:
        return [model.blocks[0].lin.register_forward_hook(hook0("hook0 blocks.0.lin", 0.5)),
                model.blocks[1].lin.register_forward_hook(hook0("hook0 blocks.1.lin", 1.0))]
    if hook == 1:
        shared = hook1("hook1 blocks", None)  # one function on every layer
        return [model.blocks[0].register_forward_pre_hook(shared),
                model.blocks[1].register_forward_pre_hook(shared)]
    raise ValueError(hook)


def between(model, call):
    """Before call ``call`` (1, 2, ...) of a sequence the harness registers and removes hooks,
    on the eager model and on the compiled one alike (effectfx.testing.sequence)."""
    if call == 1:
        model.hook_handles[1] = register(model, 1)
    if call == 2:
        for handle in model.hook_handles.pop(1):
            handle.remove()


def make(variant=0):
    model = Fuzzed()
    g = torch.Generator().manual_seed(5 + 1000 * variant)
    args = (
        torch.randn(B, D, generator=g).requires_grad_(True),
    )
    model.hook_handles = {hook: register(model, hook) for hook in (0,)}
    return model, args
'''


def test_a_program_with_hooks_prints_as_expected() -> None:
    spec = _hooked_spec()
    assert render(spec) == GOLDEN
    assert spec.sequence() == 3 and spec.children("block") == ["lin"] and spec.children("model") == []
    assert {"hook:forward", "hook:pre", "hook on blocks.lin", "hook on blocks", "hook inside a region",
            "hook sharing:own", "hook sharing:one", "hook added between calls", "hook removed between calls",
            "hook effect:log", "hook effect:record", "hook returns a value", "child:lin",
            "blocks called as modules"} <= spec.features()


def test_a_program_with_hooks_runs_as_printed() -> None:
    """Each layer logs its own name, with its output scaled by its own number; between the calls the
    pre-hook comes and goes, on eager's model and on the compiled one alike."""
    spec = _hooked_spec()
    model, args = build(spec)
    eager = run_eager(model, args)
    assert [e[1] for e in eager.log] == ["hook0 blocks.0.lin", "hook0 blocks.1.lin"]
    outcome = check_program(spec)
    assert not outcome.failures, outcome.report()
    forms = 4  # captured, functionalized, unlifted, token-free: twice each; compile 5 times; 3 calls changed
    assert outcome.comparisons >= 2 * forms + 3 + spec.sequence()


def test_the_reproducer_with_hooks_is_standalone(tmp_path: Any) -> None:
    path = tmp_path / "repro.py"
    text = reproducer_source(_hooked_spec(), "a note")
    assert "check_model(make, backend='eager', refusal=None, between=between, sequence=3)" in text
    path.write_text(text)
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok:" in done.stdout


# -- the harness catches a compiled program that misses a hook change ---------------------------------------
class _CapturedOnce:
    """A deliberately broken ``efx.compile``: captures on the first call and runs that program ever after,
    blind to hooks registered or removed since."""

    class stats:  # noqa: N801  (read as ``cfn.stats.compiles``)
        compiles = 1

    def __init__(self, fn: Any, backend: str = "eager") -> None:
        self.fn, self.prog = fn, None

    def __call__(self, *args: Any) -> Any:
        if self.prog is None:
            self.prog = efx.capture(self.fn, *args)
        return self.prog(*args)


def test_a_compiled_program_blind_to_hook_changes_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _hooked_spec()
    assert not check_program(spec, forms=()).failures
    monkeypatch.setattr(efx, "compile", _CapturedOnce)
    outcome = check_program(spec, forms=())
    assert outcome.kinds() == {"effect logs differ [compile, hooks changed between calls]"}, outcome.report()
    assert "'hook1 blocks'" in outcome.report()


def test_between_changes_the_hooks_of_the_calls_that_follow() -> None:
    """Eager's log of each call of the sequence, as ``between`` registers and removes the pre-hook."""
    spec = _hooked_spec()
    namespace = load_source(render(spec))
    model, args = namespace["make"](0)
    logs = []
    for k in range(spec.sequence()):
        if k:
            namespace["between"](model, k)
        (result,) = run_sequence(model, model, fresh_args(args), StartingState(()), 1)
        logs.append([e[1] for e in result.log])
    layers = ["hook0 blocks.0.lin", "hook0 blocks.1.lin"]
    assert logs == [layers, ["hook1 blocks", layers[0], "hook1 blocks", layers[1]], layers]


# -- shrinking ------------------------------------------------------------------------------------------
def _runs_in_eager(spec: ProgramSpec) -> None:
    """``spec`` builds and runs in eager, through its sequence of hook changes too."""
    namespace = load_source(render(spec))
    model, args = namespace["make"](0)
    try:
        for k in range(max(spec.sequence(), 1)):
            if k:
                namespace["between"](model, k)
            run_sequence(model, model, fresh_args(args), StartingState(()), 1)
    except RuntimeError as exc:  # (a candidate may update a leaf that requires grad: to be refused)
        if "leaf Variable that requires grad" not in str(exc):
            raise
        assert spec.refusal() == "UnsupportedMutationError", render(spec)


def test_every_shrink_candidate_of_a_program_with_hooks_runs() -> None:
    hooked = [spec for spec in sample() if spec.hooks and spec.refusal() is None][:10]
    assert len(hooked) == 10
    for spec in hooked:
        for candidate in _candidates(spec):
            assert all(h.added >= 1 for h in candidate.hooks if h.target == "model")
            _runs_in_eager(candidate)


# -- found by ``effectfx fuzz --programs 2000 --seed 0`` with the hooks in (bugs of effectfx's core) --------
def _unused_input_spec() -> ProgramSpec:
    """Minimized: a full backward hook registered on the program module between two calls; forward's second
    input requires grad and the output does not depend on it."""
    step = Body(("x0",), (Stmt("child", "lin", ("x0",), ("v0",)),), ("v0",))
    forward = Body(("x0", "x1"), (Stmt("blocks", "call", ("x0",), ("v0",)),), ("v0",))
    hooks = (HookSpec("model", "backward", "ping", added=1),)
    return ProgramSpec(2, 4, ("memory",), (False, True), (), 0, (), forward, 780, (False,), step, hooks)


def test_a_full_backward_hook_with_an_unused_input() -> None:
    """Was: the model's full backward hook fired (with its effect) where eager's never does -- a training
    program's autograd node had an edge to an input no output depends on (TrainingProgram.run_autograd)."""
    outcome = check_program(_unused_input_spec())
    assert not outcome.failures, outcome.report()


def _nested_write_back_spec() -> ProgramSpec:
    """Minimized by ``effectfx fuzz --programs 2000 --seed 0``: a region updates its argument in place
    (``x1.add_(x0)``, x0 requiring grad) inside another region; the root prints the input afterwards."""
    r1 = RegionSpec("r1", "method", Body(("x0", "x1"), (Stmt("mutate", "add", ("x1", "x0")),), ("x1",)))
    r0 = RegionSpec("r0", "method", Body(("x0", "x1"), (Stmt("call", "r1", ("x0", "x1"), ("v0",)),), ("x0",)))
    forward = Body(("x0", "x1"), (Stmt("call", "r0", ("x0", "x1"), ("v0",)),
                                  Stmt("print", "fstring", ("x1",), (), "forward.1")), ("x1",))
    return ProgramSpec(2, 4, ("memory",), (True, False), (), 0, (r0, r1), forward, 0)


def test_print_after_a_nested_regions_write_back() -> None:
    """Was grad_fn=<CopyBackwards> (eager: <AddBackward0>): the name of a write-back two regions deep is
    the innermost body's op (python_print.region_result_grad_fn reads tracer.written_by_region)."""
    outcome = check_program(_nested_write_back_spec())
    assert not outcome.failures, outcome.report()


def _partial_retrace_spec() -> ProgramSpec:
    """Minimized by ``effectfx fuzz --programs 2000 --seed 0``: one region called twice on the input that
    requires grad; the first result updates the other input in place, the second is returned."""
    r0 = RegionSpec("r0", "function", Body(("x0",), (Stmt("unary", "relu", ("x0",), ("v0",)),), ("v0",)))
    forward = Body(("x0", "x1"), (Stmt("call", "r0", ("x1",), ("v0",)), Stmt("call", "r0", ("x1",), ("v1",)),
                                  Stmt("mutate", "add", ("x0", "v0"))), ("v1",))
    return ProgramSpec(2, 4, ("memory",), (False, True), (), 0, (r0,), forward, 1)


@pytest.mark.xfail(strict=True, reason="effectfx core: the partial backward's retrace (the updated input "
                   "gets no gradient) takes one output fewer of the first region call, so every later FX "
                   "node is named differently and graph.traced.same_forward, which matches nodes by name, "
                   "raises CaptureError although the forward is the same")
def test_partial_backward_after_an_input_updated_from_a_region() -> None:
    outcome = check_program(_partial_retrace_spec())
    assert not outcome.failures, outcome.report()
