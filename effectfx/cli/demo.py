"""``effectfx demo``: the seed example end to end, beside eager PyTorch."""

from __future__ import annotations

import argparse

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
    pass


def run(args: argparse.Namespace) -> int:
    return run_demo()


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
