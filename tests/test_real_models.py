"""Real models: GPT-2, Llama, BERT and ViT from ``transformers`` (random weights, built from
configs) trained 3 SGD steps with ``efx.compile`` beside eager, every layer a logged region
(effectfx.testing.hf)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx.testing import hf, recording

KINDS = ("gpt2", "llama", "bert", "vit")
STEPS = 3
REGION = "LoggedLayer.forward"


@dataclass
class Pair:
    eager_model: nn.Module
    model: nn.Module
    compiled: efx.CompiledCallable
    eager: hf.TrainRun
    effectfx: hf.TrainRun


@pytest.fixture(scope="module", params=KINDS)
def pair(request: pytest.FixtureRequest) -> Pair:
    eager_model = hf.build(request.param, seed=0)
    model = copy.deepcopy(eager_model)
    g = torch.Generator().manual_seed(1)
    batches = [hf.batch(request.param, g) for _ in range(STEPS)]
    compiled = efx.compile(model)
    return Pair(eager_model, model, compiled, hf.train(eager_model, eager_model, batches),
                hf.train(model, compiled, batches))


def test_training_matches_eager(pair: Pair) -> None:
    eager, got = pair.eager, pair.effectfx
    assert got.losses == pytest.approx(eager.losses, rel=1e-5)
    assert got.losses[0] != got.losses[-1]  # the parameters moved
    # the effect log: same calls, same arguments, same order, same count
    assert eager.log == [("record_memory", f"layer{i}") for i in range(hf.LAYERS)] * STEPS
    assert got.log == eager.log
    for step, (ge, gc) in enumerate(zip(eager.grads, got.grads)):
        assert ge.keys() == gc.keys(), step
        for name in ge:
            assert torch.allclose(ge[name], gc[name], rtol=1e-5, atol=1e-6), (step, name)
    for (name, p), q in zip(pair.eager_model.named_parameters(), pair.model.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), name
    assert pair.compiled.stats.compiles == 1 and pair.compiled.stats.calls == STEPS


def test_layer_region_is_called_once_per_layer(pair: Pair) -> None:
    region = efx.explain(pair.compiled).regions[REGION]
    assert region.calls == hf.LAYERS
    assert region.forward_effects == ("memory",)


def test_layer_region_has_one_body(pair: Pair) -> None:
    # the layers differ only in plain attributes (``layer_idx``, which no traced op reads without a
    # KV cache, and the ``name`` label): one body serves all of them, the label an operand of the effect.
    region = efx.explain(pair.compiled).regions[REGION]
    assert len(region.bodies) == 1, [b.differences for b in region.bodies]


class MHABlock(nn.Module):
    """torch's own nn.MultiheadAttention (its in-projection unflattens: a Python Tensor method) in a region
    that records an effect."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True, dropout=0.0)

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.log_tensor(x, "mha in")
        return x + self.attn(x, x, x, need_weights=False)[0]


def test_multihead_attention_trains_as_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(MHABlock(), MHABlock())
    twin = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    compiled = efx.compile(model)
    with recording() as want:
        twin(x).square().mean().backward()
    with recording() as got:
        out = compiled(x)
        out.square().mean().backward()
    torch.testing.assert_close(out, twin(x))
    assert got == want and len(got) == 2
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    assert efx.compile(lambda t: t.unflatten(-1, (2, -1)) * 2)(x).shape == (2, 5, 2, 8)
