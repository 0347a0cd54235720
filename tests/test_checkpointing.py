"""Activation checkpointing as users turn it on: the backward recomputes what eager recomputes, effects
included, saves what eager saves, and a label the recompute passes to an effect again stays an operand
(one body for every layer).  transformers' ``gradient_checkpointing_enable`` wraps a layer's ``forward``
in ``__init_subclass__``: the recording subclass a capture watches a module through must not wrap it again
(``effectfx.guards.reads``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import effectfx as efx
from effectfx.testing import check_against_eager, hf
from effectfx.testing.effect_ops import recording

record = torch.ops.efxtest.record_memory


class Layer(torch.nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.name = name

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        record(self.name)
        return torch.relu(self.lin(x))

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False)


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Layer(f"b{i}") for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_label_the_recompute_logs_again_stays_an_operand() -> None:
    eager = check_against_eager(Stack(), torch.randn(2, 4, requires_grad=True))
    assert [e[1] for e in eager.log] == ["b0", "b1", "b2", "b2", "b1", "b0"]  # forward, then recompute
    compiled = efx.compile(Stack())
    compiled(torch.randn(2, 4, requires_grad=True))
    (prog,) = compiled.programs()
    assert len(prog.forward.bodies) == 1
    # the body's backward logs the label's input, not layer 0's 'b0': each backward call passes its own
    code = prog.backward.code()
    assert "torch.ops.efxtest.record_memory.default(name)" in code
    assert all(f"'b{i}'" in code for i in range(3)) and "record_memory.default('b" not in code


def saved_activation_bytes(run, params: list[torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for the backward, parameters excepted (they live anyway)."""
    own = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("checkpointed", [False, True])
def test_gpt2_gradient_checkpointing_recomputes_and_saves_as_eager(checkpointed: bool) -> None:
    model = hf.build("gpt2", logged=False)
    model.train()
    for i, block in enumerate(hf.layers_of(model, "gpt2")):
        block.attn.register_forward_pre_hook(lambda module, args, n=f"attn{i}": record(n))
    if checkpointed:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for block in hf.layers_of(model, "gpt2"):
        block.forward = efx.region(block.forward)
    batch = hf.batch("gpt2", torch.Generator().manual_seed(0), size=4)
    params = list(model.parameters())
    with recording() as eager_log:
        eager_saved = saved_activation_bytes(lambda: model(**batch).loss, params)
    eager_grads = [p.grad.clone() for p in params]
    names = [f"attn{i}" for i in range(hf.LAYERS)]
    assert [e[1] for e in eager_log] == names + (names[::-1] if checkpointed else [])
    compiled = efx.compile(model)
    for call in range(3):
        model.zero_grad()
        with recording() as log:
            if call == 0:  # the capture: effectfx refuses region calls under saved-tensor hooks
                compiled(**batch).loss.backward()
            else:
                saved = saved_activation_bytes(lambda: compiled(**batch).loss, params)
                assert saved == eager_saved  # checkpointing's memory saving is kept, to the byte
        assert log == eager_log
        for p, g in zip(params, eager_grads):
            torch.testing.assert_close(p.grad, g)
