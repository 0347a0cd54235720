"""A ResNet's first call and training step: eager vs efx.compile vs torch.compile(aot_eager), in one run.

The model is ``transformers``' ``ResNetForImageClassification`` built from a small config with random
weights (nothing is downloaded), in training mode, so every BatchNorm updates its running statistics.
Every residual block (``model.resnet.encoder.stages[i].layers[j]``) is wrapped the way a user would wrap
it (like ``effectfx.testing.hf.LoggedLayer``): a module whose ``forward`` first calls the effect op
``efxbench::record(name)`` with the block's name, then the block.  That ``forward`` is marked
``@efx.region`` for effectfx, ``@torch.compiler.nested_compile_region`` for torch.compile's region
variant, and left unmarked for eager and for plain torch.compile.

Measured, with systems interleaved and their order rotated on each repetition:

1. **first call**: a fresh model (same seed) -> compile -> one training step (forward with labels,
   ``loss.backward()``); wall and CPU time; then the **second call** (transformers sets
   ``config.problem_type`` during the first call, so both compilers compile again once);
2. **steady-state training step** (forward + backward + SGD step) after warm-up, median over rounds;
3. correctness: loss, every parameter's gradient and every buffer (running mean/var,
   ``num_batches_tracked``) after the first step, and every parameter and buffer after the warm-up steps,
   compared with eager's; effects counted per step (expected: one per block).

Run: ``python benchmarks/resnet.py [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import effectfx as efx  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import LOG, median  # noqa: E402

NAME = "resnet"
RTOL, ATOL = 1e-4, 1e-5
BATCH, CHANNELS, SIZE, LABELS_N = 8, 3, 32, 10
CONFIG: dict[str, Any] = {"num_channels": CHANNELS, "embedding_size": 16, "hidden_sizes": [16, 32, 64, 128],
                          "depths": [2, 2, 2, 2], "layer_type": "basic", "num_labels": LABELS_N}
LR = 0.01
WARMUP_STEPS = 3  # >= 2: the second call compiles again (config.problem_type), see the module docstring

# system -> (block marker, compiler)
SYSTEMS: dict[str, tuple[str, str]] = {
    "eager": ("eager", "eager"),
    "efx": ("efx", "efx"),
    "tc": ("eager", "tc"),
    "tc_region": ("tc", "tc"),
    "efx_noregion": ("eager", "efx"),
    "tc_region_shared": ("tc", "tc"),
}
# blocks that all record the same label instead of their own name: the only form in which
# nested_compile_region reuses a body here (a per-block name is a constant its reuse check compares)
SHARED_LABEL = {"tc_region_shared": "block"}
LABELS = {
    "eager": "eager",
    "efx": "effectfx (blocks as regions)",
    "tc": "torch.compile (no regions)",
    "tc_region": "torch.compile (nested_compile_region)",
    "efx_noregion": "effectfx (no regions)",
    "tc_region_shared": "torch.compile (nested_compile_region, one label for all blocks)",
}
SHORT = {"eager": "eager", "efx": "effectfx", "tc": "tc", "tc_region": "tc+regions",
         "efx_noregion": "efx no-reg", "tc_region_shared": "tc+regions 1 label"}
# torch.compile takes seconds per first call, the others milliseconds to a second: they get more repetitions
FULL = {"reps": 5, "tc_reps": 3, "rounds": 60, "min_seconds": 45.0,
        "systems": ["eager", "efx", "tc", "tc_region", "efx_noregion", "tc_region_shared"]}
QUICK = {"reps": 1, "tc_reps": 1, "rounds": 3, "min_seconds": 0.0, "systems": ["eager", "efx", "tc_region"]}


# -- the model -------------------------------------------------------------------------------------
def _block_forward() -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    # a new function object per marker: ``nested_compile_region`` marks the function it is given (sets
    # attributes on it), so sharing one would make the unmarked blocks regions for torch.compile too
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxbench.record(self.name)
        return self.layer(x)

    forward.__qualname__ = "Block.forward"
    return forward


class Block(nn.Module):
    """One residual block that first records its name (``efxbench::record``), then runs the block."""

    def __init__(self, layer: nn.Module, name: str) -> None:
        super().__init__()
        self.layer = layer
        self.name = name

    forward = _block_forward()


class EfxBlock(Block):
    forward = efx.region(_block_forward())


class TcBlock(Block):
    forward = torch.compiler.nested_compile_region(_block_forward())


BLOCKS: dict[str, type[Block]] = {"eager": Block, "efx": EfxBlock, "tc": TcBlock}


def make_model(marker: str, seed: int = 0, config: dict[str, Any] | None = None,
               label: str | None = None) -> nn.Module:
    """A fresh ``ResNetForImageClassification`` (same ``seed``, same weights), its blocks wrapped (each
    recording its name, or ``label``), in training mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.ResNetForImageClassification(transformers.ResNetConfig(**(config or CONFIG)))
    for i, stage in enumerate(model.resnet.encoder.stages):
        for j, layer in enumerate(stage.layers):
            stage.layers[j] = BLOCKS[marker](layer, label or f"stages.{i}.layers.{j}")
    return model.train()


