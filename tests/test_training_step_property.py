"""Generated training steps against eager (Note [Training step]): an optimizer and its options, clipping,
``zero_grad`` before or after the backward (or never), effects between the phases, several calls -- every
output, parameter, gradient, optimizer state entry and the effect log after every call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn

import effectfx as efx
import effectfx.testing  # noqa: F401  (registers the efxtest:: ops)
from effectfx.testing.effect_ops import recording

R = torch.ops.efxtest

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda ps, **o: torch.optim.SGD(ps, lr=0.1, **o),
    "adam": lambda ps, **o: torch.optim.Adam(ps, lr=0.01, **o),
    "adamw": lambda ps, **o: torch.optim.AdamW(ps, lr=0.01, **o),
}
OPTIONS = {
    "sgd": st.fixed_dictionaries({}, optional={"momentum": st.sampled_from([0.0, 0.9]),
                                               "weight_decay": st.sampled_from([0.0, 0.01]),
                                               "foreach": st.booleans()}),
    "adam": st.fixed_dictionaries({}, optional={"amsgrad": st.booleans(), "weight_decay": st.just(0.01),
                                                "foreach": st.booleans()}),
    "adamw": st.fixed_dictionaries({}, optional={"amsgrad": st.booleans(), "foreach": st.booleans()}),
}


PHASES = ["forward", "backward", "clipped", "updated"]


@st.composite
def steps(draw: Any) -> dict[str, Any]:
    name = draw(st.sampled_from(sorted(OPTIMIZERS)))
    return {
        "optimizer": name,
        "options": draw(OPTIONS[name]),
        "clip": draw(st.sampled_from([None, 0.1, 10.0])),
        "zero": draw(st.sampled_from(["after", "before", "keep", "never"])),
        "effects": draw(st.lists(st.sampled_from(PHASES), unique=True)),
        "frozen": draw(st.booleans()),  # a parameter that needs no gradient
        "calls": draw(st.integers(2, 4)),
    }


def _build(spec: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer, Callable[[torch.Tensor], Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    if spec["frozen"]:
        model[0].bias.requires_grad_(False)
    opt = OPTIMIZERS[spec["optimizer"]](model.parameters(), **spec["options"])
    effects, zero = spec["effects"], spec["zero"]

    def mark(phase: str, value: torch.Tensor | None = None) -> None:
        if phase in effects:
            if value is None:
                R.record_memory(phase)
            else:
                R.log_tensor(value, phase)

    def step(x: torch.Tensor) -> torch.Tensor:
        if zero == "before":
            opt.zero_grad()
        loss = model(x).sin().mean()
        mark("forward", loss.detach())
        loss.backward()
        mark("backward", model[2].weight.grad)
        if spec["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
            mark("clipped", model[2].weight.grad)
        opt.step()
        mark("updated", model[2].weight.detach())
        if zero in ("after", "keep"):
            opt.zero_grad(set_to_none=zero == "after")
        return loss

    return model, opt, step


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_generated_steps_match_eager(spec: dict[str, Any]) -> None:
    note(repr(spec))
    m1, o1, eager = _build(spec)
    m2, o2, step = _build(spec)
    compiled = efx.compile(step)
    generator = torch.Generator().manual_seed(1)
    for _ in range(spec["calls"]):
        x = torch.randn(5, 4, generator=generator)
        with recording() as want:
            expected = eager(x)
        with recording() as got:
            out = compiled(x)
        assert _close(out, expected)
        assert [e[:2] for e in got] == [e[:2] for e in want]
        assert all(g[2:3] == w[2:3] and abs(g[-1] - w[-1]) <= 1e-3 for g, w in zip(got, want) if len(g) > 2)
        for p, q in zip(m1.parameters(), m2.parameters()):
            assert _close(p, q)
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert _close(p.grad, q.grad)
            assert o1.state[p].keys() == o2.state[q].keys()
            assert all(_close(v, o2.state[q][k]) for k, v in o1.state[p].items())
    # a program for the first call, one once the state exists, one once .grad holds tensors to add into
    assert compiled.stats.compiles <= 3
