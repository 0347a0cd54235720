"""Per-layer memory recording on a small GPT-2 (``transformers``, random weights from a config), one training
step with ``efx.compile`` beside eager.

* ``gpt2mem::record_memory(prefix, module_name, x)`` is a custom op registered as an effect on key "memory"
  (a stand-in for a memory profiler hook): it logs the prefix, the layer's name, the bytes of the activation
  ``x`` and its RMS.
* ``gpt2mem::grad_probe(x, module_name)`` is the identity in forward; its backward formula calls
  ``record_memory("backward", module_name, grad)``: an effect that exists only in backward.
* Each ``GPT2Block`` is wrapped, the way a user would without touching ``transformers``, in a
  ``MemoryRecorded`` module whose ``forward`` is an ``@efx.region``: it records, calls the block with
  whatever arguments GPT-2 passes, and probes the gradient of the block's output.  The layer's name is a
  plain ``str`` attribute handed to the effect op.

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


@torch.library.custom_op("gpt2mem::grad_probe", mutates_args=())
def grad_probe(x: torch.Tensor, module_name: str) -> torch.Tensor:
    return x.clone()


@grad_probe.register_fake
def _(x: torch.Tensor, module_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _grad_probe_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.module_name = inputs[1]


def _grad_probe_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    torch.ops.gpt2mem.record_memory("backward", ctx.module_name, grad)
    return grad, None


grad_probe.register_autograd(_grad_probe_backward, setup_context=_grad_probe_setup)


class MemoryRecorded(nn.Module):
    """A GPT-2 block as a region, with a memory record before it and a gradient probe after it."""

    def __init__(self, layer: nn.Module, name: str) -> None:
        super().__init__()
        self.layer = layer
        self.name = name

    @efx.region
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        torch.ops.gpt2mem.record_memory("forward", self.name, hidden_states)
        out = self.layer(hidden_states, *args, **kwargs)
        return torch.ops.gpt2mem.grad_probe(out, self.name)


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
    print(f"\nregion MemoryRecorded.forward: {len(region.bodies)} body(ies), {region.calls} calls; "
          f"forward effects {list(region.forward_effects)}, backward effects {list(region.backward_effects)}")
    for body in region.bodies:
        print(f"  {body.identifier}: {body.reason}")
    for note in explanation.notes:
        print(f"note: {note}")
    return 0 if logs_match and losses_match and diff < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