def build(system: str, config: dict[str, Any] | None = None) -> nn.Module:
    """A fresh model with the blocks ``system`` needs."""
    return make_model(SYSTEMS[system][0], config=config, label=SHARED_LABEL.get(system))


def n_blocks(config: dict[str, Any] | None = None) -> int:
    return sum((config or CONFIG)["depths"])


def compile_for(compiler: str, model: nn.Module) -> Callable[..., Any]:
    if compiler == "efx":
        return efx.compile(model)
    if compiler == "tc":
        return torch.compile(model, backend="aot_eager")
    return model


def batch(seed: int = 1, size: int = SIZE, batch_size: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, CHANNELS, size, size, generator=g),
            torch.randint(0, LABELS_N, (batch_size,), generator=g))


# -- comparing with eager --------------------------------------------------------------------------
def _snapshot(model: nn.Module, loss: torch.Tensor | None, grads: bool) -> dict[str, Any]:
    return {
        "loss": None if loss is None else loss.detach().clone(),
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()} if grads
        else {},
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in model.named_buffers()},
    }


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    return bool(torch.allclose(a, b, rtol=RTOL, atol=ATOL))


def compare(got: dict[str, Any], want: dict[str, Any], parts: tuple[str, ...]) -> dict[str, Any]:
    """Per part (loss, grads, params, buffers): does it match eager's, and which names do not."""
    out: dict[str, Any] = {}
    for part in parts:
        if part == "loss":
            out["loss_matches"] = _close(got["loss"], want["loss"])
            out["loss"] = None if got["loss"] is None else float(got["loss"])
            out["eager_loss"] = float(want["loss"])
            continue
        bad = sorted(n for n in want[part] if n not in got[part] or not _close(got[part][n], want[part][n]))
        out[f"{part}_matches"] = not bad
        out[f"{part}_compared"] = len(want[part])
        out[f"{part}_mismatched"] = bad[:10] + ([f"... {len(bad) - 10} more"] if len(bad) > 10 else [])
    out["matches_eager"] = all(out[f"{p}_matches"] for p in parts)
    return out


def references(steps: int) -> dict[str, Any]:
    """Eager's loss, gradients and buffers after the first step, and its parameters and buffers after
    ``steps`` SGD steps (the steady-state warm-up)."""
    pixels, labels = batch()
    model = make_model("eager")
    loss = model(pixel_values=pixels, labels=labels).loss
    loss.backward()
    first = _snapshot(model, loss, grads=True)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.step()
    opt.zero_grad()
    for _ in range(steps - 1):
        model(pixel_values=pixels, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"first": first, "warm": _snapshot(model, None, grads=False)}


def _error(exc: BaseException) -> str:
    """``error: Type: first line`` (and the next when the first only introduces it, as dynamo's
    ``BackendCompilerFailed: backend='aot_eager' raised:`` does)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text += " " + lines[1]
    return f"error: {type(exc).__name__}: {text[:300]}"


def _dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def _step(f: Callable[..., Any], pixels: torch.Tensor,
          labels: torch.Tensor) -> tuple[str, torch.Tensor | None, float]:
    """One forward (with labels) and ``loss.backward()``; returns status, loss and the forward's seconds."""
    start = time.perf_counter()
    loss = f(pixel_values=pixels, labels=labels).loss
    forward_s = time.perf_counter() - start
    if loss.grad_fn is None:
        return "loss has no grad_fn: backward impossible (forward time only)", loss, forward_s
    loss.backward()
    return "ok", loss, forward_s


