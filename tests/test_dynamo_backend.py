"""effectfx and Dynamo (``effectfx.drivers.dynamo_backend``): ``torch.compile(model, backend="effectfx")``
keeps eager's effects, losses and gradients -- GPT-2 and Llama from ``transformers`` configs (random
weights, 2 layers), each layer recording an effect --, Dynamo's ``nested_compile_region`` layers are effectfx
regions with one body, and ``torch.compile`` around an ``efx.compile``'d model runs effectfx's programs."""

from __future__ import annotations

import copy
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers
from torch import nn

import effectfx as efx
from effectfx.drivers import dynamo_backend
from effectfx.testing import hf, recording
from effectfx.testing.dynamo import BackendCallables as Made
from effectfx.testing.dynamo import Logged

ROOT = pathlib.Path(__file__).resolve().parent.parent
STEPS = 3
LAYERS = 2


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    # every test compiles the same transformers code objects again; Dynamo's per-code recompile limit
    # would fall back to eager, silently, after eight of them
    torch._dynamo.reset()


class NestedLogged(Logged):
    """A layer that is a ``nested_compile_region`` and logs its input (key "stdout"): the same code in every
    layer (Dynamo bakes a string in, so a per-layer name would make a subgraph per layer)."""

    @torch.compiler.nested_compile_region
    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        torch.ops.efxtest.log_tensor(hidden, "layer")
        return self.layer(hidden, *args, **kwargs)


def build(kind: str, layer: type[Logged] = Logged) -> nn.Module:
    torch.manual_seed(0)
    config = {"gpt2": hf.gpt2_config, "llama": hf.llama_config}[kind]()
    config.num_hidden_layers = config.n_layer = LAYERS
    model = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}[kind](config)
    model.loss_type = "ForCausalLM"
    layers = hf.layers_of(model, kind)
    assert len(layers) == LAYERS
    for i, block in enumerate(layers):
        layers[i] = layer(block, f"layer{i}")
    return model


@dataclass
class Run:
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]  # per step, before the optimizer step
    log: list[tuple]
    eval_loss: float = 0.0


def train(model: nn.Module, call: Callable[..., Any], steps: int = STEPS, evaluate: bool = False) -> Run:
    g = torch.Generator().manual_seed(1)
    batches = [hf.batch("gpt2", g) for _ in range(steps)]
    run = hf.train(model, call, batches)
    with recording() as log, torch.no_grad():
        eval_loss = call(**batches[0]).loss.item() if evaluate else 0.0
    return Run(run.losses, run.grads, run.log + list(log), eval_loss)


def assert_same(eager: Run, got: Run, rel: float = 1e-5, atol: float = 1e-6) -> None:
    assert got.losses == pytest.approx(eager.losses, rel=rel)
    assert got.losses[0] != got.losses[-1]  # the parameters moved
    assert got.eval_loss == pytest.approx(eager.eval_loss, rel=rel)
    assert [e[:3] for e in got.log] == [e[:3] for e in eager.log]  # op, label, shape: in eager's order
    fingerprints = [[x for e in run.log for x in e[3:]] for run in (eager, got)]  # (log_tensor's)
    assert fingerprints[1] == pytest.approx(fingerprints[0], rel=rel, abs=1e-3)
    for step, (ge, gc) in enumerate(zip(eager.grads, got.grads)):
        assert ge.keys() == gc.keys(), step
        for name in ge:
            assert torch.allclose(ge[name], gc[name], rtol=rel, atol=atol), (step, name)


def per_layer(kind: str) -> list[tuple]:
    return [("record_memory", f"layer{i}") for i in range(LAYERS)] * STEPS


# -- the backend ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_training_matches_eager(kind: str) -> None:
    eager_model = build(kind)
    model = copy.deepcopy(eager_model)
    eager = train(eager_model, eager_model, evaluate=True)
    with Made() as made:
        got = train(model, torch.compile(model, backend="effectfx"), evaluate=True)
    assert eager.log == per_layer(kind) + [("record_memory", f"layer{i}") for i in range(LAYERS)]
    assert_same(eager, got)
    # one graph for training (captured once, run thrice), one for evaluation (no_grad: Dynamo's own)
    assert [c.stats.compiles for c in made.callables] == [1, 1]
    assert [c.stats.calls for c in made.callables] == [STEPS, 1]
    assert isinstance(made.callables[0].programs()[0], efx.TrainingProgram)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_nested_compile_regions_are_regions_with_one_body(kind: str) -> None:
    eager_model = build(kind, NestedLogged)
    model = copy.deepcopy(eager_model)
    eager = train(eager_model, eager_model)
    with Made() as made:
        got = train(model, torch.compile(model, backend="effectfx"))
    assert [e[:2] for e in eager.log] == [("log_tensor", "layer")] * (LAYERS * STEPS)
    assert_same(eager, got)
    (compiled,) = made.callables
    region = efx.explain(compiled).regions["NestedLogged.forward"]
    assert region.calls == LAYERS and len(region.bodies) == 1
    assert region.forward_effects == ("stdout",)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_inductor_lowering_within_tolerance(kind: str) -> None:
    eager_model = build(kind, NestedLogged)
    model = copy.deepcopy(eager_model)
    eager = train(eager_model, eager_model)
    with Made() as made:
        got = train(model, torch.compile(model, backend="effectfx", options={"backend": "inductor"}))
    assert [c.backend for c in made.callables] == ["inductor"]
    assert_same(eager, got, rel=1e-4, atol=1e-5)


