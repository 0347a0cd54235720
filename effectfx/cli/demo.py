"""``effectfx demo``: what effect tokens are for, in one screen, measured live.

1. the smallest program -- a region traced once and called twice, with an effect inside -- captured,
   printed in its functionalized form and run beside eager;
2. a four-layer model whose layers log through a custom op, one training step in eager, in
   ``torch.compile`` (``backend="aot_eager"``: the capture and autograd of the default backend without its
   code generation, so the demo stays quick) and in ``efx.compile``; each system's effect count and
   gradients, as measured now;
3. when the repository's ``examples/transformer_memory.py`` is present, a short training run of that model
   with ``efx.compile`` beside eager: losses, effect counts, the first difference in the effect logs.

Exit status 0 only if effectfx's outputs, effect logs, gradients and parameters match eager's (what
torch.compile does is reported, not required).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

import effectfx as efx

EFFECT_LOG: list[tuple[str, ...]] = []

WHY = """\
Why effect tokens. A graph compiler may reorder, merge or delete any node whose result nobody reads. A call
made only for its side effect -- a logger, a memory probe, print -- returns nothing, so to a compiler it is
dead code, with no order relative to other such calls. effectfx threads each such call on a token (an
empty tensor the call takes and returns; one chain per effect key): the calls become data dependences, so
they run once each, in eager's order -- also inside a region traced once and called many times, and in
backward."""


@torch.library.custom_op("efxdemo::record_memory", mutates_args=())
def record_memory(prefix: str, module_name: str) -> None:
    EFFECT_LOG.append(("record_memory", prefix, module_name))


@record_memory.register_fake
def _(prefix: str, module_name: str) -> None:
    return None


efx.register_effect(record_memory, key="memory")


@efx.region
def repeated(x: torch.Tensor) -> torch.Tensor:
    torch.ops.efxdemo.record_memory("forward", "N")
    return x + x


def twice(x: torch.Tensor) -> torch.Tensor:
    return repeated(repeated(x))


def _rule(title: str) -> None:
    print(f"\n{'=' * 8} {title} {'=' * max(4, 94 - len(title))}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=3, help="training steps of the transformer example")
    parser.add_argument("--layers", type=int, default=4, help="layers of the transformer example")
    parser.add_argument("--no-training", action="store_true", help="skip the transformer example")


def run(args: argparse.Namespace) -> int:
    print("effectfx demo: effect tokens, measured beside eager PyTorch and torch.compile\n")
    print(WHY)
    statuses = [run_demo(), run_comparison()]
    if not getattr(args, "no_training", False):
        statuses.append(run_training_demo(getattr(args, "steps", 3), getattr(args, "layers", 4)))
    return 0 if not any(statuses) else 1


# -- 1. the smallest program -------------------------------------------------------------------------------


def _one_time_import() -> float | None:
    """Seconds to import ``torch._dynamo``, which torch's fake tensors (what capture traces with) import
    on first use; None when this process already paid it."""
    if "torch._dynamo" in sys.modules:
        return None
    start = time.perf_counter()
    import torch._dynamo  # noqa: F401

    return time.perf_counter() - start


def run_demo() -> int:
    """Capture the smallest program, print it, run it beside eager; 0 when outputs and effects match."""
    _rule("1. a region traced once, called twice, an effect inside")
    print("@efx.region\ndef repeated(x):\n    record_memory('forward', 'N')   # a custom op: an effect on "
          "key 'memory'\n    return x + x\n\ndef twice(x):\n    return repeated(repeated(x))\n\n"
          "print(efx.capture(twice, x)) -- one body; a token enters, threads both calls, and leaves:\n")
    x = torch.randn(4)
    one_time = _one_time_import()
    start = time.perf_counter()
    prog = efx.capture(twice, x)
    first = time.perf_counter() - start
    start = time.perf_counter()
    efx.capture(twice, x)
    second = time.perf_counter() - start
    print(prog)

    EFFECT_LOG.clear()
    expected = twice(x)
    eager_log = list(EFFECT_LOG)
    EFFECT_LOG.clear()
    got = prog(x)
    efx_log = list(EFFECT_LOG)
    same_out = torch.equal(expected, got)
    same_log = eager_log == efx_log
    calls = (f"{len(eager_log)} record_memory calls each" if same_log else
             f"{len(eager_log)} record_memory calls in eager, {len(efx_log)} in effectfx")
    print(f"\nrun beside eager: outputs equal: {same_out}; effect logs identical: {same_log} ({calls})")
    if one_time is None:
        print(f"capture: {first * 1e3:.0f} ms, a second one {second * 1e3:.0f} ms (torch's one-time "
              "initialization was already paid in this process)")
    else:
        print(f"first capture in this process: {(one_time + first) * 1e3:.0f} ms, {one_time * 1e3:.0f} ms of "
              "it one-time: torch's fake tensors import\ntorch._dynamo on first use. The capture itself "
              f"took {first * 1e3:.0f} ms, a second one {second * 1e3:.0f} ms.")
    return 0 if same_out and same_log else 1


# -- 2. torch.compile and effectfx on a model whose layers log ---------------------------------------------

LAYER_LOG: list[float] = []
N_LAYERS = 4
TC_BACKEND = "aot_eager"


def _log_activation(x: torch.Tensor) -> None:
    LAYER_LOG.append(round(float(x.detach().norm()), 4))


def _define_layer_ops() -> tuple[Any, Any]:
    """Two identical ops logging the norm of a layer's input; only the second is also in torch's own
    (private) effect registry, ``torch.library._register_effectful_op``."""
    if not hasattr(torch.ops.efxdemo, "log_activation"):
        for name in ("log_activation", "log_activation_registered"):
            op = torch.library.custom_op(f"efxdemo::{name}", _log_activation, mutates_args=(),
                                         schema="(Tensor x) -> ()")
            op.register_fake(lambda x: None)
            efx.register_effect(op, key="log")
        from torch._library.effects import EffectType

        torch.library._register_effectful_op("efxdemo::log_activation_registered", EffectType.ORDERED)
    return torch.ops.efxdemo.log_activation, torch.ops.efxdemo.log_activation_registered


def logging_model(mark: Callable[[Any], Any], log: Any) -> nn.Module:
    """``N_LAYERS`` layers, each logging its input's norm then computing ``relu(Linear(x))``; ``mark``
    makes the layer's forward a region (``efx.region``, ``torch.compiler.nested_compile_region``, or
    nothing)."""

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @mark
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            log(x)
            return torch.relu(self.lin(x))

    torch.manual_seed(0)  # the same weights for every system
    return nn.Sequential(*[Layer() for _ in range(N_LAYERS)])


@dataclass
class StepResult:
    log: list[float]
    grads: list[torch.Tensor] | None
    status: str  # "ok", or what went wrong


def training_step(make: Callable[[], nn.Module], compiler: Callable[[nn.Module], Any]) -> StepResult:
    """One forward + backward of a fresh model; what it logged, its gradients, or what went wrong."""
    model = make()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    LAYER_LOG.clear()
    try:
        out = compiler(model)(x)
        if out.grad_fn is None:
            return StepResult(list(LAYER_LOG), None, "output has no grad_fn (no backward)")
        out.sum().backward()
    except Exception as exc:  # noqa: BLE001 - a comparator that cannot run is a result to show
        return StepResult(list(LAYER_LOG), None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
    return StepResult(list(LAYER_LOG), [p.grad for p in model.parameters()], "ok")


def _torch_compile(model: nn.Module) -> Any:
    torch._dynamo.reset()
    return torch.compile(model, backend=TC_BACKEND)


def run_comparison() -> int:
    """Eager, torch.compile and efx.compile on one training step; 0 when effectfx matches eager."""
    _rule(f"2. {N_LAYERS} logging layers, one training step: eager, torch.compile, effectfx")
    plain, registered = _define_layer_ops()
    region = torch.compiler.nested_compile_region
    eager = training_step(lambda: logging_model(lambda f: f, plain), lambda m: m)
    rows = [
        ("eager", eager),
        ("torch.compile, op unknown to torch",
         training_step(lambda: logging_model(region, plain), _torch_compile)),
        ("torch.compile, op in torch's private registry",
         training_step(lambda: logging_model(region, registered), _torch_compile)),
        ("effectfx (efx.compile)", training_step(lambda: logging_model(efx.region, plain), efx.compile)),
    ]
    print("each layer's forward is a region (@efx.region / torch.compiler.nested_compile_region) and "
          "logs the norm of its\ninput through a custom op that returns nothing; torch.compile uses "
          f"backend={TC_BACKEND!r}. Measured now:\n")
    width = max(len(name) for name, _ in rows)
    print(f"  {'':<{width}}  effects  gradients")
    for name, r in rows:
        print(f"  {name:<{width}}  {len(r.log)} of {N_LAYERS}   {_grads_text(r, eager)}")
    for name, r in rows[1:]:
        diff = first_difference([eager.log], [r.log])
        if diff:
            print(f"  {name}: first difference from eager's log: {diff}")
    print("\neffectfx needs nothing from torch's registry: an op that returns nothing is an effect (key "
          "'ordered'), or\nefx.register_effect(op, key) names its chain; a region shares one body and keeps "
          "its gradients.")
    efx_result = rows[-1][1]
    ok = efx_result.log == eager.log and _grads_text(efx_result, eager) == "equal eager's"
    return 0 if ok else 1


def _grads_text(r: StepResult, eager: StepResult) -> str:
    if r.status != "ok" or r.grads is None or eager.grads is None:
        return "none: " + r.status if r.status != "ok" else "none"
    if r is eager:
        return "(the reference)"
    same = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(r.grads, eager.grads))
    return "equal eager's" if same else "DIFFER from eager's"


def first_difference(eager_logs: Sequence[Sequence[Any]], other_logs: Sequence[Sequence[Any]]) -> str | None:
    """Where two runs' effect logs (one list per step) first differ, in words; None if they are equal."""
    for step, (a, b) in enumerate(zip(eager_logs, other_logs)):
        for i in range(max(len(a), len(b))):
            x, y = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
            if x != y:
                where = f"step {step}, " if len(eager_logs) > 1 else ""
                return f"{where}entry {i}: eager {_entry(x)}, got {_entry(y)}"
    if len(eager_logs) != len(other_logs):
        return f"{len(eager_logs)} steps logged by eager, {len(other_logs)} by the other"
    return None


