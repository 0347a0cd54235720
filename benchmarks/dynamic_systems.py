"""The systems, the model and the batches of ``benchmarks/dynamic.py``, its training call, its checks against
eager and its counts of captures and compiles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._library.effects import EffectType

import effectfx as efx
from benchmarks import common
from effectfx.testing import effect_ops, hf

NAME = "dynamic"
BATCH = 4
TOLERANCE = 1e-3  # max relative difference from eager (loss, every gradient), as inductor_systems.check

# torch.compile would treat the layers' effect op as pure (and drop it) without this
torch.library._register_effectful_op("efxtest::record_memory", EffectType.ORDERED)

# system -> (compiler, backend, dynamic, label)
SYSTEMS: dict[str, tuple[str, str, bool | None, str]] = {
    "eager": ("eager", "", None, "eager"),
    "efx": ("efx", "eager", None, "effectfx"),
    "efx_static": ("efx", "eager", False, "effectfx, dynamic=False"),
    "efx_ind": ("efx", "inductor", None, "effectfx, inductor"),
    "efx_ind_static": ("efx", "inductor", False, "effectfx, inductor, dynamic=False"),
    "tc_aot": ("tc", "aot_eager", None, "torch.compile(aot_eager)"),
    "tc_aot_dyn": ("tc", "aot_eager", True, "torch.compile(aot_eager, dynamic=True)"),
    "tc_ind": ("tc", "inductor", None, "torch.compile(inductor)"),
    "tc_ind_dyn": ("tc", "inductor", True, "torch.compile(inductor, dynamic=True)"),
    # without the effect op (``hf.build("gpt2", logged=False)``): torch.compile(inductor) fails with it
    # (Inductor's generated code raises UnboundLocalError, as in inductor.py); these stand in for it
    "tc_ind_pure": ("tc", "inductor", None, "torch.compile(inductor), no effects"),
    "tc_ind_dyn_pure": ("tc", "inductor", True, "torch.compile(inductor, dynamic=True), no effects"),
}
# each symbolic system's static program (the same compiler with dynamic=False), and its torch.compile
STATIC_OF = {"efx": "efx_static", "efx_ind": "efx_ind_static"}
TC_OF = {"eager": "tc_aot", "efx": "tc_aot", "efx_static": "tc_aot", "tc_aot": "tc_aot",
         "tc_aot_dyn": "tc_aot", "efx_ind": "tc_ind", "efx_ind_static": "tc_ind", "tc_ind": "tc_ind",
         "tc_ind_dyn": "tc_ind", "tc_ind_pure": "tc_ind_pure", "tc_ind_dyn_pure": "tc_ind_pure"}
FIRST_CALL = ("eager", "efx", "efx_static", "efx_ind", "tc_aot", "tc_aot_dyn", "tc_ind", "tc_ind_dyn",
              "tc_ind_pure", "tc_ind_dyn_pure")
STEADY = ("eager", "efx", "efx_static", "efx_ind", "efx_ind_static", "tc_aot", "tc_aot_dyn", "tc_ind",
          "tc_ind_dyn", "tc_ind_pure", "tc_ind_dyn_pure")
FULL = {"lengths": list(range(16, 32)), "steady_length": 24, "reps": 3, "inductor_reps": 1, "budget_s": 30.0,
        "first_call": FIRST_CALL, "steady": STEADY}
# quick: a smoke run (eager's first calls, efx_static's and torch.compile's steady step left out)
QUICK = {"lengths": [16, 17, 18], "steady_length": 18, "reps": 1, "inductor_reps": 1, "budget_s": 1.0,
         "first_call": ("efx", "tc_aot"), "steady": ("eager", "efx", "efx_static")}


def uses_inductor(system: str) -> bool:
    return SYSTEMS[system][1] == "inductor"


def has_effects(system: str) -> bool:
    """Whether the system's model calls the effect op (its layers logged)."""
    return not system.endswith("_pure")


