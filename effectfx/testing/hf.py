"""Small Hugging Face ``transformers`` models (random weights, built from configs) with logged layer regions.

The builders make GPT-2, Llama, BERT and ViT at test size (hidden 64, 4 layers, 4 heads, vocab 100, 64
positions, no dropout, eager attention, no KV cache): nothing is downloaded.  :func:`log_layers` makes every
decoder/encoder layer a region the way a user would without touching ``transformers``' code: it swaps each
layer for a :class:`LoggedLayer` whose ``forward`` is an ``@efx.region`` that records the layer's name on
key "memory" and then calls the original layer with whatever arguments the model passes.

``transformers`` is a test dependency only; importing this module without it raises ``ImportError``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

import effectfx as efx

from . import effect_ops  # noqa: F401  (registers the efxtest ops)
from .effect_ops import recording

VOCAB = 100
HIDDEN = 64
LAYERS = 4
HEADS = 4
POSITIONS = 64

# Model kind -> the dotted path of its ModuleList of decoder/encoder layers.
LAYER_LISTS = {
    "gpt2": "transformer.h",
    "llama": "model.layers",
    "bert": "bert.encoder.layer",
    "vit": "vit.layers",
}
IMAGE, PATCH, CLASSES = 16, 4, 5


# Random-weight models have no tokenizer; special token ids only have to lie inside the vocabulary
# (transformers warns about GPT-2's default 50256 otherwise).
_TOKENS = {"bos_token_id": 0, "eos_token_id": 0}


def gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        use_cache=False, attn_implementation="eager", **_TOKENS)


def llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=POSITIONS,
        attention_dropout=0.0, use_cache=False, attn_implementation="eager", **_TOKENS)


def bert_config() -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN, max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, use_cache=False, attn_implementation="eager", **_TOKENS)


def vit_config() -> transformers.ViTConfig:
    # the problem type is set up front: transformers sets it on the first call otherwise, a changed
    # attribute that captures again
    return transformers.ViTConfig(
        image_size=IMAGE, patch_size=PATCH, num_channels=3, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=4 * HIDDEN, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=CLASSES, problem_type="single_label_classification",
        attn_implementation="eager")


def gpt2() -> nn.Module:
    """A small ``GPT2LMHeadModel`` with random weights (``model(ids, labels=ids).loss``)."""
    model = transformers.GPT2LMHeadModel(gpt2_config())
    # its class name has no "ForCausalLM" in it, so transformers would pick that loss with a warning
    model.loss_type = "ForCausalLM"
    return model


def llama() -> nn.Module:
    """A small ``LlamaForCausalLM`` with random weights (``model(ids, labels=ids).loss``)."""
    return transformers.LlamaForCausalLM(llama_config())


def bert() -> nn.Module:
    """A small ``BertForMaskedLM`` with random weights (``model(ids, labels=ids).loss``)."""
    return transformers.BertForMaskedLM(bert_config())


def vit() -> nn.Module:
    """A small ``ViTForImageClassification`` with random weights (``model(pixel_values=..., labels=...)``)."""
    return transformers.ViTForImageClassification(vit_config())


BUILDERS: dict[str, Callable[[], nn.Module]] = {"gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit}


def batch(kind: str, generator: torch.Generator, size: int = 2) -> dict[str, torch.Tensor]:
    """The keyword arguments of one training call of a model of ``kind`` (a loss comes back)."""
    if kind == "vit":
        return {"pixel_values": torch.randn(size, 3, IMAGE, IMAGE, generator=generator),
                "labels": torch.randint(0, CLASSES, (size,), generator=generator)}
    ids = torch.randint(0, VOCAB, (size, 8), generator=generator)
    return {"input_ids": ids, "labels": ids}


class LoggedLayer(nn.Module):
    """One model layer as a region that first records ``self.name`` on effect key "memory".

    The label is a plain ``str`` attribute passed to the effect op as an operand, so that one traced body can
    serve every layer once region identity treats such labels as operands rather than as part of the key.
    """

    def __init__(self, layer: nn.Module, name: str) -> None:
        super().__init__()
        self.layer = layer
        self.name = name

    @efx.region
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        torch.ops.efxtest.record_memory(self.name)
        return self.layer(*args, **kwargs)


def layers_of(model: nn.Module, kind: str) -> nn.ModuleList:
    """The ``ModuleList`` of decoder/encoder layers of a model built by :data:`BUILDERS`."""
    return model.get_submodule(LAYER_LISTS[kind])  # type: ignore[return-value]


def log_layers(model: nn.Module, kind: str) -> nn.Module:
    """Wrap every layer of ``model`` (in place) in a :class:`LoggedLayer` named ``layer<i>``; returns it."""
    layers = layers_of(model, kind)
    for i, layer in enumerate(layers):
        layers[i] = LoggedLayer(layer, f"layer{i}")
    return model


def build(kind: str, seed: int = 0, logged: bool = True) -> nn.Module:
    """A seeded model of ``kind`` (a key of :data:`BUILDERS`), its layers logged unless ``logged=False``."""
    torch.manual_seed(seed)
    model = BUILDERS[kind]()
    return log_layers(model, kind) if logged else model


__all__ = ["BUILDERS", "LAYER_LISTS", "LoggedLayer", "batch", "bert", "bert_config", "build", "gpt2",
           "gpt2_config", "layers_of", "llama", "llama_config", "log_layers", "vit", "vit_config"]


@dataclass
class TrainRun:
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]  # per step, before the optimizer step, by parameter name
    log: list[tuple]  # the effect log of all steps


def train(model: nn.Module, call: Callable[..., Any], batches: list[dict[str, torch.Tensor]],
          lr: float = 0.1) -> TrainRun:
    """SGD steps of ``call(**batch).loss`` on ``model``'s parameters: the losses, each step's gradients (a
    ``torch.compile``'d submodule's ``._orig_mod`` left out of their names) and the effect log."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    with recording() as log:
        for inputs in batches:
            loss = call(**inputs).loss
            loss.backward()
            grads.append({n.replace("._orig_mod", ""): p.grad.clone()
                          for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return TrainRun(losses, grads, list(log))
