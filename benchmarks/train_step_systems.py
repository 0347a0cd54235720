"""The systems of ``benchmarks/train_step.py`` and the targets it checks (benchmarks/README.md, "Compiled
training step")."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

import effectfx as efx
from benchmarks import common

LR, CLIP = 1e-3, 1.0
# system -> (how it runs, layers logged and effect ops in the step)
SYSTEMS: dict[str, tuple[str, bool]] = {
    "eager": ("eager", True),
    "efx_step": ("efx_step", True),
    "efx_model": ("efx_model", True),
    "efx_step_inductor": ("efx_step_inductor", True),
    "eager_pure": ("eager", False),
    "tc_step": ("tc_step", False),
    "eager_cosine": ("eager", True),
    "efx_step_cosine": ("efx_step", True),
}
# a new Python float lr in param_groups before every step (nanoGPT's loop): Note [Float inputs]
SCHEDULED = ("eager_cosine", "efx_step_cosine")
LABELS = {
    "eager": "eager step",
    "efx_step": "efx.compile(step)",
    "efx_model": "efx.compile(model) in an eager step",
    "efx_step_inductor": 'efx.compile(step, backend="inductor")',
    "eager_pure": "eager step, no effects",
    "tc_step": "torch.compile(step), no effects",
    "eager_cosine": "eager step, cosine lr set every step",
    "efx_step_cosine": "efx.compile(step), cosine lr set every step",
}
INDUCTOR = ("efx_step_inductor", "tc_step")
STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")
TARGETS = {"step_captures": 2, "step_over_efx_model": 1.0, "inductor_over_efx_model": 0.9,
           "cosine_captures": 2, "cosine_over_step": 1.05}
SCHEDULE_STEPS = 100


def lr_at(it: int) -> float:
    """nanoGPT's cosine decay from LR to LR / 10 over SCHEDULE_STEPS steps, then again."""
    return LR * (0.1 + 0.9 * (1 + math.cos(math.pi * (it % SCHEDULE_STEPS) / SCHEDULE_STEPS)) / 2)


def reference_of(system: str) -> str:
    """The eager system ``system`` is checked and measured against: the same model, the same step."""
    if system in SCHEDULED:
        return "eager_cosine"
    return "eager" if SYSTEMS[system][1] else "eager_pure"


def uses_inductor(system: str) -> bool:
    return system in INDUCTOR


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer, forward: Callable[..., Any],
              logged: bool) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """The training step measured: forward, backward, an effect, clipping, AdamW's step and ``zero_grad``,
    a ``log_tensor`` of the loss (without its two effect ops when not ``logged``)."""
    if logged:
        def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = forward(**batch).loss
            loss.backward()
            torch.ops.efxtest.record_memory("after backward")
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            torch.ops.efxtest.log_tensor(loss.detach(), "loss")
            return loss
    else:
        def step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            loss = forward(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            return loss

    return step


class System:
    """One system's model, optimizer, the step it calls and what counts its captures."""

    def __init__(self, system: str, seed: int = 0) -> None:
        from effectfx.testing import hf

        how, logged = SYSTEMS[system]
        self.name = system
        self.it, self.scheduled = 0, system in SCHEDULED
        self.model = hf.build("gpt2", seed=seed, logged=logged)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        forward: Callable[..., Any] = self.model
        if how == "efx_model":
            forward = efx.compile(self.model)
        step = make_step(self.model, self.opt, forward, logged)
        if how == "efx_step":
            self.step = self.counted = efx.compile(step)
        elif how == "efx_step_inductor":
            self.step = self.counted = efx.compile(step, backend="inductor")
        elif how == "tc_step":
            self.step, self.counted = torch.compile(step), None
        else:
            self.step = step
            self.counted = forward if how == "efx_model" else None

    def captures(self) -> int:
        """Captures (effectfx), graphs compiled (torch.compile, since the counters were cleared), eager 0."""
        if self.counted is not None:
            return int(self.counted.stats.compiles)
        if SYSTEMS[self.name][0] == "tc_step":
            return common.dynamo_counts()["unique_graphs"]
        return 0

    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[float, list]:
        from effectfx.testing.effect_ops import recording

        if self.scheduled:
            for group in self.opt.param_groups:
                group["lr"] = lr_at(self.it)
            self.it += 1
        with recording() as log:
            loss = self.step(batch)
        return float(loss.detach()), list(log)


def batches(n: int, size: int) -> list[dict[str, torch.Tensor]]:
    """``n`` training batches (``hf.batch("gpt2")``: ``size`` sequences of 8 tokens), seeded 0."""
    from effectfx.testing import hf

    g = torch.Generator().manual_seed(0)
    return [hf.batch("gpt2", g, size=size) for _ in range(n)]


def state_of(s: System) -> dict[str, Any]:
    """What the steps left behind: parameters, AdamW state, ``.grad``s (copies)."""
    names = [n for n, _ in s.model.named_parameters()]
    params = [p.detach().clone() for p in s.model.parameters()]
    state = [{k: s.opt.state[p][k].detach().clone() for k in STATE_KEYS if k in s.opt.state[p]}
             if p in s.opt.state else {} for p in s.model.parameters()]
    grads_none = all(p.grad is None for p in s.model.parameters())
    return {"names": names, "params": params, "state": state, "grads_none": grads_none}


def compare(got: dict[str, Any], want: dict[str, Any], logs: list[list], want_logs: list[list],
            losses: list[float], want_losses: list[float]) -> dict[str, Any]:
    """Effects, losses, parameters and AdamW state of a system against its reference after the same steps."""
    diffs = [float((a - b).abs().max()) for a, b in zip(got["params"], want["params"])]
    worst = max(range(len(diffs)), key=diffs.__getitem__) if diffs else None
    rel = [float(((a - b).abs() / b.abs().clamp_min(1e-3)).max())
           for a, b in zip(got["params"], want["params"])]
    state: dict[str, float | None] = {}
    for k in STATE_KEYS:
        pairs = [(a[k], b[k]) for a, b in zip(got["state"], want["state"]) if k in a and k in b]
        state[k] = max((float((x.float() - y.float()).abs().max()) for x, y in pairs), default=None)
    state_complete = all(set(a) == set(b) for a, b in zip(got["state"], want["state"]))
    return {
        "steps": len(logs), "effects_equal_eager": logs == want_logs,
        "effects_per_step": sorted({len(x) for x in logs}), "eager_effects_per_step": sorted(
            {len(x) for x in want_logs}),
        "losses": losses,
        "max_loss_diff": max((abs(a - b) for a, b in zip(losses, want_losses)), default=None),
        "max_param_diff": max(diffs, default=None),
        "max_param_diff_at": got["names"][worst] if worst is not None else None,
        "max_param_rel_diff": max(rel, default=None),
        "max_state_diff": state, "state_keys_equal": state_complete,
        "params": len(diffs), "grads_none": got["grads_none"], "eager_grads_none": want["grads_none"]}