# -- the model, the batches, one training call --------------------------------------------------------------
def batches(lengths: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, hf.VOCAB, (BATCH, n), generator=generator) for n in lengths]


def build(system: str) -> tuple[torch.nn.Module, Callable[..., Any]]:
    """(the model, the callable that runs it): the same weights for every system."""
    compiler, backend, dynamic, _ = SYSTEMS[system]
    model = hf.build("gpt2", seed=0, logged=has_effects(system))
    if compiler == "eager":
        return model, model
    if compiler == "efx":  # a compiled module: the model's own parameters, ``.stats`` forwarded
        return model, efx.compile(model, backend=backend, dynamic=dynamic)
    return model, torch.compile(model, backend=backend, dynamic=dynamic)


def train_call(f: Callable[..., Any], ids: torch.Tensor) -> tuple[str, torch.Tensor | None, list[tuple]]:
    """One forward with labels and ``loss.backward()``: (status, loss, effects performed)."""
    with effect_ops.recording() as log:
        loss = f(ids, labels=ids).loss
        if loss.grad_fn is None:
            return "loss has no grad_fn: no backward (forward only)", loss, log
        loss.backward()
    return "ok", loss, log


def snapshot(model: torch.nn.Module, loss: torch.Tensor | None) -> dict[str, Any]:
    """The loss and gradients of a call, copied; the gradients are cleared for the next."""
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = None if p.grad is None else p.grad.detach().clone()
        p.grad = None
    return {"loss": None if loss is None else loss.detach().clone(), "grads": grads}


def compare(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """Max relative difference of loss and every gradient from eager's (a missing gradient: inf)."""
    if got["loss"] is None:
        return {"max_rel_diff": float("inf"), "ok": False}
    diffs = [float((got["loss"] - want["loss"]).abs() / (want["loss"].abs() + 1e-12))]
    for name, ref in want["grads"].items():
        if ref is None:
            continue
        g = got["grads"].get(name)
        diffs.append(float("inf") if g is None else float((g - ref).abs().max() / (ref.abs().max() + 1e-12)))
    return {"max_rel_diff": max(diffs), "ok": max(diffs) < TOLERANCE}


def references(lengths: list[int], logged: bool = True) -> list[tuple[dict[str, Any], list[tuple]]]:
    """Eager's (loss and gradients, effects) on each batch, of the model with or without the effect op."""
    model = hf.build("gpt2", seed=0, logged=logged)
    out = []
    for ids in batches(lengths):
        status, loss, log = train_call(model, ids)
        assert status == "ok", status
        out.append((snapshot(model, loss), list(log)))
    return out


# -- counts -------------------------------------------------------------------------------------------------
def inductor_stats() -> dict[str, int]:
    from effectfx.backends import inductor_cache

    s = inductor_cache.STATS
    return {"compiles": s.compiles, "loads": s.loads, "hits": s.hits, "fallbacks": s.fallbacks}


def minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a[k] - b.get(k, 0) for k in a}


def captures(system: str, f: Any, dyn0: dict[str, int]) -> int:
    """Captures so far: effectfx's ``stats.compiles``; torch.compile's graphs installed since ``dyn0``."""
    compiler = SYSTEMS[system][0]
    if compiler == "efx":
        return int(f.stats.compiles)
    if compiler == "tc":
        return common.dynamo_counts()["unique_graphs"] - dyn0["unique_graphs"]
    return 0


def segments_report() -> list[dict[str, Any]]:
    """Every Inductor segment key of this process: its variants, whether its sizes are symbolic."""
    from effectfx.backends import inductor_cache

    out = []
    for key, variants in inductor_cache.SEGMENTS.items():
        metas = key[2]
        symbolic = any(not isinstance(d, int) for m in metas for d in m[0])
        out.append({"symbolic": symbolic, "variants": len(variants),
                    "compiled": sum(v.artifact is not None for v in variants),
                    "guards": [[str(g) for g in v.guards] for v in variants],
                    "fallback": [v.why for v in variants if v.why]})
    return out