def _entry(value: Any) -> str:
    return "nothing" if value is None else repr(value)


# -- 3. training the transformer example -------------------------------------------------------------------


def examples_dir() -> Path | None:
    """The repository's ``examples/`` (next to the ``effectfx`` package in a source checkout)."""
    for candidate in (Path(__file__).resolve().parents[2] / "examples", Path.cwd() / "examples"):
        if candidate.is_dir():
            return candidate
    return None


def load_example(name: str) -> ModuleType | None:
    """Import ``examples/<name>.py`` once per process (its custom ops are global), or None if absent."""
    module_name = f"effectfx_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    directory = examples_dir()
    if directory is None or not (directory / f"{name}.py").is_file():
        return None
    spec = importlib.util.spec_from_file_location(module_name, directory / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def run_training_demo(steps: int = 3, n_layers: int = 4) -> int:
    """Train the transformer example with efx.compile beside eager; 0 when everything matches."""
    example = load_example("transformer_memory")
    _rule("3. training examples/transformer_memory.py with efx.compile, beside eager")
    if example is None:
        print("examples/transformer_memory.py not found (not a source checkout): skipped")
        return 0
    result = example.compare(steps=steps, n_layers=n_layers)
    print(f"TinyTransformer, {n_layers} layers; Block.forward is an @efx.region. record_memory (key "
          "'memory') logs before each\nlayer, twice inside the block and in the block's backward. SGD "
          f"(lr {example.LR}) on counting sequences.\n")
    print(f"  {'step':>4}  {'loss eager':>10}  {'loss effectfx':>13}  effects (forward + backward)")
    runs = zip(result.eager.losses, result.effectfx.losses, result.effectfx.logs)
    for step, (a, b, log) in enumerate(runs):
        n_fwd = sum(entry[0] == "forward" for entry in log)
        print(f"  {step:>4}  {a:>10.4f}  {b:>13.4f}  {n_fwd} + {len(log) - n_fwd}")
    n_effects = sum(len(log) for log in result.effectfx.logs)
    diff = first_difference(result.eager.logs, result.effectfx.logs)
    print(f"\neffect logs identical: {result.logs_match} ({n_effects} effects over {steps} steps; first "
          f"difference: {diff or 'none'})\nlosses match: {result.losses_match}   parameters match: "
          f"{result.params_match} (max abs difference {result.max_param_diff:.1e})")
    return 0 if result.ok else 1


__all__ = ["add_arguments", "first_difference", "load_example", "run", "run_comparison", "run_demo",
           "run_training_demo"]