def test_per_block_fullgraph_like_torchtitan() -> None:
    """torchtitan compiles each block on its own, ``fullgraph=True``; the rest of the model runs eagerly."""
    eager_model = build("gpt2")
    model = copy.deepcopy(eager_model)
    layers = hf.layers_of(model, "gpt2")
    for i, block in enumerate(layers):
        layers[i] = torch.compile(block, backend="effectfx", fullgraph=True)
    eager = train(eager_model, eager_model)
    with Made() as made:
        got = train(model, model)
    assert eager.log == per_layer("gpt2")
    assert_same(eager, got)
    assert len(made.callables) == LAYERS  # a graph per block (Dynamo guards on the module)


def log_around_a_break(x: torch.Tensor) -> torch.Tensor:
    torch.ops.efxtest.record_memory("before")
    y = torch.ops.efxtest.bump(x.sin(), "first graph")
    torch._dynamo.graph_break()
    torch.ops.efxtest.record_stdout("between")
    return torch.ops.efxtest.bump(y.cos(), "second graph") * 2


def test_effects_keep_eager_order_across_graph_breaks() -> None:
    x = torch.randn(3, requires_grad=True)
    with recording() as eager_log:
        expected = log_around_a_break(x)
        (grad,) = torch.autograd.grad(expected.sum(), x)
    with Made() as made, recording() as log:
        got = torch.compile(log_around_a_break, backend="effectfx")(x)
        (got_grad,) = torch.autograd.grad(got.sum(), x)
    assert len(made.callables) == 2
    assert log == eager_log and len(log) == 4
    assert torch.allclose(got, expected) and torch.allclose(got_grad, grad)


def test_buffers_written_in_a_graph_are_written_back() -> None:
    """BatchNorm's running statistics: Dynamo's graph updates them in place, effectfx writes them back."""
    torch.manual_seed(0)
    eager_model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    model = copy.deepcopy(eager_model)
    compiled = torch.compile(model, backend="effectfx")
    for _ in range(3):
        x = torch.randn(5, 4)
        eager_model(x).sum().backward()
        compiled(x).sum().backward()
    for (name, a), b in zip(eager_model.state_dict().items(), model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), name
    for (name, p), q in zip(eager_model.named_parameters(), model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), name


def test_what_effectfx_refuses_it_refuses_with_its_own_error() -> None:
    from torch._higher_order_ops.map import map as hop_map

    def uses_map(xs: torch.Tensor) -> torch.Tensor:
        return hop_map(lambda x: x.sin(), xs)

    with pytest.raises(efx.UnsupportedOperatorError, match="map_impl"):
        torch.compile(uses_map, backend="effectfx")(torch.randn(4, 3))


def test_options() -> None:
    f = torch.compile(lambda x: x + 1, backend="effectfx", options={"backend": "nonesuch"})
    with pytest.raises(Exception, match="unknown options\\['backend'\\] 'nonesuch'"):
        f(torch.randn(2))
    f = torch.compile(lambda x: x + 1, backend="effectfx", options={"fusion": True})
    with pytest.raises(Exception, match="options it does not know: \\['fusion'\\]"):
        f(torch.randn(2))


# -- registration ------------------------------------------------------------------------------------------
def test_pyproject_names_the_entry_point() -> None:
    section = (ROOT / "pyproject.toml").read_text().split("[project.entry-points.torch_dynamo_backends]\n")[1]
    target = re.match(r'effectfx = "(.*)"\n', section).group(1)  # (tomllib: Python 3.11 on)
    module, name = target.split(":")
    assert target == dynamo_backend._TARGET
    assert getattr(sys.modules[module], name) is dynamo_backend.effectfx_backend


