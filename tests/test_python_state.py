"""Python state a captured function writes is written again after every call, with the call's values, and
no fake tensor of a capture is left where the user can reach it (Note [Python state],
``effectfx.capture.python_state``, ``effectfx.capture.leaks``).

Each differential test builds the same model twice -- for eager, and for each system under test (every
form of ``efx.capture``, ``efx.compile``) --, calls both three times with different inputs and compares,
call by call, the outputs, the gradients, the effect logs and the written state itself; after every call
no fake tensor may be reachable from the model, the arguments, the written state or this module's globals
(:func:`fakes_in`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import effectfx as efx
from effectfx.testing import hf
from effectfx.testing.differential import FORMS
from effectfx.testing.effect_ops import recording

log_tensor = torch.ops.efxtest.log_tensor
record = torch.ops.efxtest.record_memory

Make = Callable[[], tuple[torch.nn.Module, Callable[[], Any]]]  # () -> (model, the state it writes)


# -- helpers ------------------------------------------------------------------------------------------------
def fakes_in(*roots: Any, depth: int = 6) -> list[str]:
    """Where a fake tensor is reachable from ``roots``: through modules (every submodule, parameters and
    their ``.grad``, buffers, attributes), optimizers (their state), lists, tuples, dicts and objects."""
    found: list[str] = []
    seen: set[int] = set()

    def walk(value: Any, where: str, left: int) -> None:
        if isinstance(value, FakeTensor):
            found.append(where)
            return
        if isinstance(value, torch.Tensor):
            if value.is_leaf and isinstance(value.grad, FakeTensor):
                found.append(f"{where}.grad")
            return
        if left == 0 or id(value) in seen or isinstance(value, (str, bytes, int, float, type(None), type)):
            return
        seen.add(id(value))
        if isinstance(value, torch.nn.Module):
            for name, sub in value.named_modules():
                for key, v in vars(sub).items():
                    walk(v, f"{where}.{name}.{key}" if name else f"{where}.{key}", left - 1)
        elif isinstance(value, torch.optim.Optimizer):
            walk(dict(value.state), f"{where}.state", left - 1)
            walk(value.param_groups, f"{where}.param_groups", left - 1)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{where}[{i}]", left - 1)
        elif isinstance(value, dict):
            for k, v in list(value.items()):
                walk(v, f"{where}[{k!r}]", left - 1)
        elif hasattr(value, "__dict__") and not callable(value):
            for k, v in vars(value).items():
                walk(v, f"{where}.{k}", left - 1)

    for i, root in enumerate(roots):
        walk(root, f"root{i}", depth)
    return found


def module_globals() -> dict[str, Any]:
    """The globals of this test module a test's code reads (its lists and dicts)."""
    return {k: v for k, v in vars(sys.modules[__name__]).items() if isinstance(v, (list, dict))}


def copied(value: Any) -> Any:
    """A snapshot of written state: tensors cloned (with their requires_grad), containers copied."""
    if isinstance(value, torch.Tensor):
        return (value.detach().clone(), value.requires_grad, value.dtype)
    if isinstance(value, (list, tuple)):
        return [copied(v) for v in value]
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    return value


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def one_call(fn: Callable[..., Any], model: torch.nn.Module, state: Callable[[], Any], x: torch.Tensor,
             grad: bool) -> tuple:
    """Outputs, gradients of the parameters (under ``grad``), the effect log and the written state."""
    with torch.set_grad_enabled(grad), recording() as log:
        out = fn(x)
        outs = [o for o in (out if isinstance(out, tuple) else (out,))]
        grads: list[Any] = []
        if grad:
            params = [p for p in model.parameters() if p.requires_grad]
            grads = list(torch.autograd.grad([o.sum() for o in outs], params, allow_unused=True))
    return [o.detach() for o in outs], grads, list(log), copied(state())


