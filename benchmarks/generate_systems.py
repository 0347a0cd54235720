"""The systems of ``benchmarks/generate.py``: GPT-2 (``effectfx.testing.hf``: 4 layers, hidden 64, random
weights, every layer a ``LoggedLayer`` region recording its name with ``efxtest::record_memory``) generating
greedily, eagerly, through ``efx.compile(model)`` and through ``torch.compile``, with transformers'
``StaticCache`` or default ``DynamicCache``.

* ``eager_static``, ``eager_dynamic``: ``model.generate`` (the references);
* ``efx_static``, ``efx_dynamic``: ``efx.compile(model).generate``;
* ``tc_static``: ``model.forward = torch.compile(model.forward, mode="default")``, then ``model.generate``
  (transformers' own recipe; ``torch.compile(model)`` returns an ``OptimizedModule`` whose ``generate`` is
  the model's, calling the uncompiled model: that is ``tc_module``, measured for its first call only);
* ``*_pure``: the same model built with ``hf.build("gpt2", logged=False)`` (no effect op): torch.compile
  drops the effect op (it is registered with effectfx only), so its effect-free run is the fair comparison;
* ``tc_static_ordered`` (first call only): ``tc_static`` with the op also in torch's effect registry
  (ORDERED, as :mod:`benchmarks.common` registers its own op), global to its process.
"""

from __future__ import annotations

from typing import Any

import torch

import effectfx as efx

PROMPT = 8  # prompt length; 8 + 32 tokens stay inside GPT-2's 64 positions
# hf's initialisation (std 0.02, tied embeddings) makes greedy decoding repeat the prompt's last token, so
# "the same tokens as eager" would check little: every weight matrix is scaled by this (std 0.2), and the 32
# tokens vary (8 distinct ones).  Timing is unaffected.
WEIGHT_SCALE = 10.0
# system -> (how it runs, cache, layers logged)
SYSTEMS: dict[str, tuple[str, str, bool]] = {
    "eager_static": ("eager", "static", True),
    "efx_static": ("efx", "static", True),
    "tc_static": ("tc", "static", True),
    "eager_dynamic": ("eager", "dynamic", True),
    "efx_dynamic": ("efx", "dynamic", True),
    "eager_static_pure": ("eager", "static", False),
    "efx_static_pure": ("efx", "static", False),
    "tc_static_pure": ("tc", "static", False),
    "tc_module": ("tc_module", "static", True),  # torch.compile(model).generate: first call only
    "tc_static_ordered": ("tc", "static", True),  # the op in torch's effect registry: first call only
}
# first call only: tc_module runs eager; tc_static_ordered registers the effect op with torch (ORDERED, as
# benchmarks/common.py registers its own op), which is global to its process
FIRST_CALL_ONLY = ("tc_module", "tc_static_ordered")
LABELS = {
    "eager_static": "eager, StaticCache", "efx_static": "effectfx, StaticCache",
    "tc_static": "torch.compile, StaticCache", "eager_dynamic": "eager, DynamicCache",
    "efx_dynamic": "effectfx, DynamicCache", "eager_static_pure": "eager, StaticCache, no effects",
    "efx_static_pure": "effectfx, StaticCache, no effects",
    "tc_static_pure": "torch.compile, StaticCache, no effects",
    "tc_module": "torch.compile(model).generate, StaticCache",
    "tc_static_ordered": "torch.compile, StaticCache, effect op registered with torch (ORDERED)",
}


def build(system: str, seed: int = 0) -> torch.nn.Module:
    """``hf.build("gpt2")`` (layers logged or not, as ``system`` says), matrices scaled by WEIGHT_SCALE."""
    from effectfx.testing import hf

    model = hf.build("gpt2", seed=seed, logged=SYSTEMS[system][2]).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(WEIGHT_SCALE)
    return model


def reference_of(system: str) -> str:
    """The eager system ``system`` is checked and measured against: the same cache, the same model."""
    _, cache, logged = SYSTEMS[system]
    return f"eager_{cache}" + ("" if logged else "_pure")


def tc_of(system: str) -> str | None:
    """The torch.compile system compared with ``system``: static cache, the same model (logged or not)."""
    if SYSTEMS[system][0] in ("tc", "tc_module"):
        return None
    return "tc_static" if SYSTEMS[system][2] else "tc_static_pure"


def prepare(system: str, model: torch.nn.Module) -> Any:
    """What ``generate`` is called on."""
    how = SYSTEMS[system][0]
    if how == "efx":
        return efx.compile(model)
    if how == "tc":
        model.forward = torch.compile(model.forward, mode="default")
        return model
    if how == "tc_module":
        return torch.compile(model, mode="default")
    return model


def prompt() -> torch.Tensor:
    from effectfx.testing import hf

    return torch.randint(0, hf.VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(0))


def generate(f: Any, system: str, tokens: int, ids: torch.Tensor) -> torch.Tensor:
    options: dict[str, Any] = {"max_new_tokens": tokens, "do_sample": False, "pad_token_id": 0,
                               "use_cache": True}
    if SYSTEMS[system][1] == "static":
        options["cache_implementation"] = "static"
    with torch.no_grad():
        return f.generate(ids, **options)


def compiles(system: str, f: Any) -> int:
    """Captures (effectfx) or graphs compiled (torch.compile, since the counters were cleared); eager 0."""
    how = SYSTEMS[system][0]
    if how == "efx":
        return int(f.stats.compiles)
    if how in ("tc", "tc_module"):
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    return 0


def effects_expected(system: str, tokens: int) -> int:
    from effectfx.testing import hf

    return tokens * hf.LAYERS if SYSTEMS[system][2] else 0