# -- 1. first call ---------------------------------------------------------------------------------
def measure_first_call(system: str, reference: dict[str, Any]) -> dict[str, Any]:
    """Compile a fresh model and run one training step (then a second): times, effects, agreement."""
    marker, compiler = SYSTEMS[system]
    if compiler == "tc":
        torch._dynamo.reset()
    model = build(system)
    pixels, labels = batch()
    dyn0 = _dynamo_counts()
    common.quiet_gc()
    LOG.clear()
    status, loss, forward_s, f = "ok", None, float("nan"), None
    cpu_start = time.process_time()
    start = time.perf_counter()
    try:
        f = compile_for(compiler, model)
        status, loss, forward_s = _step(f, pixels, labels)
    except Exception as exc:  # a comparator failing is a result, not a crash of the benchmark
        status = _error(exc)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    effects = len(LOG)
    row: dict[str, Any] = {"seconds": seconds, "cpu_seconds": cpu_seconds, "forward_seconds": forward_s,
                           "status": status, "effects": effects}
    if not status.startswith("error"):
        got = _snapshot(model, loss, grads=status == "ok")
        parts = ("loss", "grads", "buffers") if status == "ok" else ("loss", "buffers")
        row.update(compare(got, reference, parts))
    else:
        row["matches_eager"] = None
    dyn1 = _dynamo_counts()
    # the second call: transformers set config.problem_type during the first, so a compiler guarding on
    # it compiles again
    second: dict[str, Any] = {"status": "skipped", "seconds": float("nan"), "cpu_seconds": float("nan"),
                              "effects": 0}
    if f is not None and not status.startswith("error"):
        model.zero_grad()
        common.quiet_gc()
        LOG.clear()
        cpu_start = time.process_time()
        start = time.perf_counter()
        try:
            second["status"] = _step(f, pixels, labels)[0]
        except Exception as exc:
            second["status"] = _error(exc)
        second["seconds"] = time.perf_counter() - start
        second["cpu_seconds"] = time.process_time() - cpu_start
        second["effects"] = len(LOG)
    LOG.clear()
    row["second_call"] = second
    if compiler == "efx" and isinstance(f, efx.CompiledCallable):
        row["efx_compiles"] = f.stats.compiles
    if compiler == "tc":
        dyn2 = _dynamo_counts()
        row["dynamo"] = {"first_call": {k: dyn1[k] - dyn0[k] for k in dyn0},
                         "second_call": {k: dyn2[k] - dyn1[k] for k in dyn0}}
        torch._dynamo.reset()
    return row


def plan(cfg: dict[str, Any]) -> list[tuple[int, str]]:
    steps = []
    systems = cfg["systems"]
    for rep in range(cfg["reps"]):
        k = rep % len(systems)  # rotate the order so no system always goes first
        for system in systems[k:] + systems[:k]:
            if rep < cfg["tc_reps"] or SYSTEMS[system][1] != "tc":
                steps.append((rep, system))
    return steps


# -- 2. steady state -------------------------------------------------------------------------------
class Trainer:
    """One system's compiled model and optimizer, warmed up; ``step()`` is one timed training step."""

    def __init__(self, system: str, reference: dict[str, Any]) -> None:
        self.system = system
        marker, compiler = SYSTEMS[system]
        self.model = build(system)
        self.pixels, self.labels = batch()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.status = "ok"
        self.warmup_effects: list[int] = []
        self.info: dict[str, Any] = {}
        try:
            self.f = compile_for(compiler, self.model)
            for _ in range(WARMUP_STEPS):
                LOG.clear()
                self._step()
                self.warmup_effects.append(len(LOG))
                if self.status != "ok":
                    break
        except Exception as exc:
            self.status = _error(exc)
        LOG.clear()
        self.warm = (compare(_snapshot(self.model, None, grads=False), reference, ("params", "buffers"))
                     if self.status == "ok" else {"matches_eager": None})
        if isinstance(getattr(self, "f", None), efx.CompiledCallable):
            self.info["efx_compiles"] = self.f.stats.compiles
            try:
                programs = efx.explain(self.f).programs
                self.info["efx_region_bodies"] = sum(len(r.bodies) for r in programs[-1].regions)
            except Exception as exc:  # explain is a report only
                self.info["efx_region_bodies"] = _error(exc)

    def _step(self) -> None:
        loss = self.f(pixel_values=self.pixels, labels=self.labels).loss
        if loss.grad_fn is None:
            self.status = "loss has no grad_fn: backward impossible"
            return
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def step(self) -> tuple[float, float, int]:
        LOG.clear()
        cpu_start = time.process_time()
        start = time.perf_counter()
        self._step()
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        n = len(LOG)
        LOG.clear()
        return wall, cpu, n


