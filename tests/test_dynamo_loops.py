"""Real training loops behind ``torch.compile(backend="effectfx")``: a nanoGPT-style loop (a small GPT, AdamW,
an effect per block) and Hugging Face's ``Trainer`` on a tiny GPT-2 give eager's losses and effect logs."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import transformers
from torch import nn
from torch.nn import functional as F

import effectfx as efx
from effectfx.testing import hf, recording
from effectfx.testing.dynamo import BackendCallables as Made
from effectfx.testing.dynamo import logged_gpt2

STEPS = 3


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()  # (Dynamo's recompile limit per code object)


# -- nanoGPT ------------------------------------------------------------------------------------------------
class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, block: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.heads = heads
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, block: int, name: str) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, block)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.record_memory(self.name)  # what a per-layer memory recorder does
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, block: int = 16, layers: int = 2, heads: int = 2,
                 width: int = 32) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(block, width)
        self.h = nn.ModuleList(Block(width, heads, block, f"block{i}") for i in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT's

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def nanogpt_loop(model: nn.Module, call: Any) -> tuple[list[float], list[tuple]]:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (1000,), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    with recording() as log:
        for _ in range(STEPS):
            starts = torch.randint(0, len(data) - 17, (4,), generator=g)
            x = torch.stack([data[s:s + 16] for s in starts])
            y = torch.stack([data[s + 1:s + 17] for s in starts])
            loss = call(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses, list(log)


def test_nanogpt_loop() -> None:
    torch.manual_seed(0)
    eager_model = GPT()
    model = copy.deepcopy(eager_model)
    losses, log = nanogpt_loop(eager_model, eager_model)
    with Made() as made:
        got_losses, got_log = nanogpt_loop(model, torch.compile(model, backend="effectfx"))
    assert [(c.stats.compiles, c.stats.calls) for c in made.callables] == [(1, STEPS)]
    assert log == [("record_memory", f"block{i}") for i in range(2)] * STEPS
    assert got_log == log
    assert got_losses == pytest.approx(losses, rel=1e-5)
    for (name, p), q in zip(eager_model.named_parameters(), model.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-6), name


# -- Hugging Face Trainer -----------------------------------------------------------------------------------
def dataset(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, hf.VOCAB, (8,), generator=g) for _ in range(n)]
    return [{"input_ids": ids, "labels": ids} for ids in rows]


def arguments(tmp: Any, **more: Any) -> Any:
    # a torch.compile'd model's forward takes (*args, **kwargs): Trainer would find no column it takes
    # (remove_unused_columns) and no labels to compute an evaluation loss with (label_names)
    return transformers.TrainingArguments(
        output_dir=str(tmp), max_steps=STEPS, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        save_strategy="no", report_to=[], use_cpu=True, logging_steps=1, remove_unused_columns=False,
        label_names=["labels"], disable_tqdm=True, **more)


def trainer_run(model: nn.Module, tmp: Any, **more: Any) -> tuple[list[float], float, list[tuple]]:
    trainer = transformers.Trainer(model=model, args=arguments(tmp, **more), train_dataset=dataset(8, 0),
                                   eval_dataset=dataset(4, 1))
    with recording() as log:
        trainer.train()
        evaluation = trainer.evaluate()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, evaluation["eval_loss"], list(log)


def test_hf_trainer_with_a_model_compiled_by_the_backend(tmp_path: Any) -> None:
    """``Trainer(model=torch.compile(model, backend="effectfx"))``: training and evaluation as eager's."""
    pytest.importorskip("accelerate")  # (Trainer needs it)
    eager_model = logged_gpt2(2)
    model = copy.deepcopy(eager_model)
    losses, eval_loss, log = trainer_run(eager_model, tmp_path / "eager")
    with Made() as made:
        compiled = torch.compile(model, backend="effectfx")
        got_losses, got_eval_loss, got_log = trainer_run(compiled, tmp_path / "efx")
    # training (3 steps), evaluation (no_grad: a graph of its own, 2 batches)
    assert [(c.stats.compiles, c.stats.calls) for c in made.callables] == [(1, STEPS), (1, 2)]
    layers = [("record_memory", f"layer{i}") for i in range(2)]
    assert log == layers * (STEPS + 2)  # 3 steps, 2 evaluation batches
    assert got_log == log
    assert len(losses) == STEPS and got_losses == pytest.approx(losses, rel=1e-5)
    assert got_eval_loss == pytest.approx(eval_loss, rel=1e-5)


@pytest.mark.xfail(raises=ValueError, strict=True,
                   reason="accelerate's TorchDynamoPlugin takes only the backend names of its DynamoBackend "
                          "enum ('EFFECTFX' is not a valid DynamoBackend)")
def test_hf_trainer_torch_compile_backend_argument(tmp_path: Any) -> None:
    pytest.importorskip("accelerate")
    eager_model = logged_gpt2(2)
    losses, eval_loss, log = trainer_run(copy.deepcopy(eager_model), tmp_path / "eager")
    got = trainer_run(eager_model, tmp_path / "efx", torch_compile=True, torch_compile_backend="effectfx")
    assert got == (pytest.approx(losses, rel=1e-5), pytest.approx(eval_loss, rel=1e-5), log)


def test_hf_trainer_torch_compile_of_an_efx_compiled_model(tmp_path: Any) -> None:
    """``Trainer(model=efx.compile(m), args=TrainingArguments(torch_compile=True))``: Trainer's
    ``torch.compile`` treats effectfx's call as opaque and runs its programs; training, evaluation and
    prediction as eager's."""
    pytest.importorskip("accelerate")
    eager_model = logged_gpt2(2)
    compiled = efx.compile(copy.deepcopy(eager_model))
    losses, eval_loss, log = trainer_run(eager_model, tmp_path / "eager")
    got_losses, got_eval_loss, got_log = trainer_run(compiled, tmp_path / "efx", torch_compile=True)
    assert got_log == log and len(log) == 2 * (STEPS + 2)
    assert got_losses == pytest.approx(losses, rel=1e-5)
    assert got_eval_loss == pytest.approx(eval_loss, rel=1e-5)
    assert compiled.stats.compiles >= 1 and compiled.stats.calls == STEPS + 2
    want = transformers.Trainer(model=eager_model, args=arguments(tmp_path / "p0")).predict(dataset(2, 2))
    got = transformers.Trainer(model=compiled, args=arguments(tmp_path / "p1", torch_compile=True)
                               ).predict(dataset(2, 2))
    torch.testing.assert_close(torch.as_tensor(got.predictions), torch.as_tensor(want.predictions),
                               rtol=1e-5, atol=1e-5)
