"""Profiler ranges in captured code (``effectfx.interposers.profiler``): ``record_function`` opens and closes
eager's ranges on every call, in every form, ``efx.compile`` and save/load; its name is an operand, so
``record_function(self.name)`` keeps one body for every layer."""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import effectfx as efx
from effectfx.testing.differential import FORMS
from effectfx.testing.effect_ops import recording

NAMES = {"model_forward", "block0", "block1", "block2", "helper"}


class Block(torch.nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.name = name

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with record_function(self.name):
            torch.ops.efxtest.record_memory(self.name)
            return torch.relu(self.lin(x))


@record_function("helper")
def helper(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(f"block{i}") for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autograd.profiler.record_function("model_forward"):
            for block in self.blocks:
                x = block(x)
        return helper(x)


def ranges(fn, x: torch.Tensor, steps: int = 2) -> tuple[list[str], list]:
    """The ranges a profiler sees over ``steps`` training steps, in order, and the effect log."""
    with recording() as log, profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn(x).sum().backward()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    return [e.name for e in events if e.name in NAMES], log


def expected() -> list[str]:
    return ["model_forward", "block0", "block1", "block2", "helper"] * 2


@pytest.mark.parametrize("form", ["compile", *FORMS])
def test_ranges_on_every_call_as_eager(form: str) -> None:
    model, x = Model(), torch.randn(2, 4, requires_grad=True)
    eager, eager_log = ranges(model, x)
    assert eager == expected()
    if form == "compile":
        fn = efx.compile(model)
    else:
        with recording() as capture_log, profile(activities=[ProfilerActivity.CPU]) as prof:
            fn = FORMS[form](model, (x,), {})
        assert capture_log == [] and not [e for e in prof.events() if e.name in NAMES]  # capture runs none
    got, log = ranges(fn, x)
    assert got == eager and log == eager_log


BODY = """\
def Block_forward_subgraph0(self, token_memory, token_profiler, x, name, lin_weight, lin_bias):
    with_effects = effectfx.ops.with_effects(token_profiler, torch.ops.effectfx.range_enter.default, name)
    getitem = with_effects[0]
    with_effects_1 = effectfx.ops.with_effects(token_memory, torch.ops.efxtest.record_memory.default, name)
    getitem_1 = with_effects_1[0]
    t = torch.ops.aten.t.default(lin_weight)
    addmm = torch.ops.aten.addmm.default(lin_bias, x, t)
    relu = torch.ops.aten.relu.default(addmm)
    with_effects_2 = effectfx.ops.with_effects(getitem, torch.ops.effectfx.range_exit.default)
    getitem_2 = with_effects_2[0]
    return (getitem_1, getitem_2, relu)"""


def test_a_range_named_by_a_layer_keeps_one_body() -> None:
    """Golden: the range is a chain of its own ("profiler"), its name the body's label operand."""
    model, x = Model(), torch.randn(2, 4)
    with torch.no_grad():
        prog = efx.capture(model, x)
    assert len(prog.bodies) == 1
    text = prog.code()
    assert BODY in text
    for i in range(3):
        assert f"'block{i}', blocks_{i}_lin_weight" in text  # each call site passes its own name


def test_saved_and_loaded_ranges(tmp_path: pathlib.Path) -> None:
    model, x = Model(), torch.randn(2, 4)
    with torch.no_grad():
        prog = efx.remove_effect_tokens(efx.capture(model, x))
    prog.save(tmp_path / "p.zip")
    loaded = efx.load(tmp_path / "p.zip")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loaded(x)
        with torch.no_grad():
            model(x)
    names = [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start) if e.name in NAMES]
    assert names == ["model_forward", "block0", "block1", "block2", "helper"] * 2


def test_profile_regions_opens_a_range_per_region_call() -> None:
    model, x = Model(), torch.randn(2, 4, requires_grad=True)
    compiled = efx.compile(model, profile_regions=True)
    compiled(x)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        compiled(x).sum().backward()
    names = [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start)
             if e.name in NAMES or e.name.startswith("region:")]
    assert names == ["model_forward", *[n for i in range(3) for n in ("region:Block.forward", f"block{i}")],
                     "helper"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:  # an option: eager and efx.compile have none
        efx.compile(model)(x)
    assert not [e for e in prof.events() if e.name.startswith("region:")]


def test_a_range_in_a_checkpointed_layer_opens_again_in_backward() -> None:
    """Eager's recompute runs the layer again in backward, its range too: forward ranges, then backward's."""
    from torch.utils.checkpoint import checkpoint

    class Layer(torch.nn.Module):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.name = name

        def inner(self, x: torch.Tensor) -> torch.Tensor:
            with record_function(self.name):
                return torch.relu(self.lin(x))

        @efx.region
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checkpoint(self.inner, x, use_reentrant=False)

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Layer(f"block{i}") for i in range(3)])
    x = torch.randn(2, 4, requires_grad=True)
    eager, _ = ranges(model, x, steps=1)
    assert eager == ["block0", "block1", "block2", "block2", "block1", "block0"]
    compiled = efx.compile(model)
    compiled(x).sum().backward()
    got, _ = ranges(compiled, x, steps=1)
    assert got == eager


def test_gpt2_layers_in_ranges() -> None:
    from effectfx.testing import hf

    model = hf.build("gpt2")
    for layer in hf.layers_of(model, "gpt2"):
        inner = layer.layer

        def forward(*args, _inner=inner, **kwargs):
            with record_function(f"attn_block{_inner.attn.layer_idx}"):
                return type(_inner).forward(_inner, *args, **kwargs)

        inner.forward = forward
    batch = hf.batch("gpt2", torch.Generator().manual_seed(0))
    names = [f"attn_block{i}" for i in range(hf.LAYERS)]

    def seen(fn) -> list[str]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(**batch).loss.backward()
        return [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start) if e.name in names]

    compiled = efx.compile(model)
    compiled(**batch)
    assert seen(compiled) == seen(model) == names