def steady_state(cfg: dict[str, Any], reference: dict[str, Any],
                 progress: common.Progress | None = None) -> dict[str, Any]:
    torch._dynamo.reset()
    trainers = {}
    for system in cfg["systems"]:
        trainers[system] = Trainer(system, reference)
        if progress is not None:
            progress.step(f"warm-up {LABELS[system]}")
    running = [s for s, t in trainers.items() if t.status == "ok"]
    samples: dict[str, dict[str, list[float]]] = {s: {"wall": [], "cpu": []} for s in running}
    effects: dict[str, list[int]] = {s: [] for s in running}
    rng = random.Random(0)
    common.quiet_gc()
    start = time.perf_counter()
    rounds = 0
    while rounds < cfg["rounds"] or time.perf_counter() - start < cfg["min_seconds"]:
        order = running[:]
        rng.shuffle(order)
        for system in order:
            wall, cpu, n = trainers[system].step()
            samples[system]["wall"].append(wall)
            samples[system]["cpu"].append(cpu)
            effects[system].append(n)
        rounds += 1
    if progress is not None:
        progress.step(f"steady state: {rounds} rounds")
    out = {}
    for system, t in trainers.items():
        s = samples.get(system, {"wall": [], "cpu": []})
        out[system] = {
            "status": t.status,
            "warmup_effects": t.warmup_effects,
            "state_after_warmup": t.warm,
            "median_s": median(s["wall"]),
            "cpu_median_s": median(s["cpu"]),
            "min_s": min(s["wall"], default=float("nan")),
            "runs_s": s["wall"],
            "cpu_runs_s": s["cpu"],
            "effects_per_step": sorted(set(effects.get(system, []))),
            **t.info,
        }
    out["rounds"] = rounds
    out["seconds"] = time.perf_counter() - start
    return out


# -- what torch.compile made of the regions (not timed) ---------------------------------------------
def tc_structure(system: str) -> dict[str, Any]:
    """Compile ``system``'s model once more with a backend that looks at dynamo's graphs before handing them
    to aot_eager: how many region calls (``invoke_subgraph``) and bodies it made, how many effect calls
    were left at the top level, and whether a training step ran."""
    from torch._dynamo.backends.debugging import aot_eager

    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    pixels, labels = batch()
    try:
        status = _step(torch.compile(build(system), backend=backend), pixels, labels)[0]
    except Exception as exc:
        status = _error(exc)
    torch._dynamo.reset()
    LOG.clear()
    calls = [n for gm in graphs for n in gm.graph.nodes
             if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]
    records = [n for gm in graphs for n in gm.graph.nodes
               if n.op == "call_function" and "efxbench.record" in str(n.target)]
    return {"status": status, "dynamo_graphs": len(graphs), "invoke_subgraph_calls": len(calls),
            "distinct_subgraphs": len({str(n.args[1]) for n in calls}),
            "top_level_effect_calls": len(records)}


# -- the run ---------------------------------------------------------------------------------------
def warmup(systems: list[str]) -> None:
    """Pay one-time costs (imports, dynamo/AOT and effectfx initialisation, transformers' first call) on a
    smaller ResNet (other shapes, so nothing measured later is cached), for the systems measured only; then
    freeze the heap so the collection before each measurement is cheap."""
    tiny = dict(CONFIG, embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1])
    pixels, labels = batch(seed=2, size=16, batch_size=2)
    for system in systems:
        marker, compiler = SYSTEMS[system]
        torch._dynamo.reset()
        f = compile_for(compiler, build(system, config=tiny))
        try:
            f(pixel_values=pixels, labels=labels).loss.backward()
        except Exception:  # failures are measured (and reported) later
            pass
    torch._dynamo.reset()
    LOG.clear()
    common.freeze_heap()


