"""Greedy generation with GPT-2 (``effectfx.testing.hf``: 4 layers, hidden 64, random weights, every layer a
``LoggedLayer`` region recording its name with ``efxtest::record_memory``): eager, ``efx.compile(model)`` with
transformers' ``StaticCache`` and default ``DynamicCache``, and ``torch.compile(mode="default")`` (Inductor)
with the static cache, side by side.

Systems (:data:`SYSTEMS`; every one builds the same seeded weights):

* ``eager_static``, ``eager_dynamic``: ``model.generate`` (the references);
* ``efx_static``, ``efx_dynamic``: ``efx.compile(model).generate``;
* ``tc_static``: ``model.forward = torch.compile(model.forward, mode="default")``, then ``model.generate``
  (transformers' own recipe; ``torch.compile(model)`` returns an ``OptimizedModule`` whose ``generate`` is
  the model's, calling the uncompiled model: that is ``tc_module``, measured for its first call only);
* ``*_pure``: the same model built with ``hf.build("gpt2", logged=False)`` (no effect op): torch.compile
  drops the effect op (it is registered with effectfx only), so its effect-free run is the fair comparison;
* ``tc_static_ordered`` (first call only): ``tc_static`` with the op also in torch's effect registry
  (ORDERED, as :mod:`benchmarks.common` registers its own op), global to its process.

First call: one ``generate`` of ``tokens`` new tokens in a fresh subprocess per system and repetition, with a
fresh ``TORCHINDUCTOR_CACHE_DIR`` (as :mod:`benchmarks.inductor`), after the one-time costs every system pays
alike (imports; a tiny ``torch.compile`` (full runs) and ``efx.compile``; a 2-token eager ``generate`` of an
unrelated model), which are reported apart; then the captures/compiles, a second call, and tokens and effect
log against eager's (the same model, in the same process).  Steady state: every system in one process, warmed
up by two generate calls, then timed interleaved in shuffled rounds, one ``generate`` per system per round;
forward hooks stamp each forward's start and end, so every call also gives its decode steps: per token =
start-to-start of consecutive forwards (the forward and generate's own work for one token), from the third
forward on (the prefill and the first decode step run programs of their own); medians over rounds.

Run: ``python benchmarks/generate.py [--quick] [--out DIR] [--reps R] [--tokens N] [--threads T]``; a full
run writes ``results/generate.json`` and ``.png`` (``--quick``: ``results/quick/``, 8 tokens, no Inductor).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import effectfx as efx  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import median  # noqa: E402

NAME = "generate"
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
TARGETS = {"static_captures": 2, "dynamic_captures": 3, "static_token_over_eager": 1.0}
FULL = {"tokens": 32, "reps": 3, "budget_s": 60.0, "min_rounds": 10, "inductor": True,
        "systems": tuple(SYSTEMS), "steady": tuple(s for s in SYSTEMS if s not in FIRST_CALL_ONLY)}
# a smoke run: effectfx's first calls only (each checked against eager in its process), all four steady
QUICK = {"tokens": 8, "reps": 1, "budget_s": 2.0, "min_rounds": 3, "inductor": False,
         "systems": ("efx_static", "efx_dynamic"),
         "steady": ("eager_static", "efx_static", "eager_dynamic", "efx_dynamic")}


# -- the systems ---------------------------------------------------------------------------------------------
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


def dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"frames_ok": int(counters["frames"]["ok"]), "frames_total": int(counters["frames"]["total"]),
            "unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def effects_expected(system: str, tokens: int) -> int:
    from effectfx.testing import hf

    return tokens * hf.LAYERS if SYSTEMS[system][2] else 0


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()


# -- one first call, in a subprocess -------------------------------------------------------------------------
def _warm_up(inductor: bool) -> None:
    """The one-time costs every system pays alike (see the module docstring)."""
    from effectfx.testing.effect_ops import recording

    if inductor:
        from benchmarks.inductor import _warm_up as inductor_warm_up

        inductor_warm_up()  # a tiny torch.compile and efx.compile(backend="inductor")
    efx.compile(lambda a: torch.sin(a) + 1)(torch.randn(3))
    throwaway = build("eager_static", seed=1)
    with recording():
        for system in ("eager_static", "eager_dynamic"):
            generate(throwaway, system, 2, prompt())
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    common.freeze_heap()


def first_call(system: str, tokens: int, threads: int, inductor: bool) -> dict[str, Any]:
    """Measure one first generate call in this process (a subprocess of the benchmark: see ``--child``)."""
    from benchmarks.inductor import tree_cpu_s
    from effectfx.testing.effect_ops import recording

    _quiet()
    torch.set_num_threads(threads)
    if system == "tc_static_ordered":
        from torch._library.effects import EffectType

        torch.library._register_effectful_op("efxtest::record_memory", EffectType.ORDERED)
    start = time.perf_counter()
    _warm_up(inductor)
    warmup_s = time.perf_counter() - start
    ids = prompt()
    reference = build(reference_of(system))
    f = prepare(system, build(system))
    gc.collect()
    try:
        with recording() as log:
            cpu, wall = tree_cpu_s(), time.perf_counter()
            out = generate(f, system, tokens, ids)
            wall, cpu = time.perf_counter() - wall, tree_cpu_s() - cpu
        n_compiles = compiles(system, f)
        with recording() as log2:
            second = time.perf_counter()
            out2 = generate(f, system, tokens, ids)
            second = time.perf_counter() - second
    except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
        return {"status": f"{type(e).__name__}: {str(e)[:300]}", "warmup_s": warmup_s}
    with recording() as want:
        expected = generate(reference, reference_of(system), tokens, ids)
    new = out[0, ids.shape[1]:].tolist()
    result: dict[str, Any] = {
        "status": "ok", "wall_s": wall, "cpu_s": cpu, "second_s": second, "warmup_s": warmup_s,
        "compiles": n_compiles, "compiles_after_second": compiles(system, f),
        "tokens": new, "tokens_generated": len(new),
        "tokens_equal_eager": bool(torch.equal(out, expected)),
        "second_tokens_equal_eager": bool(torch.equal(out2, expected)),
        "effects": len(log), "effects_expected": effects_expected(system, tokens),
        "effects_equal_eager": list(log) == list(want),
        "second_effects_equal_eager": list(log2) == list(want),
        "eager_effects": len(want)}
    if SYSTEMS[system][0] in ("tc", "tc_module"):
        result["dynamo"] = dynamo_counts()
    return result


def _child(spec: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=3600)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"status": f"child failed (exit {proc.returncode}): {proc.stderr[-500:]}"}


# -- steady state, in one process ----------------------------------------------------------------------------
class Stamps:
    """Forward hooks stamping each forward's start and end (wall and CPU) on one model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.starts: list[tuple[float, float]] = []
        self.ends: list[tuple[float, float]] = []
        self.keep = False  # keep every forward's last-position logits (the checks, not the timed calls)
        self.logits: list[torch.Tensor] = []
        model.register_forward_pre_hook(self._pre, with_kwargs=True)
        model.register_forward_hook(self._post, with_kwargs=True)

    def _pre(self, module: Any, args: Any, kwargs: Any) -> None:
        self.starts.append((time.perf_counter(), time.process_time()))

    def _post(self, module: Any, args: Any, kwargs: Any, out: Any) -> None:
        self.ends.append((time.perf_counter(), time.process_time()))
        if self.keep:
            self.logits.append(out.logits[:, -1].detach().clone())

    def clear(self) -> None:
        self.starts.clear()
        self.ends.clear()
        self.logits.clear()

    def per_token(self) -> dict[str, float] | None:
        """Mean decode step from the third forward on (s): start-to-start, and the forward alone."""
        s, e = self.starts, self.ends
        if len(s) < 4 or len(e) != len(s):
            return None
        n = len(s) - 3
        return {"token_s": (s[-1][0] - s[2][0]) / n, "token_cpu_s": (s[-1][1] - s[2][1]) / n,
                "forward_s": sum(b[0] - a[0] for a, b in zip(s[2:], e[2:])) / (n + 1),
                "forward_cpu_s": sum(b[1] - a[1] for a, b in zip(s[2:], e[2:])) / (n + 1),
                "prefill_s": e[0][0] - s[0][0], "forwards": len(s)}


