"""``backend="inductor"`` with symbolic sizes compiles every segment: no ``InductorFallbackWarning`` when a
model is trained over changing sequence lengths (``effectfx.backends.inductor_cache.input_metas``: a size
whose symbols no input has alone is one symbol of its own; ``inductor_segments``: a symbol only a stride has
is read from the stride).  The model runs compare with eager; the small tests pin each cause."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.nn import functional as F

import effectfx as efx
from effectfx.backends import inductor_cache as cache
from effectfx.backends import inductor_segments as segs
from effectfx.testing import hf

pytestmark = pytest.mark.filterwarnings("error::effectfx.backends.inductor_segments.InductorFallbackWarning")

z = cache.symbol
TOLERANCE = 1e-4


def test_a_size_made_of_symbols_no_input_has_alone_is_one_symbol() -> None:
    # (B*T, C) and its row stride, as a flattened batch reaches a loss's backward: B and T alone are nowhere
    fakes, _ = cache.example_inputs((((z(0) * z(1), 4), (4, 1), torch.float32, torch.device("cpu")),
                                     ((z(2),), (1,), torch.float32, torch.device("cpu"))),
                                    (2, 3, 5), FakeTensorMode(shape_env=ShapeEnv()))
    metas, hints = cache.input_metas(fakes)
    assert [m[:2] for m in metas] == [((z(0), 4), (4, 1)), ((z(1),), (1,))]
    assert hints == (6, 5)
    # ... but a product of symbols some input has alone stays what it is
    fakes, _ = cache.example_inputs((((z(0) * z(1), 4), (4, 1), torch.float32, torch.device("cpu")),
                                     ((z(1), z(0), 4), (4 * z(0), 4, 1), torch.float32, torch.device("cpu"))),
                                    (2, 3), FakeTensorMode(shape_env=ShapeEnv()))
    metas, hints = cache.input_metas(fakes)
    assert [m[:2] for m in metas] == [((z(0) * z(1), 4), (4, 1)), ((z(0), z(1), 4), (4 * z(1), 4, 1))]
    assert hints == (3, 2)  # (renamed in the order they are met)


def test_a_symbol_only_a_stride_has_is_read_from_the_stride() -> None:
    # x = idx[:, :-1]: sizes (B, T), row stride T + 1 -- a symbol of its own, in no size
    inputs = (((z(0), z(1)), (z(2), 1), torch.int64, torch.device("cpu")),)
    assert [segs._position(inputs, k) for k in range(3)] == [(0, 0, False), (0, 1, False), (0, 0, True)]
    idx = torch.zeros(2, 9, dtype=torch.int64)
    assert segs._evaluated(*inputs[0][:2], idx[:, :-1]) == (9, 1)


def test_saved_guards_read_back_with_every_symbol() -> None:
    guards = tuple(cache._parse(g) for g in ("Ne(z2, z4)", "z3*z4 <= 4096"))
    assert cache.guards_hold(guards, (2, 9, 10, 2, 9)) and not cache.guards_hold(guards, (2, 9, 9, 2, 9))
    assert guards[0].free_symbols == {z(2), z(4)}


# -- models trained over changing lengths -------------------------------------------------------------------
class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int, block: int) -> None:
        super().__init__()
        self.c_attn, self.c_proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.heads, self.dim = heads, dim
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for y in self.c_attn(x).split(self.dim, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, block: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(dim), _Attention(dim, heads, block), nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's model at test size: manual causal attention over a ``tril`` buffer, a tied head, the loss
    of ``logits.view(-1, V)`` against flattened targets."""

    def __init__(self, vocab: int = 64, block: int = 32, dim: int = 32, heads: int = 2, layers: int = 1
                 ) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(block, dim)
        self.h = nn.ModuleList([_Block(dim, heads, block) for _ in range(layers)])
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(0, idx.size(1), dtype=torch.long))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


def _nanogpt() -> tuple[nn.Module, Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]]:
    torch.manual_seed(0)
    return NanoGPT(), lambda m, x, y: m(x, y)


def _gpt2() -> tuple[nn.Module, Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]]:
    return hf.build("gpt2", seed=0), lambda m, x, y: m(input_ids=x, labels=y).loss


LENGTHS = (8, 9, 10, 12, 9)  # static, symbolic (its root deferred), then compiled, another size, again


@pytest.mark.slow
@pytest.mark.parametrize("build", [_nanogpt, _gpt2], ids=["nanogpt", "gpt2"])
def test_training_over_changing_lengths_compiles_every_segment(
        build: Callable[[], tuple[nn.Module, Callable[..., torch.Tensor]]], tmp_path: object,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # compiled here, not loaded
    model, loss_of = build()
    twin = copy.deepcopy(model)
    compiled = efx.compile(model, backend="inductor")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    g = torch.Generator().manual_seed(1)
    for t in LENGTHS:
        idx = torch.randint(0, 64, (2, t + 1), generator=g)
        x, y = idx[:, :-1], idx[:, 1:]  # views of one batch: row stride t + 1, targets' own symbols
        losses = []
        for m, call, opt in ((twin, twin, opts[1]), (model, compiled, opts[0])):
            loss = loss_of(call, x, y)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in m.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses.append((loss.detach(), grads))
        (want, want_grads), (got, got_grads) = losses
        torch.testing.assert_close(got, want, rtol=TOLERANCE, atol=TOLERANCE)
        for n in want_grads:
            torch.testing.assert_close(got_grads[n], want_grads[n], rtol=TOLERANCE, atol=TOLERANCE, msg=n)
    assert compiled.stats.compiles == 2  # static, then symbolic for every later length
    for program in compiled.programs():
        for graph in (program.forward, program.backward) if hasattr(program, "backward") else (program,):
            for name, segment in segs.segments_of(graph.graph_module):
                assert segment.outcome != "fell back", (graph.name, name, segment.why)