def differential(make: Make, inputs: list[torch.Tensor], grad: bool = False,
                 forms: tuple[str, ...] = tuple(FORMS)) -> dict[str, Any]:
    """Eager, every form in ``forms`` and efx.compile, each on a fresh ``make()``, call by call; returns
    the compiled callable and the compiled model (for more checks)."""
    model, state = make()
    eager = [one_call(model, model, state, x, grad) for x in inputs]
    found: dict[str, Any] = {}
    systems: dict[str, Callable[[torch.nn.Module], Any]] = {
        name: (lambda m, build=build: build(m, (inputs[0],), {})) for name, build in FORMS.items()
        if name in forms}
    systems["compile"] = efx.compile
    for name, build in systems.items():
        model, state = make()
        before = copied(state())
        with recording() as capture_log, torch.set_grad_enabled(grad):
            fn = build(model)
        assert capture_log == [] and same(copied(state()), before), f"{name}: capturing changed the state"
        for i, (x, want) in enumerate(zip(inputs, eager)):
            got = one_call(fn, model, state, x, grad)
            for part, a, b in zip(("outputs", "gradients", "effect log", "written state"), want, got):
                assert same(a, b), f"{name}, call {i + 1}: {part} differ from eager's:\n{a}\n{b}"
            leaks = fakes_in(model, state(), x, module_globals())
            assert not leaks, f"{name}, call {i + 1}: fake tensors reachable at {leaks}"
        found[name] = (fn, model)
    return found


