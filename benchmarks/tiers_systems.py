"""The model and systems of ``benchmarks/tiers.py`` (benchmarks/README.md, "Tiered compilation").

Model: ``transformers``' GPT2LMHeadModel (``effectfx.testing.hf``: hidden 64, 4 heads, vocab 100, random
weights) with ``layers`` layers (12; ``--quick`` 2), every layer a ``LoggedLayer`` region recording its name
with ``efxtest::record_memory``; input ids (4, 32).  The step is that of
``benchmarks/train_step_systems.make_step``: forward, backward, an effect, ``clip_grad_norm_``, AdamW's
step, ``zero_grad``, a ``log_tensor`` of the loss.

Systems (each builds its own model and AdamW from the same seed):

* ``eager``: the step, eagerly (the reference);
* ``efx_tier1``: ``efx.compile(step, backend="inductor", tiers="tier1")``: each region body compiled once;
* ``efx_tiered``: the same with the default tiers ("background": tier 2 built in a thread once a program
  served 10 calls and its calls since then took twice as long as tier 1's compiles of it, Note [When tier 2
  pays]; switched at a call boundary);
* ``efx_at_once``: ``tiers="at-once"``: tier 2 compiled in the calling thread at each program's first call;
* ``efx_tiered_warm``: ``efx_tiered`` again in a new process on the Inductor cache ``efx_tiered``'s run
  filled: its first step loads tier 1's artifacts, its second program starts in tier 2;
* ``tc``: ``torch.compile(step)`` (Inductor) of the effectful step; ``tc_pure``: the same of the model built
  with ``logged=False`` and the step without effect ops, run instead when ``tc`` fails (torch.compile of the
  effectful model fails in this torch: ``effectfx.backends.tiers``).  Of the whole step (2 layers) ``tc`` ran
  and dropped every effect: the ``efxtest`` ops are not in torch's effect registry (the effects column).
"""

from __future__ import annotations

import math
from typing import Any

import torch

import effectfx as efx
from benchmarks.train_step_systems import LR, make_step

BATCH, SEQ = 4, 32
# system -> (how it is compiled, efx tiers (None: not effectfx), whether the model and step log effects)
SYSTEMS: dict[str, tuple[str, str | None, bool]] = {
    "eager": ("eager", None, True),
    "efx_tier1": ("efx", "tier1", True),
    "efx_tiered": ("efx", "background", True),
    "efx_at_once": ("efx", "at-once", True),
    "efx_tiered_warm": ("efx", "background", True),
    "tc": ("tc", None, True),
    "tc_pure": ("tc", None, False),
}
LABELS = {
    "eager": "eager",
    "efx_tier1": 'efx tier 1 (tiers="tier1")',
    "efx_tiered": "efx tiered (background, default)",
    "efx_at_once": 'efx tier 2 at once (tiers="at-once")',
    "efx_tiered_warm": "efx tiered, a second process (warm cache)",
    "tc": "torch.compile (inductor)",
    "tc_pure": "torch.compile (inductor), no effects",
}
FALLBACK = {"tc": "tc_pure"}  # run instead when the system fails
WARM = {"efx_tiered_warm": "efx_tiered"}  # runs in a new process on the cache that system's run filled
LOSS_RTOL = 1e-3  # a loss (and a log_tensor fingerprint) against eager's same step


def build_model(layers: int, logged: bool, seed: int = 0) -> torch.nn.Module:
    """GPT-2 of ``effectfx.testing.hf`` with ``layers`` layers, seeded, its layers logged regions."""
    import transformers

    from effectfx.testing import hf

    config = hf.gpt2_config()
    config.n_layer = layers
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return hf.log_layers(model, "gpt2") if logged else model


class System:
    """One system's model, AdamW and compiled step."""

    def __init__(self, system: str, layers: int) -> None:
        how, tiers, logged = SYSTEMS[system]
        self.name = system
        self.model = build_model(layers, logged)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        step = make_step(self.model, self.opt, self.model, logged)
        self.compiled: Any = None
        if how == "efx":
            self.step = self.compiled = efx.compile(step, backend="inductor", tiers=tiers)
        elif how == "tc":
            self.step = torch.compile(step, backend="inductor")
        else:
            self.step = step

    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[float, list]:
        from effectfx.testing.effect_ops import recording

        with recording() as log:
            loss = self.step(batch)
        return float(loss.detach()), list(log)

    def tier_states(self) -> list[Any]:
        """The TierState of every program (creation order); none for a system without tiers."""
        if self.compiled is None:
            return []
        return [e.tiers for es in self.compiled.cache.values() for e in es if e.tiers is not None]

    def tiers(self) -> list[int]:
        """The tier each program runs now."""
        return [s.tier for s in self.tier_states()]

    def wait(self, timeout: float | None = None) -> float:
        """Wait for every background build of tier 2; the seconds waited."""
        import time

        start = time.perf_counter()
        for s in self.tier_states():
            s.wait(timeout)
        return time.perf_counter() - start


def tier_report(state: Any) -> dict[str, Any]:
    """What a program's TierState says (``effectfx.backends.tiers``), as JSON."""
    return {"tier": state.tier, "mode": state.spec.mode, "after": state.spec.threshold,
            "cpp_wrapper": state.spec.cpp_wrapper, "calls_in_tier1": state.calls,
            "started_call": state.started_call, "switched_call": state.switched_call,
            "compile_wall_s": state.wall_seconds if state.started_call is not None else None,
            "compile_thread_cpu_s": state.cpu_seconds if state.started_call is not None else None,
            "outcomes": dict(state.outcomes), "error": state.error, "describe": state.describe()}


def batches(n: int) -> list[dict[str, torch.Tensor]]:
    """``n`` training batches of ids (BATCH, SEQ), seeded 0."""
    from effectfx.testing import hf

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, hf.VOCAB, (BATCH, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def jsonable(log: list[tuple]) -> list[list[Any]]:
    """An effect log as JSON: each entry a list (shapes as lists)."""
    return [[list(x) if isinstance(x, tuple) else x for x in entry] for entry in log]


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=LOSS_RTOL, abs_tol=1e-4)
    return a == b


def entries_equal(got: list[list[Any]], want: list[list[Any]]) -> bool:
    """Two steps' effect logs: the same effects in the same order with the same labels and shapes;
    the values they log (``log_tensor``'s fingerprint) within :data:`LOSS_RTOL` (Inductor's rounding)."""
    return len(got) == len(want) and all(
        len(g) == len(w) and all(_close(x, y) for x, y in zip(g, w)) for g, w in zip(got, want))


def compare_logs(logs: list[list[list[Any]]], want: list[list[list[Any]]]) -> dict[str, Any]:
    """Every step's effect log against eager's same step: how many equal, the first that is not."""
    equal = [entries_equal(g, w) for g, w in zip(logs, want)]
    return {"steps": len(equal), "steps_equal": sum(equal), "all_equal": bool(equal) and all(equal)
            and len(logs) == len(want), "first_unequal_step": next(
                (i + 1 for i, e in enumerate(equal) if not e), None), "equal": equal}


def max_rel_diff(got: list[float], want: list[float]) -> float | None:
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want)), default=None)

