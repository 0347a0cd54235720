"""Updates of a program's inputs made where the inputs live (``effectfx.passes.reinplace``): the optimizer of
a compiled step updates parameters and state in place (golden graph), and generated programs of in-place
updates, reads, views and results of buffers give eager's results, buffers and returned buffers (the
module's own tensors) after every call."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from torch import nn

import effectfx as efx

STEP_UPDATE = """
    _foreach_mul = torch.ops.aten._foreach_mul_.Scalar([lifted_2, lifted_3], 0.9)
    _foreach_add = torch.ops.aten._foreach_add_.List([lifted_2, lifted_3], [mm, view])
    _foreach_add_1 = torch.ops.aten._foreach_add_.List([lifted, lifted_1], [lifted_2, lifted_3], alpha = -0.5)
"""


def test_golden_an_optimizer_updates_in_place() -> None:
    """SGD with momentum, its second step: the momentum buffers and the parameters are updated in place
    (``_foreach_*_``) and are themselves the program's new values: nothing is copied back."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.5, momentum=0.9)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = lin(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    compiled = efx.compile(step)
    for _ in range(2):
        compiled(torch.randn(3, 4))
    code = compiled.programs()[-1].code()
    update = [line.strip() for line in code.splitlines() if "_foreach" in line]
    assert update == [line.strip() for line in STEP_UPDATE.strip().splitlines()], code
    assert code.rstrip().endswith("return (detach_2, lifted, lifted_1, lifted_2, lifted_3)"), code


class Buffers(nn.Module):
    def __init__(self, ops: list[tuple]) -> None:
        super().__init__()
        self.register_buffer("a", torch.arange(4.0))
        self.register_buffer("b", torch.ones(2, 2))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> tuple:
        kept: list[torch.Tensor] = [x]
        outs: list[torch.Tensor] = []
        for op, name, k, c in self.ops:
            buf = getattr(self, name)
            if op == "add_":
                buf.add_(c)
            elif op == "mul_":
                buf.mul_(kept[k % len(kept)].sum() if c < 0 else c)
            elif op == "keep":
                kept.append(buf * c)
            elif op == "copy_":
                buf.copy_(kept[k % len(kept)].sum() + buf * c)
            elif op == "return":
                outs.append(buf)
            elif op == "return_view":
                outs.append(buf.view(-1))
            elif op == "return_kept":
                outs.append(kept[k % len(kept)])
        return tuple(outs)


OPS = st.tuples(st.sampled_from(["add_", "mul_", "keep", "copy_", "return", "return_view", "return_kept"]),
                st.sampled_from(["a", "b"]), st.integers(0, 3), st.sampled_from([-1.0, 0.5, 2.0]))


def _snapshot(outs: tuple, module: nn.Module) -> list[Any]:
    return [o.clone() for o in outs] + [module.a.clone(), module.b.clone()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(OPS, min_size=1, max_size=8))
def test_generated_buffer_updates_match_eager(ops: list[tuple]) -> None:
    note(repr(ops))
    eager, mine = Buffers(ops), Buffers(ops)
    compiled = efx.compile(mine)
    for k in range(3):
        x = torch.full((4,), float(k + 1))
        want, got = eager(x), compiled(x)
        assert len(want) == len(got)
        for w, g in zip(_snapshot(want, eager), _snapshot(got, mine)):
            assert torch.equal(w, g)
        # a returned buffer is the module's own tensor, as eager returns it
        for w, g in zip(want, got):
            assert (w is eager.a) == (g is mine.a) and (w is eager.b) == (g is mine.b)
