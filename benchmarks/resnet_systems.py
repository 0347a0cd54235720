"""The model of ``benchmarks/resnet.py`` and the systems it compares: ``transformers``'
``ResNetForImageClassification`` with every residual block wrapped as a user would (an effect op with the
block's name, then the block), marked per system, and eager's reference results."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import effectfx as efx

RTOL, ATOL = 1e-4, 1e-5
BATCH, CHANNELS, SIZE, LABELS_N = 8, 3, 32, 10
CONFIG: dict[str, Any] = {"num_channels": CHANNELS, "embedding_size": 16, "hidden_sizes": [16, 32, 64, 128],
                          "depths": [2, 2, 2, 2], "layer_type": "basic", "num_labels": LABELS_N}
LR = 0.01
WARMUP_STEPS = 3  # >= 2: the second call compiles again (config.problem_type), see the module docstring

# system -> (block marker, compiler)
SYSTEMS: dict[str, tuple[str, str]] = {
    "eager": ("eager", "eager"),
    "efx": ("efx", "efx"),
    "tc": ("eager", "tc"),
    "tc_region": ("tc", "tc"),
    "efx_noregion": ("eager", "efx"),
    "tc_region_shared": ("tc", "tc"),
}
# blocks that all record the same label instead of their own name: the only form in which
# nested_compile_region reuses a body here (a per-block name is a constant its reuse check compares)
SHARED_LABEL = {"tc_region_shared": "block"}
LABELS = {
    "eager": "eager",
    "efx": "effectfx (blocks as regions)",
    "tc": "torch.compile (no regions)",
    "tc_region": "torch.compile (nested_compile_region)",
    "efx_noregion": "effectfx (no regions)",
    "tc_region_shared": "torch.compile (nested_compile_region, one label for all blocks)",
}
SHORT = {"eager": "eager", "efx": "effectfx", "tc": "tc", "tc_region": "tc+regions",
         "efx_noregion": "efx no-reg", "tc_region_shared": "tc+regions 1 label"}


# -- the model -------------------------------------------------------------------------------------
def _block_forward() -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    # a new function object per marker: ``nested_compile_region`` marks the function it is given (sets
    # attributes on it), so sharing one would make the unmarked blocks regions for torch.compile too
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxbench.record(self.name)
        return self.layer(x)

    forward.__qualname__ = "Block.forward"
    return forward


class Block(nn.Module):
    """One residual block that first records its name (``efxbench::record``), then runs the block."""

    def __init__(self, layer: nn.Module, name: str) -> None:
        super().__init__()
        self.layer = layer
        self.name = name

    forward = _block_forward()


class EfxBlock(Block):
    forward = efx.region(_block_forward())


class TcBlock(Block):
    forward = torch.compiler.nested_compile_region(_block_forward())


BLOCKS: dict[str, type[Block]] = {"eager": Block, "efx": EfxBlock, "tc": TcBlock}


def make_model(marker: str, seed: int = 0, config: dict[str, Any] | None = None,
               label: str | None = None) -> nn.Module:
    """A fresh ``ResNetForImageClassification`` (same ``seed``, same weights), its blocks wrapped (each
    recording its name, or ``label``), in training mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig(**(config or CONFIG)))
    for i, stage in enumerate(model.resnet.encoder.stages):
        for j, layer in enumerate(stage.layers):
            stage.layers[j] = BLOCKS[marker](layer, label or f"stages.{i}.layers.{j}")
    return model.train()


def build(system: str, config: dict[str, Any] | None = None) -> nn.Module:
    """A fresh model with the blocks ``system`` needs."""
    return make_model(SYSTEMS[system][0], config=config, label=SHARED_LABEL.get(system))


def n_blocks(config: dict[str, Any] | None = None) -> int:
    return sum((config or CONFIG)["depths"])


def compile_for(compiler: str, model: nn.Module) -> Callable[..., Any]:
    if compiler == "efx":
        return efx.compile(model)
    if compiler == "tc":
        return torch.compile(model, backend="aot_eager")
    return model


def batch(seed: int = 1, size: int = SIZE, batch_size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, CHANNELS, size, size, generator=g),
            torch.randint(0, LABELS_N, (batch_size,), generator=g))


def train_call(f: Callable[..., Any], pixels: torch.Tensor,
          labels: torch.Tensor) -> tuple[str, torch.Tensor | None, float]:
    """One forward (with labels) and ``loss.backward()``; returns status, loss and the forward's seconds."""
    start = time.perf_counter()
    loss = f(pixel_values=pixels, labels=labels).loss
    forward_s = time.perf_counter() - start
    if loss.grad_fn is None:
        return "loss has no grad_fn: backward impossible (forward time only)", loss, forward_s
    loss.backward()
    return "ok", loss, forward_s


# -- comparing with eager --------------------------------------------------------------------------
def snapshot(model: nn.Module, loss: torch.Tensor | None, grads: bool) -> dict[str, Any]:
    return {
        "loss": None if loss is None else loss.detach().clone(),
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()} if grads
        else {},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
    }


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a, b, rtol=RTOL, atol=ATOL))


def compare(got: dict[str, Any], want: dict[str, Any], parts: tuple[str, ...]) -> dict[str, Any]:
    """Per part (loss, grads, params, buffers): does it match eager's, and which names do not."""
    out: dict[str, Any] = {}
    for part in parts:
        if part == "loss":
            out["loss_matches"] = _close(got["loss"], want["loss"])
            out["loss"] = None if got["loss"] is None else float(got["loss"])
            out["eager_loss"] = float(want["loss"])
            continue
        bad = sorted(n for n in want[part] if n not in got[part] or not _close(got[part][n], want[part][n]))
        out[f"{part}_matches"] = not bad
        out[f"{part}_compared"] = len(want[part])
        out[f"{part}_mismatched"] = bad[:10] + ([f"... {len(bad) - 10} more"] if len(bad) > 10 else [])
    out["matches_eager"] = all(out[f"{p}_matches"] for p in parts)
    return out


def references(steps: int) -> dict[str, Any]:
    """Eager's loss, gradients and buffers after the first step, and its parameters and buffers after
    ``steps`` SGD steps (the steady-state warm-up)."""
    pixels, labels = batch()
    model = make_model("eager")
    loss = model(pixel_values=pixels, labels=labels).loss
    loss.backward()
    first = snapshot(model, loss, grads=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.step()
    opt.zero_grad()
    for _ in range(steps - 1):
        model(pixel_values=pixels, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"first": first, "warm": snapshot(model, None, grads=False)}
