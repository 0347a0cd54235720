"""The systems of ``benchmarks/dynamo_backend.py`` (benchmarks/README.md, "Behind torch.compile"): one GPT-2
training step (forward, ``loss.backward()``, AdamW's step and ``zero_grad``, the optimizer eager in every
system) with its model run eagerly, behind ``torch.compile`` with several backends, or by ``efx.compile``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import effectfx as efx
from effectfx.drivers import dynamo_backend

LR = 1e-3
# system -> how its model is compiled: (torch.compile backend, its options) or "eager" / "efx_compile"
SYSTEMS: dict[str, Any] = {
    "eager": "eager",
    "efx_backend": ("effectfx", {"backend": "eager"}),
    "efx_backend_inductor": ("effectfx", {"backend": "inductor"}),
    "tc_inductor": ("inductor", None),
    "tc_aot_eager": ("aot_eager", None),
    "efx_compile": "efx_compile",
}
LABELS = {
    "eager": "eager",
    "efx_backend": 'torch.compile(backend="effectfx")',
    "efx_backend_inductor": 'torch.compile(backend="effectfx", options={"backend": "inductor"})',
    "tc_inductor": "torch.compile (inductor)",
    "tc_aot_eager": 'torch.compile(backend="aot_eager")',
    "efx_compile": "efx.compile(model)",
}
INDUCTOR = ("efx_backend_inductor", "tc_inductor")
BACKEND = ("efx_backend", "efx_backend_inductor")
STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")
# the backend's first call against the systems it replaces (lower is better), and the effects it keeps
TARGETS = {"backend_first_over_aot_eager": 1.0, "backend_step_over_eager": 1.1, "backend_keeps_effects": True}


def uses_inductor(system: str) -> bool:
    return system in INDUCTOR


def build_model(layers: int, seed: int = 0) -> torch.nn.Module:
    """GPT-2 from ``effectfx.testing.hf``'s config with ``layers`` layers, each recording its name (key
    "memory") as it runs (``hf.LoggedLayer``: under Dynamo its ``@efx.region`` is a plain call)."""
    import transformers

    from effectfx.testing import hf

    torch.manual_seed(seed)
    config = hf.gpt2_config()
    config.n_layer = layers
    model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return hf.log_layers(model, "gpt2")


class System:
    """One system's model, optimizer and compiled forward, and what counts its captures."""

    def __init__(self, system: str, layers: int, seed: int = 0) -> None:
        self.name = system
        self.model = build_model(layers, seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.made: list[Any] = []  # the backend's compiled callables, one per Dynamo graph
        how = SYSTEMS[system]
        self.forward: Callable[..., Any] = self.model
        if how == "efx_compile":
            self.forward = efx.compile(self.model)
        elif how != "eager":
            backend, options = how
            if backend == "effectfx":
                backend = self._counting
            self.forward = torch.compile(self.model, backend=backend, options=options)

    def _counting(self, gm: torch.fx.GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
        """effectfx's backend, keeping what it returns to count its captures."""
        compiled = dynamo_backend.effectfx_backend(gm, example_inputs, **kwargs)
        self.made.append(getattr(compiled, "compiled", compiled))
        return compiled

    def captures(self) -> int:
        """effectfx's captures (of every Dynamo graph, for the backend), torch.compile's graphs (dynamo's
        ``unique_graphs`` since the counters were cleared), eager 0."""
        if self.name in BACKEND:
            return sum(int(c.stats.compiles) for c in self.made)
        if self.name == "efx_compile":
            return int(self.forward.stats.compiles)
        if self.name == "eager":
            return 0
        from benchmarks import common

        return common.dynamo_counts()["unique_graphs"]

    def graphs(self) -> int | None:
        """Dynamo graphs handed to effectfx's backend."""
        return len(self.made) if self.name in BACKEND else None

    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[float, list]:
        from effectfx.testing.effect_ops import recording

        with recording() as log:
            loss = self.forward(**batch).loss
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
        return float(loss.detach()), list(log)


def batches(n: int, size: int) -> list[dict[str, torch.Tensor]]:
    from effectfx.testing import hf

    g = torch.Generator().manual_seed(0)
    return [hf.batch("gpt2", g, size=size) for _ in range(n)]


def state_of(s: System) -> dict[str, Any]:
    params = [p.detach().clone() for p in s.model.parameters()]
    state = [{k: s.opt.state[p][k].detach().clone() for k in STATE_KEYS if k in s.opt.state[p]}
             if p in s.opt.state else {} for p in s.model.parameters()]
    return {"params": params, "state": state}


def compare(got: dict[str, Any], want: dict[str, Any], logs: list[list], want_logs: list[list],
            losses: list[float], want_losses: list[float]) -> dict[str, Any]:
    """Effects kept, losses, parameters and AdamW state of a system against eager's after the same steps."""
    diffs = [float((a - b).abs().max()) for a, b in zip(got["params"], want["params"])]
    pairs = list(zip(got["state"], want["state"]))
    state = {k: max((float((a[k].float() - b[k].float()).abs().max()) for a, b in pairs if k in a and k in b),
                    default=None) for k in STATE_KEYS}
    return {"steps": len(logs), "effects_equal_eager": logs == want_logs,
            "effects_per_step": sorted({len(x) for x in logs}),
            "eager_effects_per_step": sorted({len(x) for x in want_logs}),
            "effects_kept": sum(map(len, logs)), "eager_effects": sum(map(len, want_logs)),
            "losses": losses,
            "max_loss_diff": max((abs(a - b) for a, b in zip(losses, want_losses)), default=None),
            "max_param_diff": max(diffs, default=None), "max_state_diff": state}
