"""Per-layer memory recording on a small GPT-2 (``transformers``, random weights from a config), one training
step with ``efx.compile`` beside eager.

* ``gpt2mem::record_memory(prefix, module_name, x)`` is a custom op registered as an effect on key "memory"
  (a stand-in for a memory profiler hook): it logs the prefix, the layer's name, the bytes of the activation
  ``x`` and its RMS.
* Each ``GPT2Block`` is wrapped, the way a user would without touching ``transformers``, in a
  ``MemoryRecorded`` module whose ``forward`` is an ``@efx.region``: it records, then calls the block with
  whatever arguments GPT-2 passes.  The layer's name is a plain ``str`` attribute that only the effect op
  reads, so it is an operand of the body and one body serves every layer (``efx.explain`` shows it);
  passing the name to any other op would bake it into the body, one body per layer.

Run it from the repository root: ``python examples/gpt2_memory.py`` (a few seconds on a CPU; needs
``transformers``, a test dependency).  Nothing is downloaded.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import transformers
from torch import nn

import effectfx as efx

LOG: list[tuple[str, str, int, float]] = []


@torch.library.custom_op("gpt2mem::record_memory", mutates_args=())
def record_memory(prefix: str, module_name: str, x: torch.Tensor) -> None:
    rms = float(x.detach().double().pow(2).mean().sqrt())
    LOG.append((prefix, module_name, x.numel() * x.element_size(), round(rms, 4)))


@record_memory.register_fake
def _(prefix: str, module_name: str, x: torch.Tensor) -> None:
    return None


efx.register_effect(torch.ops.gpt2mem.record_memory.default, key="memory")


class MemoryRecorded(nn.Module):
    """A GPT-2 block as a region, with a memory record before it."""

    def __init__(self, layer: nn.Module, name: str) -> None:
        super().__init__()
        self.layer = layer
        self.name = name

    @efx.region
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        torch.ops.gpt2mem.record_memory("forward", self.name, hidden_states)
        return self.layer(hidden_states, *args, **kwargs)


def build(n_layers: int = 4, seed: int = 0) -> nn.Module:
    """A small GPT-2 language model with random weights and recorded layers."""
    config = transformers.GPT2Config(
        vocab_size=100, n_positions=64, n_embd=64, n_layer=n_layers, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager", bos_token_id=0,
        eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the class name does not say it; transformers would warn
    for i, block in enumerate(model.transformer.h):
        model.transformer.h[i] = MemoryRecorded(block, f"layer{i}")
    return model


def train_step(model: nn.Module, call: Any, ids: torch.Tensor) -> tuple[float, list[tuple]]:
    """One SGD step of ``model`` through ``call`` (the model itself, or its compiled form)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    LOG.clear()
    loss = call(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    log = list(LOG)
    LOG.clear()
    return float(loss.detach()), log


def main(n_layers: int = 4) -> int:
    eager_model = build(n_layers)
    model = copy.deepcopy(eager_model)
    compiled = efx.compile(model)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    eager_loss, eager_log = train_step(eager_model, eager_model, ids)
    loss, log = train_step(model, compiled, ids)

    print(f"GPT-2 ({n_layers} layers, random weights), one SGD step with efx.compile\n")
    print("effect log (prefix, layer, activation bytes, rms):")
    for entry in log:
        print(f"  {entry}")
    with torch.no_grad():
        diff = max(float((a - b).abs().max()) for a, b in zip(eager_model.parameters(), model.parameters()))
    logs_match = log == eager_log
    losses_match = math.isclose(loss, eager_loss, rel_tol=1e-5)
    print(f"\neffect log identical to eager: {logs_match} ({len(log)} effects)")
    print(f"loss {loss:.6f} (eager {eager_loss:.6f}), losses match: {losses_match}")
    print(f"parameters after the step: max abs difference {diff:.2e}")

    explanation = efx.explain(compiled)
    region = explanation.regions["MemoryRecorded.forward"]
    bodies = "1 body" if len(region.bodies) == 1 else f"{len(region.bodies)} bodies"
    print(f"\nregion MemoryRecorded.forward: {bodies}, {region.calls} calls; "
          f"effects {list(region.effects)}")
    for body in region.bodies:
        print(f"  {body.identifier}: {body.reason}")
    for note in explanation.notes:
        print(f"note: {note}")
    return 0 if logs_match and losses_match and diff < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
