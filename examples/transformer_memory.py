"""A small transformer with per-layer memory recording, trained for a few steps with ``efx.compile``.

* ``efxex::record_memory(prefix, module_name)`` is a custom op registered as an effect on key "memory"
  (a stand-in for a real memory profiler hook).  The model records one event before each layer, and the
  block records events itself, so every call of the block region carries effects.
* ``efxex::grad_probe(x, module_name)`` is the identity in forward; its backward formula records
  ``("backward", module_name)`` -- an effect that exists only in backward, threaded by backward tokens.
* ``Block.forward`` is an ``@efx.region``: traced once, called once per layer (its parameters are lifted
  to operands, so every layer shares one forward and one backward subgraph).

``main()`` trains an eager copy and an effectfx copy side by side (same seed, same data, SGD) and checks
that losses, the effect log (calls, arguments, order, count) and the final parameters match.  The data are
counting sequences (``s, s+1, s+2, ...`` mod the vocabulary, from random starts): next-token prediction
the model can learn, so the loss falls from the first steps.

Run it: ``python examples/transformer_memory.py`` (a few seconds on a CPU).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import effectfx as efx

LOG: list[tuple[str, str]] = []


@torch.library.custom_op("efxex::record_memory", mutates_args=())
def record_memory(prefix: str, module_name: str) -> None:
    LOG.append((prefix, module_name))


@record_memory.register_fake
def _(prefix: str, module_name: str) -> None:
    return None


efx.register_effect(record_memory, key="memory")


@torch.library.custom_op("efxex::grad_probe", mutates_args=())
def grad_probe(x: torch.Tensor, module_name: str) -> torch.Tensor:
    return x.clone()


@grad_probe.register_fake
def _(x: torch.Tensor, module_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def _grad_probe_setup(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.module_name = inputs[1]  # type: ignore[attr-defined]


def _grad_probe_backward(ctx: object, grad: torch.Tensor) -> tuple:
    torch.ops.efxex.record_memory("backward", ctx.module_name)  # type: ignore[attr-defined]
    return grad, None


grad_probe.register_autograd(_grad_probe_backward, setup_context=_grad_probe_setup)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, with memory records."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        head_dim = dim // self.heads
        torch.ops.efxex.record_memory("forward", "attention")
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(batch, seq, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(batch, seq, dim))
        torch.ops.efxex.record_memory("forward", "mlp")
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return torch.ops.efxex.grad_probe(x, "block")


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 32, heads: int = 4, n_layers: int = 4,
                 max_len: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for i, block in enumerate(self.blocks):
            torch.ops.efxex.record_memory("forward", f"layer{i}")
            x = block(x)
        torch.ops.efxex.record_memory("forward", "head")
        return self.head(self.ln_f(x))


@dataclass
class TrainingRun:
    losses: list[float]
    logs: list[list[tuple[str, str]]]  # the effect log of each step


LR = 0.5  # plain SGD on this small model: the loss falls visibly within three steps


def counting_batches(steps: int, batch: int = 8, length: int = 13, vocab: int = 32,
                     seed: int = 1) -> list[torch.Tensor]:
    """``steps`` batches of sequences ``s, s+1, ... (mod vocab)`` with random starts ``s``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, 1), generator=g) + torch.arange(length)) % vocab
            for _ in range(steps)]


def train(model: Callable[[torch.Tensor], torch.Tensor], params: list[nn.Parameter],
          batches: list[torch.Tensor], lr: float = LR) -> TrainingRun:
    """Train ``model`` (eager, or an ``efx.compile``d one) with SGD on next-token prediction."""
    opt = torch.optim.SGD(params, lr=lr)
    losses, logs = [], []
    for batch in batches:
        LOG.clear()
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        logs.append(list(LOG))
    LOG.clear()
    return TrainingRun(losses, logs)


@dataclass
class Comparison:
    eager: TrainingRun
    effectfx: TrainingRun
    max_param_diff: float
    compiled: efx.CompiledCallable

    @property
    def logs_match(self) -> bool:
        return self.eager.logs == self.effectfx.logs

    @property
    def losses_match(self) -> bool:
        return all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5)
                   for a, b in zip(self.eager.losses, self.effectfx.losses))

    @property
    def params_match(self) -> bool:
        return self.max_param_diff < 1e-4

    @property
    def ok(self) -> bool:
        return self.logs_match and self.losses_match and self.params_match


def compare(steps: int = 3, n_layers: int = 4, seed: int = 0) -> Comparison:
    """Train an eager model and an effectfx-compiled copy on the same batches."""
    torch.manual_seed(seed)
    eager_model = TinyTransformer(n_layers=n_layers)
    efx_model = copy.deepcopy(eager_model)
    batches = counting_batches(steps)
    eager = train(eager_model, list(eager_model.parameters()), batches)
    compiled = efx.compile(efx_model)
    effectfx = train(compiled, list(efx_model.parameters()), batches)
    with torch.no_grad():
        diff = max(float((a - b).abs().max()) for a, b in zip(eager_model.parameters(),
                                                               efx_model.parameters()))
    return Comparison(eager, effectfx, diff, compiled)


def side_by_side(a: list, b: list, titles: tuple[str, str] = ("eager", "effectfx")) -> str:
    width = max(len(str(x)) for x in [*a, titles[0]])
    lines = [f"    {titles[0]:<{width}}   {titles[1]}"]
    for x, y in zip(a, b):
        mark = " " if x == y else "!"
        lines.append(f"  {mark} {x!s:<{width}}   {y}")
    if len(a) != len(b):
        lines.append(f"  ! lengths differ: {len(a)} vs {len(b)}")
    return "\n".join(lines)


def main(steps: int = 3, n_layers: int = 4) -> int:
    result = compare(steps, n_layers)
    print(f"TinyTransformer: {n_layers} layers, trained {steps} steps with SGD, eager and efx.compile\n")
    print(f"{'step':>4}  {'eager loss':>11}  {'effectfx loss':>13}  effects")
    for i, (a, b, log) in enumerate(zip(result.eager.losses, result.effectfx.losses, result.effectfx.logs)):
        n_fwd = sum(p == "forward" for p, _ in log)
        print(f"{i:>4}  {a:>11.5f}  {b:>13.5f}  {len(log)} ({n_fwd} forward, {len(log) - n_fwd} backward)")
    print("\neffect log of the first step (one record_memory call per line):")
    print(side_by_side(result.eager.logs[0], result.effectfx.logs[0]))
    explanation = efx.explain(result.compiled)
    region = explanation.regions["Block.forward"]
    print(f"\nregion Block.forward: {len(region.bodies)} body, {region.calls} calls per step; "
          f"forward effects {list(region.forward_effects)}, backward effects {list(region.backward_effects)}")
    print(f"effect logs identical: {result.logs_match} "
          f"({sum(len(log) for log in result.effectfx.logs)} effects over {steps} steps)")
    print(f"losses match: {result.losses_match}")
    print(f"parameters match: {result.params_match} (max abs difference {result.max_param_diff:.2e})")
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