def inputs(n: int = 3, shape: tuple[int, ...] = (2, 4)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def forward_of(prog: Any) -> Any:
    return prog.forward if isinstance(prog, efx.TrainingProgram) else prog


# -- attributes: set, rebound, deleted ---------------------------------------------------------------------
class Remembers(torch.nn.Module):
    """Keeps its last hidden state (``self.last = h.detach()``), and the hidden state itself (which requires
    grad under autograd)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.last = self.hidden = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        log_tensor(h, "hidden")
        self.last = h.detach()
        self.hidden = h  # requires grad under autograd, as eager's
        return torch.relu(h)


def make_remembers() -> tuple[torch.nn.Module, Callable[[], Any]]:
    torch.manual_seed(0)
    model = Remembers()
    return model, lambda: [model.last, model.hidden]


@pytest.mark.parametrize("grad", [False, True])
def test_an_attribute_set_in_forward_holds_each_calls_tensor(grad: bool) -> None:
    found = differential(make_remembers, inputs(), grad=grad)
    compiled, model = found["compile"]
    assert model.hidden.requires_grad == grad and type(model.last) is torch.Tensor
    assert compiled.stats.compiles == 1  # an attribute the code never reads needs no guard


def test_a_stored_tensor_that_requires_grad_is_differentiable_in_training() -> None:
    """Training: the stored tensor is an output of the program's autograd node, so a loss using it
    differentiates through the compiled forward as eager's does."""
    eager, _ = make_remembers()
    model, _ = make_remembers()
    compiled = efx.compile(model)
    for x in inputs():
        for m, fn in ((eager, eager), (model, compiled)):
            m.zero_grad()
            out = fn(x)
            (out.sum() + (m.hidden * m.hidden).sum()).backward()
        assert model.hidden.grad_fn is not None and model.last.grad_fn is None
        assert all(torch.allclose(a.grad, b.grad, atol=1e-6) for a, b in zip(eager.parameters(),
                                                                             model.parameters()))
    assert not fakes_in(model, module_globals())


class Averages(torch.nn.Module):
    """Rebinds a buffer to a running average of what it saw, at every call (``self.ema = ...``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) + self.ema
        self.ema = 0.5 * self.ema + 0.5 * h.mean(0).detach()
        record("averages")
        return h


class Halves(Averages):
    """And rebinds one to another dtype on its first call (``self.buffer = self.buffer.half()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("buffer", torch.linspace(0, 1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x) + self.buffer.float()
        self.buffer = self.buffer.half()
        return out


def buffers_of(cls: type) -> Make:
    def make() -> tuple[torch.nn.Module, Callable[[], Any]]:
        torch.manual_seed(0)
        model = cls()
        return model, lambda: dict(model.named_buffers())

    return make


def test_a_rebound_buffer_is_the_modules_buffer_after_each_call() -> None:
    found = differential(buffers_of(Averages), inputs())
    compiled, model = found["compile"]
    assert "ema" in model._buffers and "ema" not in vars(model) and compiled.stats.compiles == 1


def test_a_buffer_rebound_to_another_dtype() -> None:
    found = differential(buffers_of(Halves), inputs(), forms=())
    compiled, model = found["compile"]
    assert model.buffer.dtype == torch.float16
    assert compiled.stats.compiles == 2  # the buffer's dtype changed once: its own program from then on
    model = Halves()
    prog = efx.capture(model, torch.randn(2, 4))  # reads the buffer it rebinds: refused once it differs
    prog(torch.randn(2, 4))
    with pytest.raises(efx.SignatureMismatchError, match=r"reads 'buffer', which its own Python writes "
                                                         r"replace .* unlike the tensor it was captured for"):
        prog(torch.randn(2, 4))


class Deletes(torch.nn.Module):
    """Reads and deletes a scratch tensor its caller sets before each call (``del self.scratch``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x) * self.scratch
        del self.scratch
        return out


def test_an_attribute_deleted_in_forward_is_deleted_at_each_call() -> None:
    def make():
        torch.manual_seed(0)
        model = Deletes()
        model.scratch = torch.ones(4)
        return model, lambda: hasattr(model, "scratch")

    def run(fn: Callable[..., Any], model: Deletes, x: torch.Tensor) -> torch.Tensor:
        model.scratch = x[0].detach() + 1
        return fn(x)

    eager, _ = make()
    model, _ = make()
    compiled = efx.compile(model)
    for x in inputs():
        want = run(eager, eager, x)
        got = run(compiled, model, x)
        assert torch.allclose(want, got) and not hasattr(model, "scratch") and not hasattr(eager, "scratch")
    assert compiled.stats.compiles == 1


def test_an_attribute_deleted_in_forward_every_form() -> None:
    torch.manual_seed(0)
    model = Deletes()
    for name, build in FORMS.items():
        model.scratch = torch.ones(4)
        prog = build(model, (torch.randn(2, 4),), {})
        assert hasattr(model, "scratch"), f"{name}: capturing deleted it"
        for x in inputs():
            model.scratch = x[0] + 1
            want = model.lin(x) * model.scratch
            assert torch.allclose(prog(x), want) and not hasattr(model, "scratch"), name


# -- hooks collecting activations ---------------------------------------------------------------------------
GLOBAL_ACTS: list[torch.Tensor] = []
STATS: dict[str, torch.Tensor] = {}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record("block")
        return torch.tanh(self.lin(x))


class RegionBlock(Block):
    forward = efx.region(Block.forward)  # GPT-2 style: every layer a region, one body for all


class Stack(torch.nn.Module):
    def __init__(self, block: type, n: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x * 2


def collecting(block: type, where: str, on: str) -> Make:
    """A stack whose layers (``on``: "lin", inside each layer's body; "block": the layer itself) have one
    hook appending ``out.detach()`` to a list closed over (``where="closure"``) or to ``GLOBAL_ACTS``."""
    def make() -> tuple[torch.nn.Module, Callable[[], Any]]:
        torch.manual_seed(0)
        model = Stack(block)
        acts: list[torch.Tensor] = []
        GLOBAL_ACTS.clear()
        if where == "closure":
            def hook(module, args, out):
                acts.append(out.detach())
        else:
            def hook(module, args, out):
                GLOBAL_ACTS.append(out.detach())
        target = acts if where == "closure" else GLOBAL_ACTS
        for b in model.blocks:
            (b.lin if on == "lin" else b).register_forward_hook(hook)
        return model, lambda: list(target)

    return make


@pytest.mark.parametrize("on", ["lin", "block"])
@pytest.mark.parametrize("where", ["closure", "global"])
@pytest.mark.parametrize("block", [RegionBlock, Block], ids=["region", "module"])
def test_a_hook_collecting_activations_appends_each_calls_tensors(block: type, where: str, on: str) -> None:
    found = differential(collecting(block, where, on), inputs())
    compiled, model = found["compile"]
    if block is RegionBlock:
        assert all(len(forward_of(p).bodies) == 1 for p in compiled.programs())  # one body for 3 layers
    # the list was empty at the first capture: appending to it, or emptying then filling it, look the same
    # there, so the next call captures once more (Note [Python state]); then every call runs that program
    assert compiled.stats.compiles == 2


def test_a_hook_that_empties_the_list_it_fills_keeps_eagers_list() -> None:
    """The same first trace as plain appending; the program captured for the non-empty list replaces it."""
    def make() -> tuple[torch.nn.Module, Callable[[], Any]]:
        torch.manual_seed(0)
        model = Stack(RegionBlock)
        latest: list[torch.Tensor] = []

        def hook(module, args, out):
            latest.clear()
            latest.append(out.detach())

        model.blocks[-1].lin.register_forward_hook(hook)
        return model, lambda: list(latest)

    differential(make, inputs(4), forms=())


def test_a_hook_setting_dict_items_sets_each_calls_statistics() -> None:
    """``stats[name] = out.mean()``: a hook per layer, each closing over its layer's name."""
    def make() -> tuple[torch.nn.Module, Callable[[], Any]]:
        torch.manual_seed(0)
        model = Stack(RegionBlock)
        STATS.clear()
        for i, b in enumerate(model.blocks):
            b.lin.register_forward_hook(lambda m, a, out, name=f"lin{i}": STATS.__setitem__(name, out.mean()))
        return model, lambda: dict(STATS)

    found = differential(make, inputs())
    assert sorted(STATS) == ["lin0", "lin1", "lin2"] and found["compile"][0].stats.compiles == 2


@pytest.mark.parametrize("grad", [False, True])
def test_hooks_on_a_transformers_model_collect_every_layers_hidden_state(grad: bool) -> None:
    """GPT-2 from a transformers config, its layers regions (one body): a hook on each layer's block
    collects its hidden state; eager's list and the compiled model's are the same after each call."""
    def make() -> tuple[torch.nn.Module, Callable[[], Any]]:
        model = hf.build("gpt2")
        model.eval()
        acts: list[torch.Tensor] = []

        def hook(module, args, out):
            acts.append((out[0] if isinstance(out, tuple) else out).detach())

        for layer in hf.layers_of(model, "gpt2"):
            layer.layer.register_forward_hook(hook)
        return model, lambda: list(acts)

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, hf.VOCAB, (2, 8), generator=g) for _ in range(3)]
    model, state = make()
    eager = [one_call(lambda i, m=model: m(input_ids=i).logits, model, state, i, grad) for i in ids]
    model, state = make()
    compiled = efx.compile(model)
    for i, (x, want) in enumerate(zip(ids, eager)):
        got = one_call(lambda i: compiled(input_ids=i).logits, model, state, x, grad)
        assert all(same(a, b) for a, b in zip(want, got)), f"call {i + 1}"
        assert len(state()) == hf.LAYERS * (i + 1) and not fakes_in(model, state(), module_globals())
    assert all(len(forward_of(p).bodies) == 1 for p in compiled.programs())


# -- plain values --------------------------------------------------------------------------------------------
class Counts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # <- counts
        return self.lin(x)


def test_a_counter_in_python_is_refused_clearly_not_run_once() -> None:
    """``self.calls += 1`` changes at every call: a program replays it with its capture's value, so each
    call would need a program of its own.  The first call is eager's; the second is refused, naming the
    attribute and the line."""
    model = Counts()
    compiled = efx.compile(model)
    compiled(torch.randn(2, 4))
    assert model.calls == 1
    with pytest.raises(efx.PythonStateError, match=r"Counts\.calls on every call \(from 1 to 2 now, from 0 "
                                                   r"to 1 .*test_python_state\.py:\d+ \(in forward\): "
                                                   r"self\.calls \+= 1"):
        compiled(torch.randn(2, 4))
    prog = efx.capture(Counts(), torch.randn(2, 4))  # efx.capture's program: refused when it would repeat
    owner = forward_of(prog).python_state.writes[0].target[0][1].obj
    prog(torch.randn(2, 4))
    assert owner["calls"] == 1
    with pytest.raises(efx.SignatureMismatchError, match=r"writes Python state it computed .* 1 found"):
        prog(torch.randn(2, 4))


class Flags(torch.nn.Module):
    """Plain values written: a flag set on the first call, a name set every call, a toggled phase."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.ready = False
        self.phase = "even"
        self.seen = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if not self.ready:
            record("first call")
            self.ready = True
        self.seen = "x"
        self.phase = "odd" if self.phase == "even" else "even"
        return h


def test_plain_values_written_are_written_at_each_call() -> None:
    def make():
        torch.manual_seed(0)
        model = Flags()
        return model, lambda: (model.ready, model.seen, model.phase)

    found = differential(make, inputs(5), forms=())
    assert found["compile"][0].stats.compiles == 3  # (ready, phase): (F, even), (T, odd), (T, even)


# -- what cannot be written again, and what is left behind ------------------------------------------------
class Box:
    def __init__(self, value: Any) -> None:
        self.value = value


class StoresAnObject(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.out = Box(x * 2)  # <- box
        return x + 1


def test_an_object_made_in_forward_holding_a_tensor_is_refused() -> None:
    with pytest.raises(efx.PythonStateError, match=r"stores a Box it made that holds a tensor .* "
                                                   r"StoresAnObject\.out \(at .*test_python_state\.py"):
        efx.compile(StoresAnObject())(torch.randn(2))


def test_a_backward_hook_writing_state_is_refused() -> None:
    grads: list[torch.Tensor] = []
    model = Stack(Block)
    model.blocks[1].lin.register_full_backward_hook(lambda m, gi, go: grads.append(go[0]))
    with pytest.raises(efx.PythonStateError, match=r"writes grads \(closed over by a hook of "
                                                   r"Stack\.blocks\.1\.lin\) while its backward is derived "
                                                   r"\(a backward hook\?\)"):
        efx.compile(model)(torch.randn(2, 4, requires_grad=True))
    assert grads == []


def test_a_write_inside_control_flow_is_refused() -> None:
    seen: list[torch.Tensor] = []

    def f(x):
        def then(x):
            seen.append(x.detach())
            return x + 1

        return torch.cond(x.sum() > 0, then, lambda x: x - 1, (x,))

    with pytest.raises(efx.PythonStateError, match=r"inside a branch or loop of control flow"):
        efx.compile(f)(torch.randn(3))
    assert seen == []


class Deep:
    def __init__(self, inner: Any = None) -> None:
        self.inner = inner


class HidesAFake(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = Deep(Deep(Deep()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        vars(self.cfg.inner.inner)["cache"] = h  # three levels down, past the journal's walk
        return h + 1


def test_the_leak_check_refuses_a_fake_left_in_a_watched_object() -> None:
    model = HidesAFake()
    with pytest.raises(efx.FakeTensorLeakError, match=r"Deep\.cache holds a fake tensor .*float32 \[2\]"):
        efx.compile(model)(torch.randn(2))


def test_no_fake_reaches_the_model_the_optimizer_or_globals_in_a_training_step() -> None:
    """A compiled training step whose model has a hook collecting activations and remembers its hidden
    state: the parameters, their gradients, the optimizer's state and the lists are eager's, call by call."""
    def make():
        torch.manual_seed(0)
        model = Stack(RegionBlock)
        model.blocks[0].lin.register_forward_hook(lambda m, a, out: GLOBAL_ACTS.append(out.detach()))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)

        def step(x):
            opt.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            return loss.detach()

        return model, opt, step

    runs = []
    for compiled in (False, True):
        GLOBAL_ACTS.clear()
        model, opt, step = make()
        fn = efx.compile(step) if compiled else step
        losses = [fn(x) for x in inputs()]
        assert not fakes_in(model, opt, GLOBAL_ACTS, module_globals())
        params = [p.detach().clone() for p in model.parameters()]
        runs.append((losses, [a.clone() for a in GLOBAL_ACTS], params,
                     [t.clone() for s in opt.state.values() for t in s.values()]))
    assert all(same(a, b) for a, b in zip(*runs))


# -- the graph -----------------------------------------------------------------------------------------------
GOLDEN_WRITTEN = """\
def forward(self, x, lin_weight, lin_bias):
    t = torch.ops.aten.t.default(lin_weight)
    addmm = torch.ops.aten.addmm.default(lin_bias, x, t)
    log_tensor = torch.ops.efxtest.log_tensor.default(addmm, 'hidden')
    detach_1 = torch.ops.aten.detach.default(addmm)
    relu = torch.ops.aten.relu.default(addmm)
    detach_2 = torch.ops.aten.detach.default(relu)
    return (relu, detach_1, addmm, x, detach_2)

def forward(self, x, detach_2, tangent_0, tangent_1):
    detach_3 = torch.ops.aten.detach.default(detach_2)
    threshold_backward = torch.ops.aten.threshold_backward.default(tangent_0, detach_3, 0)
    add = torch.ops.aten.add.Tensor(tangent_1, threshold_backward)
    t_1 = torch.ops.aten.t.default(add)
    mm = torch.ops.aten.mm.default(t_1, x)
    t_2 = torch.ops.aten.t.default(mm)
    sum_1 = torch.ops.aten.sum.dim_IntList(add, [0], True)
    view = torch.ops.aten.view.default(sum_1, [4])
    t_3 = torch.ops.aten.t.default(t_2)
    return (t_3, view)"""


def test_golden_the_written_tensors_are_extra_outputs() -> None:
    """``self.last = h.detach()`` and ``self.hidden = h``: the forward returns them after the result (then
    its saved values), the second with a gradient (``tangent_1``, added to the result's), and the program
    writes them into the module after each run."""
    torch.manual_seed(0)
    model = Remembers()
    prog = efx.capture(model, torch.randn(2, 4), functionalize=False)
    assert prog.code() == GOLDEN_WRITTEN
    assert [(w.op.value, w.key, w.what) for w in prog.forward.python_state.writes] == [
        ("set", "last", "Remembers.last"), ("set", "hidden", "Remembers.hidden")]
    assert model.last is None and model.hidden is None  # capturing wrote nothing


def test_a_program_writing_python_state_is_not_saved(tmp_path: Any) -> None:
    """Its writes go to live objects, which a file cannot hold."""
    with torch.no_grad():
        prog = efx.remove_effect_tokens(efx.capture(Remembers(), torch.randn(2, 4)))
    with pytest.raises(efx.EffectfxError, match=r"writes Python state of live objects .*Remembers\.last"):
        prog.save(tmp_path / "prog.efx")


WINDOW: list[torch.Tensor] = []
LATEST: dict[str, torch.Tensor] = {}


class Windows(torch.nn.Module):
    """A window of the last two hidden states (``pop(0)``, ``append``), the first slot of a list assigned,
    a dict item set and another removed."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.slots = [torch.zeros(4), torch.zeros(4)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        WINDOW.pop(0)
        WINDOW.append(h.detach())
        self.slots[0] = h.sum(0).detach()
        LATEST["h"] = h.detach()
        LATEST.pop("old", None)
        return h


def test_list_and_dict_operations_are_written_as_eager_leaves_them() -> None:
    def make() -> tuple[torch.nn.Module, Callable[[], Any]]:
        torch.manual_seed(0)
        WINDOW[:] = [torch.ones(2, 4), torch.ones(2, 4) * 2]
        LATEST.clear()
        LATEST["old"] = torch.ones(1)
        model = Windows()
        return model, lambda: (list(WINDOW), list(model.slots), dict(LATEST))

    found = differential(make, inputs(4))
    assert len(WINDOW) == 2 and "old" not in LATEST
    assert found["compile"][0].stats.compiles == 2  # ("old" gone: the program for its absence from then on)


def test_a_list_of_objects_reordered_is_refused() -> None:
    kept = [torch.ones(2)]

    def f(x):
        kept.insert(0, x * 2)
        return x + 1

    with pytest.raises(efx.PythonStateError, match=r"inserts into or reorders a list of objects in kept "
                                                   r"\(closed over by the captured function\)"):
        efx.compile(f)(torch.randn(2))
    assert len(kept) == 1