def _worktree_dirty() -> bool | None:
    """Whether effectfx/ has uncommitted changes (the commit in machine info then does not say it all)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "effectfx"], cwd=common.ROOT.parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def run(quick: bool = False, systems: list[str] | None = None, progress: common.Progress | None = None,
        warm: bool = True) -> dict[str, Any]:
    cfg = dict(QUICK if quick else FULL)
    if systems:
        cfg["systems"] = systems
    if warm:
        warmup(cfg["systems"])
    ref = references(WARMUP_STEPS)
    raw: dict[str, list[dict[str, Any]]] = {s: [] for s in cfg["systems"]}
    for _rep, system in plan(cfg):
        raw[system].append(measure_first_call(system, ref["first"]))
        if progress is not None:
            progress.step(f"first call {LABELS[system]}")
    steady = steady_state(cfg, ref["warm"], progress)
    structure = {s: tc_structure(s) for s in cfg["systems"] if SYSTEMS[s] == ("tc", "tc")}
    if progress is not None and structure:
        progress.step("torch.compile's regions")
    expected = n_blocks()
    results = []
    for system in cfg["systems"]:
        runs, st = raw[system], steady[system]
        matches = [r["matches_eager"] for r in runs]
        results.append({
            "system": system,
            "label": LABELS[system],
            "first_call": {
                "median_s": median(r["seconds"] for r in runs),
                "cpu_median_s": median(r["cpu_seconds"] for r in runs),
                "forward_median_s": median(r["forward_seconds"] for r in runs),
                "second_call_median_s": median(r["second_call"]["seconds"] for r in runs),
                "second_call_cpu_median_s": median(r["second_call"]["cpu_seconds"] for r in runs),
                "runs_s": [r["seconds"] for r in runs],
                "status": sorted({r["status"] for r in runs}),
                "second_call_status": sorted({r["second_call"]["status"] for r in runs}),
                "ok": all(r["status"] == "ok" for r in runs),
                "effects_per_call": [r["effects"] for r in runs],
                "second_call_effects": [r["second_call"]["effects"] for r in runs],
                "effects_correct": all(r["effects"] == expected and r["second_call"]["effects"] == expected
                                       for r in runs),
                "matches_eager": all(matches) if all(m is not None for m in matches) else None,
                "runs": runs,
            },
            "step": {k: v for k, v in st.items()},
            **({"tc_regions": structure[system]} if system in structure else {}),
            "expected_effects": expected,
            "effects_correct": all(r["effects"] == expected and r["second_call"]["effects"] == expected
                                   for r in runs)
            and st["effects_per_step"] == [expected] and st["warmup_effects"] == [expected] * WARMUP_STEPS,
            "matches_eager": (all(matches) if all(m is not None for m in matches) else None)
            if st["state_after_warmup"]["matches_eager"] is not False else False,
        })
    data = {
        "benchmark": NAME,
        "machine": {**common.machine_info(), "effectfx_worktree_dirty": _worktree_dirty()},
        "config": {"model": "transformers.ResNetForImageClassification", "resnet_config": CONFIG,
                   "blocks": expected, "batch": [BATCH, CHANNELS, SIZE, SIZE], "lr": LR, "optimizer": "SGD",
                   "warmup_steps": WARMUP_STEPS, "reps": cfg["reps"], "tc_reps": cfg["tc_reps"],
                   "min_rounds": cfg["rounds"], "min_seconds": cfg["min_seconds"], "rounds": steady["rounds"],
                   "steady_seconds": steady["seconds"], "quick": quick, "rtol": RTOL, "atol": ATOL,
                   "systems": {s: LABELS[s] for s in cfg["systems"]}, "torch_compile_backend": "aot_eager",
                   "efx_backend": "default", "torch_threads": torch.get_num_threads()},
        "results": results,
    }
    data["summary"] = summarize(data)
    return data


def _result(data: dict[str, Any], system: str) -> dict[str, Any] | None:
    return next((r for r in data["results"] if r["system"] == system), None)


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b or a != a or b != b:
        return None
    return a / b


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    eager, efx_ = _result(data, "eager"), _result(data, "efx")
    summary: dict[str, Any] = {"by_system": {}}
    for r in data["results"]:
        fc, st = r["first_call"], r["step"]
        summary["by_system"][r["system"]] = {
            "first_call_ms": fc["median_s"] * 1e3,
            "first_call_cpu_ms": fc["cpu_median_s"] * 1e3,
            "second_call_ms": fc["second_call_median_s"] * 1e3,
            "first_two_calls_ms": (fc["median_s"] + fc["second_call_median_s"]) * 1e3,
            "step_ms": st["median_s"] * 1e3,
            "step_cpu_ms": st["cpu_median_s"] * 1e3,
            "first_call_over_efx": _div(fc["median_s"], efx_ and efx_["first_call"]["median_s"]),
            "first_call_over_efx_cpu": _div(fc["cpu_median_s"], efx_ and efx_["first_call"]["cpu_median_s"]),
            "first_two_calls_over_efx": _div(fc["median_s"] + fc["second_call_median_s"],
                                             efx_ and efx_["first_call"]["median_s"]
                                             + efx_["first_call"]["second_call_median_s"]),
            "step_over_eager": _div(st["median_s"], eager and eager["step"]["median_s"]),
            "step_over_eager_cpu": _div(st["cpu_median_s"], eager and eager["step"]["cpu_median_s"]),
            "step_over_efx": _div(st["median_s"], efx_ and efx_["step"]["median_s"]),
            "first_call_ok": fc["ok"],
            "step_ok": st["status"] == "ok",
            "effects_correct": r["effects_correct"],
            "matches_eager": r["matches_eager"],
        }
    s = summary["by_system"]
    if "efx" in s:
        summary["efx_over_eager_step"] = s["efx"]["step_over_eager"]
        summary["efx_over_eager_step_cpu"] = s["efx"]["step_over_eager_cpu"]
        summary["efx_correct"] = bool(s["efx"]["matches_eager"] and s["efx"]["effects_correct"])
    for tc in ("tc", "tc_region"):
        if tc in s and "efx" in s:
            summary[f"{tc}_over_efx_first_call"] = s[tc]["first_call_over_efx"]
            summary[f"{tc}_over_efx_first_call_cpu"] = s[tc]["first_call_over_efx_cpu"]
            summary[f"{tc}_over_efx_step"] = s[tc]["step_over_efx"]
    return summary


def _fmt(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return "-" if value is None or value != value else f"{value:{spec}}{suffix}"


def table(data: dict[str, Any]) -> str:
    s = data["summary"]["by_system"]
    rows = []
    for r in data["results"]:
        m = s[r["system"]]
        correct = "yes" if r["matches_eager"] and r["effects_correct"] else "NO"
        if not r["matches_eager"] or not r["effects_correct"]:
            fc = r["first_call"]
            notes = [x for x in fc["status"] + [r["step"]["status"]] if x != "ok"]
            if fc["matches_eager"] is False:
                bad = [p for p in ("loss", "grads", "buffers") if fc["runs"][0].get(f"{p}_matches") is False]
                notes.append("differs: " + ",".join(bad))
            if r["step"]["state_after_warmup"]["matches_eager"] is False:
                notes.append("state after warm-up differs")
            if not r["effects_correct"]:
                notes.append(f"effects {fc['effects_per_call']}/{fc['second_call_effects']}"
                             f"/{r['step']['effects_per_step']}")
            correct += " (" + "; ".join(dict.fromkeys(notes))[:100] + ")"
        over = m["first_call_over_efx"]
        rows.append([SHORT[r["system"]], _fmt(m["first_call_ms"]), _fmt(m["first_call_cpu_ms"]),
                     _fmt(m["second_call_ms"]), _fmt(over, ".2f" if (over or 0) < 1 else ".1f", "x"),
                     _fmt(m["step_ms"], ".2f"), _fmt(m["step_cpu_ms"], ".2f"),
                     _fmt(m["step_over_eager"], ".2f", "x"), _fmt(m["step_over_efx"], ".2f", "x"), correct])
    cfg = data["config"]
    head = (f"ResNet ({cfg['blocks']} basic blocks, hidden {cfg['resnet_config']['hidden_sizes']}), batch "
            f"{'x'.join(map(str, cfg['batch']))}, training; median wall ms (cpu = process CPU time); "
            f"steady state over {cfg['rounds']} rounds")
    return head + "\n" + common.format_table(
        ["system", "1st call", "cpu", "2nd call", "1st/efx", "step", "cpu", "step/eager", "step/efx",
         "matches eager, effects"], rows) + "\n"


def plot(data: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"eager": "C2", "efx": "C0", "efx_noregion": "C9", "tc": "C1", "tc_region": "C3",
              "tc_region_shared": "C5"}
    results = data["results"]
    names = [SHORT[r["system"]].replace(" ", "\n", 1) for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    ax = axes[0]
    xs = range(len(results))
    first = [r["first_call"]["median_s"] * 1e3 for r in results]
    second = [r["first_call"]["second_call_median_s"] * 1e3 for r in results]
    w = 0.4
    bar_colors = [colors[r["system"]] for r in results]
    ax.bar([x - w / 2 for x in xs], first, w, color=bar_colors, label="first call")
    ax.bar([x + w / 2 for x in xs], second, w, color=bar_colors, alpha=0.45,
           hatch="//", label="second call (recompile: problem_type)")
    ax.scatter([x - w / 2 for x in xs], [r["first_call"]["cpu_median_s"] * 1e3 for r in results], marker="_",
               s=150, color="k", zorder=5, label="CPU time (median)")
    for x, v in zip(xs, first):
        ax.annotate(_fmt(v, ".0f"), (x - w / 2, v), ha="center", va="bottom", fontsize=7)
    for x, r in zip(xs, results):
        if not (r["matches_eager"] and r["effects_correct"]):
            failed = any(st.startswith("error") for st in r["first_call"]["status"])
            top = max(v for v in (first[x], second[x]) if v == v)
            ax.annotate("error" if failed else "wrong", (x, top * 1.6), ha="center", color="red", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(top=max(v for v in first + second if v == v) * 12)  # room for the legend
    ax.set_ylabel("ms (log scale)")
    ax.set_title("first call: compile + one training step", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", ncol=3)
    ax = axes[1]
    steps = [r["step"]["median_s"] * 1e3 for r in results]
    lo = [r["step"]["median_s"] * 1e3 - _quantile(r["step"]["runs_s"], 0.25) * 1e3 for r in results]
    hi = [_quantile(r["step"]["runs_s"], 0.75) * 1e3 - r["step"]["median_s"] * 1e3 for r in results]
    ax.bar(xs, steps, 0.6, color=[colors[r["system"]] for r in results], yerr=[lo, hi], capsize=3)
    ax.scatter(xs, [r["step"]["cpu_median_s"] * 1e3 for r in results], marker="_", s=300, color="k",
               zorder=5, label="CPU time (median)")
    for x, r in zip(xs, results):
        if r["step"]["status"] != "ok":
            ax.annotate("did not\nrun", (x, 0), ha="center", va="bottom", color="red", fontsize=8,
                        xytext=(0, 4), textcoords="offset points")
    ax.set_ylim(0, max(v for v in steps if v == v) * 1.45)  # room for the legend
    ax.legend(fontsize=7, loc="upper left")
    for x, v in zip(xs, steps):
        ax.annotate(_fmt(v, ".1f"), (x, v), ha="center", va="bottom", fontsize=7, xytext=(8, 2),
                    textcoords="offset points")
    ax.set_ylabel("ms per step (median, bars: quartiles)")
    ax.set_title("steady-state training step (fwd + bwd + SGD)", fontsize=10)
    for a in axes:
        a.set_xticks(list(xs))
        a.set_xticklabels(names, fontsize=8)
        a.grid(True, axis="y", alpha=0.3)
    cfg = data["config"]
    title = (f"HF ResNet, {cfg['blocks']} blocks as regions, batch {'x'.join(map(str, cfg['batch']))}, "
             "1 thread, torch.compile backend aot_eager")
    return common.save_figure(fig, title, data, path)


def _quantile(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    return v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition, eager/effectfx/torch.compile "
                        "with regions, 3 steady-state rounds; writes results/quick/ unless --out")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: results/, or results/quick/ with --quick)")
    parser.add_argument("--systems", default=None,
                        help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all, or quick's)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--plot-only", type=Path, default=None, metavar="JSON",
                        help="redraw the table and PNG (next to JSON) from a run's JSON; no measuring")
    args = parser.parse_args(argv)
    if args.plot_only is not None:
        data = json.loads(args.plot_only.read_text())
        print(table(data))
        png = args.plot_only.with_suffix(".png")
        print("wrote", common.replace_atomically(png, lambda path: plot(data, path)))
        return 0
    systems = args.systems.split(",") if args.systems else None
    if systems and (unknown := set(systems) - set(SYSTEMS)):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    torch.set_num_threads(args.threads)
    out = common.output_dir(args.out, args.quick)
    cfg = dict(QUICK if args.quick else FULL)
    if systems:
        cfg["systems"] = systems
    tc_regions = any(SYSTEMS[s] == ("tc", "tc") for s in cfg["systems"])
    progress = common.Progress(len(plan(cfg)) + len(cfg["systems"]) + 1 + tc_regions, NAME)
    data = run(args.quick, systems, progress)
    print(table(data))
    print("wrote", common.write_json(data, out, NAME),
          common.replace_atomically(out / f"{NAME}.png", lambda path: plot(data, path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