def steady_state(systems: list[str], tokens: int, threads: int, budget_s: float,
                 min_rounds: int) -> dict[str, Any]:
    """Every system warmed up, then one generate per system per round, in shuffled order; medians."""
    from effectfx.testing.effect_ops import recording

    _quiet()
    torch.set_num_threads(threads)
    ids = prompt()
    runs: dict[str, Callable[[], tuple[torch.Tensor, list]]] = {}
    stamps: dict[str, Stamps] = {}
    status: dict[str, str] = {}
    checks: dict[str, dict[str, Any]] = {}
    fs: dict[str, Any] = {}
    expected: dict[str, tuple[torch.Tensor, list]] = {}
    logits: dict[str, torch.Tensor] = {}
    # references first; torch.compile last: its graphs of the logged layers guard on effectfx's thread-local
    # tracer slot (``LoggedLayer.forward`` is an ``@efx.region``), which effectfx's first capture fills, so a
    # capture after them would make torch.compile compile again while being timed
    order = sorted(systems, key=lambda s: ("eager", "efx", "tc").index(SYSTEMS[s][0]))
    for system in order:
        model = build(system)
        stamps[system] = Stamps(model)  # before compiling: the hooks are part of every call
        f = fs[system] = prepare(system, model)
        before = compiles(system, f)  # torch.compile's counters are the process's

        def run(f: Any = f, system: str = system) -> tuple[torch.Tensor, list]:
            with recording() as log:
                out = generate(f, system, tokens, ids)
            return out, list(log)

        stamps[system].keep = True
        try:
            warm = [run(), run()]
        except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
            status[system] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        finally:
            stamps[system].keep = False
        step_logits = torch.cat(stamps[system].logits[-tokens:])  # the second call's, one row per token
        if system == reference_of(system):
            expected[system] = warm[-1]
            logits[system] = step_logits
        want = expected.get(reference_of(system))
        ref_logits = logits.get(reference_of(system))
        checks[system] = {
            "tokens": warm[-1][0][0, ids.shape[1]:].tolist(),
            "max_logit_diff": float((step_logits - ref_logits).abs().max())
            if ref_logits is not None and ref_logits.shape == step_logits.shape else None,
            "tokens_equal_eager": want is not None and all(torch.equal(o, want[0]) for o, _ in warm),
            "effects_equal_eager": want is not None and all(log == want[1] for _, log in warm),
            "effects_per_generate": [len(log) for _, log in warm],
            "effects_expected": effects_expected(system, tokens),
            "compiles_in_warmup": compiles(system, f) - before}
        status[system] = "ok"
        runs[system] = run
    common.freeze_heap()
    before_timing = {s: compiles(s, fs[s]) for s in runs}
    samples: dict[str, dict[str, list[float]]] = {s: {} for s in runs}
    effects: dict[str, set[int]] = {s: set() for s in runs}
    same: dict[str, bool] = {s: True for s in runs}
    end, rounds = time.perf_counter() + budget_s, 0
    while time.perf_counter() < end or rounds < min_rounds:
        order = list(runs)
        random.shuffle(order)
        for system in order:
            stamps[system].clear()
            common.quiet_gc()
            t, c = time.perf_counter(), time.process_time()
            out, log = runs[system]()
            t, c = time.perf_counter() - t, time.process_time() - c
            got = samples[system]
            got.setdefault("generate_s", []).append(t)
            got.setdefault("generate_cpu_s", []).append(c)
            for k, v in (stamps[system].per_token() or {}).items():
                got.setdefault(k, []).append(v)
            effects[system].add(len(log))
            want = expected.get(reference_of(system))
            same[system] &= want is not None and torch.equal(out, want[0])
        rounds += 1
    for system in runs:
        checks[system].update({"compiles_in_timing": compiles(system, fs[system]) - before_timing[system],
                               "effects_per_generate_timed": sorted(effects[system]),
                               "timed_tokens_equal_eager": same[system]})
        if SYSTEMS[system][0] == "tc":
            checks[system]["dynamo"] = dynamo_counts()  # all tc systems of this process together
    medians = {s: {k: median(v) for k, v in got.items() if k != "forwards"} for s, got in samples.items()}
    return {"status": status, "rounds": rounds, "checks": checks, "medians": medians,
            "forwards_per_generate": {s: sorted(set(got.get("forwards", []))) for s, got in samples.items()},
            "samples": samples}


