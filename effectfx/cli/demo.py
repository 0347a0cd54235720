"""``effectfx demo``: the seed example end to end, beside eager PyTorch; then, when the repository's
``examples/transformer_memory.py`` is present, a short training run of that model with ``efx.compile``,
its effect log shown beside eager's.  Exit status 0 only if outputs, effect logs and parameters match."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch

import effectfx as efx

EFFECT_LOG: list[tuple[str, ...]] = []


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


def seed_program(x: torch.Tensor) -> torch.Tensor:
    return repeated(repeated(x))


def _rule(title: str) -> None:
    print(f"\n{'=' * 8} {title} {'=' * (70 - len(title))}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=2, help="training steps of the transformer example")
    parser.add_argument("--layers", type=int, default=4, help="layers of the transformer example")
    parser.add_argument("--no-training", action="store_true", help="only the seed example")


def run(args: argparse.Namespace) -> int:
    seed_status = run_demo()
    if getattr(args, "no_training", False):
        return seed_status
    train_status = run_training_demo(getattr(args, "steps", 2), getattr(args, "layers", 4))
    return 0 if seed_status == 0 and train_status == 0 else 1


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


def run_training_demo(steps: int = 2, n_layers: int = 4) -> int:
    example = load_example("transformer_memory")
    _rule("training the transformer example: effect logs of eager and effectfx")
    if example is None:
        print("examples/transformer_memory.py not found (not a source checkout): skipped")
        return 0
    result = example.compare(steps=steps, n_layers=n_layers)
    print(f"TinyTransformer, {n_layers} layers (Block.forward is an @efx.region), {steps} SGD steps; "
          "record_memory on key 'memory' before each layer and inside the block, and in the block's "
          "backward")
    for step, (eager_log, efx_log) in enumerate(zip(result.eager.logs, result.effectfx.logs)):
        print(f"\nstep {step}: loss eager {result.eager.losses[step]:.5f}, "
              f"effectfx {result.effectfx.losses[step]:.5f}")
        print(example.side_by_side(eager_log, efx_log))
    n_effects = sum(len(log) for log in result.effectfx.logs)
    print(f"\neffect logs identical: {result.logs_match} ({n_effects} effects)   "
          f"losses match: {result.losses_match}   parameters match: {result.params_match} "
          f"(max abs difference {result.max_param_diff:.1e})")
    return 0 if result.ok else 1


def run_demo() -> int:
    x = torch.randn(4)
    _rule("captured form (the seed's 'Before')")
    print(efx.capture(seed_program, x, functionalize=False))
    _rule("functionalized form (the seed's 'After'): tokens thread the effects")
    prog = efx.capture(seed_program, x)
    print(prog)
    print(f"\nregion_traces: {prog.region_traces}   effects: {prog.region_effects}")

    _rule("running it beside eager")
    EFFECT_LOG.clear()
    expected = seed_program(x)
    eager_log = list(EFFECT_LOG)
    EFFECT_LOG.clear()
    got = prog(x)
    efx_log = list(EFFECT_LOG)
    width = max(len(str(e)) for e in eager_log + ["eager"])
    print(f"{'eager':<{width}}   effectfx")
    for a, b in zip(eager_log, efx_log):
        print(f"{a!s:<{width}}   {b}")
    same_out = torch.equal(expected, got)
    same_log = eager_log == efx_log
    print(f"\noutputs equal: {same_out}   effect logs identical: {same_log} ({len(efx_log)} effects)")
    return 0 if same_out and same_log else 1