def run_python(code: str, path: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


USE = """
import sys, torch
f = torch.compile(lambda x: x.sin() * 2, backend="effectfx")
x = torch.randn(3)
assert torch.allclose(f(x), x.sin() * 2)
print("effectfx" in sys.modules, "torch._dynamo" in sys.modules)
"""


def test_backend_name_without_importing_effectfx(tmp_path: pathlib.Path) -> None:
    """Installed, the entry point makes the name known: a config string names the backend."""
    info = tmp_path / "effectfx-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: effectfx\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[torch_dynamo_backends]\neffectfx = {dynamo_backend._TARGET}\n")
    proc = run_python(USE, [str(tmp_path), str(ROOT)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "True"]  # effectfx was imported by torch, through the name


@pytest.mark.parametrize("dynamo_first", [False, True])
def test_backend_name_after_import_effectfx(dynamo_first: bool) -> None:
    """``import effectfx`` does not import Dynamo; the name is known whether Dynamo comes before or after."""
    code = ("import sys, torch\n" + ("import torch._dynamo\n" if dynamo_first else "")
            + "import effectfx\nassert ('torch._dynamo' in sys.modules) == " + str(dynamo_first) + "\n" + USE)
    proc = run_python(code, [str(ROOT)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "effectfx" in torch._dynamo.list_backends()


# -- effectfx opaque to Dynamo ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_of_an_efx_compiled_model(backend: str) -> None:
    """Dynamo does not trace effectfx's Python: the compiled model's call is a graph break, and its programs
    run (eager's losses, gradients and effects, in training and in evaluation)."""
    eager_model = build("gpt2")
    model = copy.deepcopy(eager_model)
    compiled = efx.compile(model)
    eager = train(eager_model, eager_model, steps=2, evaluate=True)
    got = train(model, torch.compile(compiled, backend=backend), steps=2, evaluate=True)
    assert eager.log == [("record_memory", f"layer{i}") for i in range(LAYERS)] * 3
    assert_same(eager, got)
    assert compiled.stats.compiles == 2 and compiled.stats.calls == 3  # training, evaluation


def test_torch_compile_around_an_efx_compiled_function() -> None:
    @efx.compile
    def inner(x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.record_memory("inner")
        return x.sin()

    def outer(x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.record_memory("outer before")
        y = inner(x * 2)
        torch.ops.efxtest.record_memory("outer after")
        return y + 1

    x = torch.randn(3, requires_grad=True)
    with recording() as log:
        out = torch.compile(outer, backend="eager")(x)
        out.sum().backward()
    assert log == [("record_memory", "outer before"), ("record_memory", "inner"),
                   ("record_memory", "outer after")]
    assert torch.allclose(x.grad, 2 * (2 * x).cos())
    assert inner.stats.compiles == 1


def test_torch_compile_around_a_captured_program() -> None:
    def inner(x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.record_memory("inner")
        return x.sin()

    x = torch.randn(3, requires_grad=True)
    prog = efx.capture(inner, x)
    assert isinstance(prog, efx.TrainingProgram)
    with recording() as log:
        out = torch.compile(lambda x: prog(x * 2) + 1, backend="eager")(x)
        out.sum().backward()
    assert log == [("record_memory", "inner")]
    assert torch.allclose(x.grad, 2 * (2 * x).cos())


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    @torch.compiler.nested_compile_region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.log_tensor(x, "block")
        return self.lin(x).relu()


GOLDEN_DYNAMO = """\
def forward(self, L_args_0, L_fn_modules_0_modules_lin_parameters_weight, L_fn_modules_0_modules_lin_parameters_bias, L_fn_modules_1_modules_lin_parameters_weight, L_fn_modules_1_modules_lin_parameters_bias):
    _block_forward_subgraph0 = self._Block_forward_subgraph0
    invoke_subgraph = effectfx.ops.invoke_subgraph(_block_forward_subgraph0, 'subgraph_0', L_args_0, L_fn_modules_0_modules_lin_parameters_weight, L_fn_modules_0_modules_lin_parameters_bias)
    getitem = invoke_subgraph[0]
    invoke_subgraph_1 = effectfx.ops.invoke_subgraph(_block_forward_subgraph0, 'subgraph_0', getitem, L_fn_modules_1_modules_lin_parameters_weight, L_fn_modules_1_modules_lin_parameters_bias)
    getitem_1 = invoke_subgraph_1[0]
    return (getitem_1,)

# _Block_forward_subgraph0: 'subgraph_0'
def _Block_forward_subgraph0(self, arg0, arg1, arg2):
    log_tensor = torch.ops.efxtest.log_tensor.default(arg0, 'block')
    t = torch.ops.aten.t.default(arg1)
    addmm = torch.ops.aten.addmm.default(arg2, arg0, t)
    relu = torch.ops.aten.relu.default(addmm)
    return (relu,)"""  # noqa: E501 (graph text as printed)


def test_golden_dynamo_s_nested_compile_regions_are_one_body() -> None:
    """Dynamo's graph, as effectfx's program: each ``nested_compile_region`` call an ``invoke_subgraph`` of
    one body, the effect inside it; outputs and the effect log as eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    x = torch.randn(2, 3)
    with torch.no_grad(), recording() as want:
        expected = model(x)
    with Made() as made, torch.no_grad(), recording() as got:
        out = torch.compile(model, backend="effectfx")(x)
    torch.testing.assert_close(out, expected)
    assert [e[:2] for e in got] == [e[:2] for e in want] == [("log_tensor", "block")] * 2
    (program,) = made.callables[0].programs()
    assert program.code() == GOLDEN_DYNAMO