# -- the whole run -------------------------------------------------------------------------------------------
def run(quick: bool = False, reps: int | None = None, tokens: int | None = None, threads: int = 1,
        budget_s: float | None = None, progress: bool = True, label: str | None = None) -> dict[str, Any]:
    cfg = dict(QUICK if quick else FULL)
    cfg["reps"] = reps or cfg["reps"]
    cfg["tokens"] = tokens or cfg["tokens"]
    cfg["budget_s"] = budget_s if budget_s is not None else cfg["budget_s"]
    systems, steady_systems = list(cfg["systems"]), list(cfg["steady"])
    bar = common.Progress(cfg["reps"] * len(systems) + 1, NAME, enabled=progress)
    first: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="efx-generate-bench-") as tmp:
        for rep in range(cfg["reps"]):
            order = list(systems)
            random.Random(rep).shuffle(order)  # no system always runs first (or last) on a busy machine
            for system in order:
                spec = {"mode": "first", "system": system, "tokens": cfg["tokens"], "threads": threads,
                        "inductor": cfg["inductor"] and SYSTEMS[system][0] in ("tc", "tc_module")}
                first[system].append(_child(spec, tempfile.mkdtemp(dir=tmp)))
                bar.step(f"{system} first call")
        spec = {"mode": "steady", "systems": steady_systems, "tokens": cfg["tokens"], "threads": threads,
                "budget_s": cfg["budget_s"], "min_rounds": cfg["min_rounds"]}
        steady = _child(spec, tempfile.mkdtemp(dir=tmp))
        bar.step("steady state")
    from effectfx.testing import hf

    data = {"benchmark": NAME, "machine": {**common.machine_info(), "torch_threads": threads},
            "config": {"label": label, "effectfx_path": str(Path(efx.__file__).parent),
                       "quick": quick, "tokens": cfg["tokens"], "prompt": PROMPT, "reps": cfg["reps"],
                       "budget_s": cfg["budget_s"], "min_rounds": cfg["min_rounds"],
                       "inductor_warmup": cfg["inductor"], "threads": threads,
                       "first_call_systems": systems, "steady_systems": steady_systems,
                       "systems": {s: {"how": SYSTEMS[s][0], "cache": SYSTEMS[s][1], "logged": SYSTEMS[s][2],
                                       "label": LABELS[s]} for s in SYSTEMS if s in systems + steady_systems},
                       "model": {"kind": "gpt2", "layers": hf.LAYERS, "hidden": hf.HIDDEN, "heads": hf.HEADS,
                                 "vocab": hf.VOCAB, "batch": 1, "weight_scale": WEIGHT_SCALE},
                       "targets": TARGETS},
            "first_call": first, "steady_state": steady}
    data["summary"] = summarize(data)
    return data


