"""Helpers for testing effectfx behind ``torch.compile(backend="effectfx")``: a layer that records its name, a
tiny GPT-2 made of them, and the compiled callables the backend makes (one per Dynamo graph)."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import transformers
from torch import nn

from ..drivers import dynamo_backend
from ..drivers.callable import CompiledCallable
from . import hf


class Logged(nn.Module):
    """A layer that records its name (``efxtest::record_memory``, key "memory") before running."""

    def __init__(self, layer: nn.Module, name: str) -> None:
        super().__init__()
        self.layer = layer
        self.name = name

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        torch.ops.efxtest.record_memory(self.name)
        return self.layer(hidden, *args, **kwargs)


def logged_gpt2(layers: int = 2) -> nn.Module:
    """GPT-2 from ``hf.gpt2_config()`` with ``layers`` blocks, each a :class:`Logged` ``layer{i}``."""
    torch.manual_seed(0)
    config = hf.gpt2_config()
    config.n_layer = layers
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    blocks = hf.layers_of(model, "gpt2")
    for i, block in enumerate(blocks):
        blocks[i] = Logged(block, f"layer{i}")
    return model


class BackendCallables:
    """While entered: the compiled callables the backend makes (``callables``, one per Dynamo graph)."""

    def __init__(self) -> None:
        self.callables: list[CompiledCallable] = []
        outer = self

        class Recorded(CompiledCallable):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                outer.callables.append(self)

        self.patch = mock.patch.object(dynamo_backend, "CompiledCallable", Recorded)

    def __enter__(self) -> BackendCallables:
        self.patch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.patch.__exit__(*exc)