def _median_of(runs: list[dict[str, Any]], field: str) -> float | None:
    values = [r[field] for r in runs if r.get("status") == "ok" and r.get(field) is not None]
    return median(values) if values else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _paired(samples: dict[str, Any], system: str, other: str, field: str) -> dict[str, float] | None:
    """The per-round ratio ``system / other`` of ``field`` (one call of each per round): common.paired."""
    if system == other:
        return None
    return common.paired(samples.get(system, {}).get(field), samples.get(other, {}).get(field))


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per system: first call, captures, steady times, their ratios to eager and torch.compile, checks;
    and each target's verdict."""
    first, steady = data["first_call"], data["steady_state"]
    med = steady.get("medians", {})
    checks = steady.get("checks", {})
    eager_tokens = {s: c["tokens"] for s, c in checks.items() if SYSTEMS[s][0] == "eager"}
    out: dict[str, Any] = {}
    for system in data["config"]["systems"]:
        runs = first.get(system, [])
        ok = [r for r in runs if r.get("status") == "ok"]
        m, c = med.get(system, {}), checks.get(system, {})
        ref, tc = reference_of(system), tc_of(system)
        # every check made of this system: in its first-call processes and in the steady-state one
        tokens_same = [r[k] for r in ok for k in ("tokens_equal_eager", "second_tokens_equal_eager")]
        tokens_same += [r["tokens"] == eager_tokens[ref] for r in ok if ref in eager_tokens]
        tokens_same += [c[k] for k in ("tokens_equal_eager", "timed_tokens_equal_eager") if k in c]
        tokens_same += [c["tokens"] == eager_tokens[ref]] if c and ref in eager_tokens else []
        effects_same = [r[k] for r in ok for k in ("effects_equal_eager", "second_effects_equal_eager")]
        effects_same += [c["effects_equal_eager"]] if c else []
        effects_same += [c["effects_per_generate_timed"] == [c["effects_per_generate"][-1]]] if c else []
        s: dict[str, Any] = {
            "first_s": _median_of(runs, "wall_s"), "first_cpu_s": _median_of(runs, "cpu_s"),
            "second_s": _median_of(runs, "second_s"),
            "compiles": sorted({r["compiles"] for r in ok}),
            "compiles_after_second": sorted({r["compiles_after_second"] for r in ok}),
            "first_ok_runs": len(ok), "first_runs": len(runs),
            "first_failure": next((r["status"] for r in runs if r.get("status") != "ok"), None),
            "tokens_equal_eager": bool(tokens_same) and all(tokens_same),
            "effects_equal_eager": bool(effects_same) and all(effects_same),
            "max_logit_diff": c.get("max_logit_diff"),
            "compiles_in_timing": c.get("compiles_in_timing"),
            "effects": sorted({r["effects"] for r in ok} | set(c.get("effects_per_generate", []))),
            "effects_expected": effects_expected(system, data["config"]["tokens"]),
            "steady_status": steady.get("status", {}).get(system),
            "generate_ms": _ms(m.get("generate_s")), "generate_cpu_ms": _ms(m.get("generate_cpu_s")),
            "token_ms": _ms(m.get("token_s")), "token_cpu_ms": _ms(m.get("token_cpu_s")),
            "forward_ms": _ms(m.get("forward_s")), "forward_cpu_ms": _ms(m.get("forward_cpu_s")),
            "reference": ref, "tc_reference": tc}
        r, t = med.get(ref, {}), med.get(tc, {}) if tc else {}
        for field in ("generate_s", "generate_cpu_s", "token_s", "token_cpu_s", "forward_s"):
            s[f"{field[:-2]}_over_eager"] = _div(m.get(field), r.get(field))
            s[f"{field[:-2]}_over_tc"] = _div(m.get(field), t.get(field))
        s["token_paired_over_eager"] = _paired(steady.get("samples", {}), system, ref, "token_s")
        s["token_paired_over_tc"] = _paired(steady.get("samples", {}), system, tc, "token_s") if tc else None
        s["first_over_eager"] = _div(s["first_s"], _median_of(first.get(ref, []), "wall_s"))
        s["first_over_tc"] = _div(s["first_s"], _median_of(first.get(tc, []), "wall_s")) if tc else None
        out[system] = s
    targets: dict[str, Any] = {}
    if "efx_static" in out:
        c = out["efx_static"]["compiles"]
        targets["static_captures"] = {"target": f"<= {TARGETS['static_captures']}", "value": c,
                                      "met": bool(c) and max(c) <= TARGETS["static_captures"]}
        ratio = out["efx_static"]["token_over_eager"]
        cpu = out["efx_static"]["token_cpu_over_eager"]
        targets["static_token_over_eager"] = {
            "target": f"<= {TARGETS['static_token_over_eager']}x", "value": ratio, "cpu": cpu,
            "paired": out["efx_static"]["token_paired_over_eager"],
            "met": ratio is not None and ratio <= TARGETS["static_token_over_eager"]}
    if "efx_dynamic" in out:
        c = out["efx_dynamic"]["compiles"]
        targets["dynamic_captures"] = {"target": f"<= {TARGETS['dynamic_captures']}", "value": c,
                                       "met": bool(c) and max(c) <= TARGETS["dynamic_captures"]}
    return {"systems": out, "targets": targets}


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def _f(v: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def table(data: dict[str, Any]) -> str:
    summary = data["summary"]["systems"]
    rows = []
    for system, s in summary.items():
        effects = "/".join(str(e) for e in s["effects"]) or "-"
        failure = s["first_failure"] or (s["steady_status"] if s["steady_status"] not in (None, "ok") else "")
        check = ("same" if s["tokens_equal_eager"] else "DIFFER") + ", " + (
            "same" if s["effects_equal_eager"] else f"{effects} of {s['effects_expected']}")
        if not s["first_ok_runs"] and s["steady_status"] in (None, "ok") and s["token_ms"] is None:
            check = "fails"
        rows.append([
            system, ",".join(str(c) for c in s["compiles"]) or "-",
            f"{_f(s['first_s'], ' s')} / {_f(s['first_cpu_s'], ' s')}", _f(s["second_s"], " s", 3),
            _f(s["generate_ms"], "", 1), f"{_f(s['token_ms'], '', 3)} / {_f(s['token_cpu_ms'], '', 3)}",
            _f(s["forward_ms"], "", 3), _f(s["token_over_eager"], "x"), _f(s["token_cpu_over_eager"], "x"),
            _f(s["token_over_tc"], "x"), _f(s["generate_over_eager"], "x"), _f(s["first_over_eager"], "x", 1),
            check, _f(s["max_logit_diff"], "", 7), failure[:60]])
    cfg = data["config"]
    st = data["steady_state"]
    head = f"{cfg['label']}: " if cfg.get("label") else ""
    text = [head + f"GPT-2 ({cfg['model']['layers']} layers), greedy generation of {cfg['tokens']} tokens "
            f"after a {cfg['prompt']}-token prompt; first call: median of {cfg['reps']} fresh processes; "
            f"steady: medians of {st.get('rounds', 0)} interleaved rounds (ms); ratios vs eager with the"
            " same cache and model, vs torch.compile (static cache, same model)",
            common.format_table(["system", "captures", "first call wall / CPU", "2nd call", "generate ms",
                                 "per token wall / CPU", "forward", "tok/eager", "tok/eager CPU", "tok/tc",
                                 "gen/eager", "first/eager", "tokens, effects vs eager", "max |dlogit|",
                                 "failure"], rows)]
    targets = data["summary"]["targets"]
    if targets:
        text += ["", "targets:"]
        for name, t in targets.items():
            value = t["value"]
            if isinstance(value, float):
                paired = t.get("paired") or {}
                value = f"{value:.3f}x (CPU {t['cpu']:.3f}x" + (
                    f"; per-round median {paired['median']:.3f}x, IQR {paired['q1']:.3f}-{paired['q3']:.3f}x)"
                    if paired else ")")
            text.append(f"  {name}: {t['target']}: {value} -> {'met' if t['met'] else 'NOT met'}")
    return "\n".join(text)


def plot(data: dict[str, Any], path: Path) -> Path:
    """First call per system (log scale, CPU as ticks, captures annotated) and steady time per token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = data["summary"]["systems"]
    names = [s for s in summary if summary[s]["first_runs"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"eager": "C7", "efx": "C0", "tc": "C3", "tc_module": "C1"}
    xs = range(len(names))
    left.bar(xs, [summary[s]["first_s"] or 0 for s in names], color=[colors[SYSTEMS[s][0]] for s in names])
    left.scatter(xs, [summary[s]["first_cpu_s"] or float("nan") for s in names], marker="_", s=80, color="k",
                 zorder=5, label="CPU time (process tree)")
    low = min((summary[s]["first_s"] for s in names if summary[s]["first_s"]), default=1.0)
    for x, s in zip(xs, names):
        if summary[s]["first_s"] is None:
            left.annotate("fails", (x, low), ha="center", va="bottom", fontsize=7, color="red")
            continue
        c = summary[s]["compiles"]
        note = f"{','.join(map(str, c))} capt." if SYSTEMS[s][0] == "efx" else (
            f"{','.join(map(str, c))} graphs" if SYSTEMS[s][0] != "eager" else "")
        if summary[s]["effects"] and summary[s]["effects_expected"] and not summary[s]["effects_equal_eager"]:
            note += "\neffects\ndropped"
        top = max(summary[s]["first_s"], summary[s]["first_cpu_s"] or 0)
        left.annotate(note, (x, top * 1.1), ha="center", va="bottom", fontsize=6)
    left.set_yscale("log")
    left.set_ylim(top=left.get_ylim()[1] * 6)
    left.set_ylabel("s (median wall, log scale)")
    left.set_title(f"first generate call ({data['config']['tokens']} tokens, fresh process)", fontsize=10)
    steady = [s for s in summary if summary[s]["token_ms"] is not None]
    xs2 = range(len(steady))
    right.bar(xs2, [summary[s]["token_ms"] for s in steady], color=[colors[SYSTEMS[s][0]] for s in steady],
              label="per token (start to start)")
    right.scatter(xs2, [summary[s]["forward_ms"] for s in steady], marker="_", s=80, color="k", zorder=5,
                  label="forward alone")
    for x, s in zip(xs2, steady):
        ratio = summary[s]["token_over_eager"]
        if SYSTEMS[s][0] != "eager" and ratio is not None:
            dropped = "\neffects\ndropped" if summary[s]["effects_expected"] and not summary[s][
                "effects_equal_eager"] else ""
            right.annotate(f"{ratio:.2f}x{dropped}", (x, summary[s]["token_ms"] * 1.02), ha="center",
                           va="bottom", fontsize=7)
    right.set_ylabel("ms per decode step (median)")
    right.set_ylim(top=right.get_ylim()[1] * 1.15)
    right.set_title("steady decode step (x = vs eager, same cache and model)", fontsize=10)
    for ax, labels in ((left, names), (right, steady)):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(True, axis="y", alpha=0.3)
    return common.save_figure(fig, "greedy generation, GPT-2 (4 layers), 1 thread", data, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 tokens, no torch.compile, one repetition")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of every first call")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per generate call")
    common.add_run_arguments(parser)
    common.add_output_arguments(parser, NAME)
    args = parser.parse_args(argv)
    if args.plot_only is not None:
        return common.redraw(args.plot_only, (summarize, table, plot))
    if args.child:
        spec = json.loads(args.child)
        if spec["mode"] == "first":
            result = first_call(spec["system"], spec["tokens"], spec["threads"], spec["inductor"])
        else:
            result = steady_state(spec["systems"], spec["tokens"], spec["threads"], spec["budget_s"],
                                  spec["min_rounds"])
        print(json.dumps(result, default=str))
        return 0
    data = run(args.quick, args.reps, args.tokens, args.threads, args.budget, not args.no_progress,
               args.label)
    common.publish(data, common.output_dir(args.out, args.quick), NAME, (summarize, table, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
