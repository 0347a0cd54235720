"""Greedy generation with GPT-2 (``effectfx.testing.hf``: 4 layers, hidden 64, random weights, every layer a
``LoggedLayer`` region recording its name with ``efxtest::record_memory``): eager, ``efx.compile(model)`` with
transformers' ``StaticCache`` and default ``DynamicCache``, and ``torch.compile(mode="default")`` (Inductor)
with the static cache, side by side.  The systems (every one builds the same seeded weights) are in
:mod:`benchmarks.generate_systems`, the summary, table, targets and plot in :mod:`benchmarks.generate_report`.

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
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import effectfx as efx  # noqa: E402
from benchmarks import common, common_child  # noqa: E402
from benchmarks.generate_report import TARGETS, plot, summarize, table  # noqa: E402
from benchmarks.generate_systems import (  # noqa: E402
    FIRST_CALL_ONLY,
    LABELS,
    PROMPT,
    SYSTEMS,
    WEIGHT_SCALE,
    build,
    compiles,
    effects_expected,
    generate,
    prepare,
    prompt,
    reference_of,
)

NAME = "generate"
FULL = {"tokens": 32, "reps": 3, "budget_s": 60.0, "min_rounds": 10, "inductor": True,
        "systems": tuple(SYSTEMS), "steady": tuple(s for s in SYSTEMS if s not in FIRST_CALL_ONLY)}
# a smoke run: effectfx's first calls only (each checked against eager in its process), all four steady
QUICK = {"tokens": 8, "reps": 1, "budget_s": 2.0, "min_rounds": 3, "inductor": False,
         "systems": ("efx_static", "efx_dynamic"),
         "steady": ("eager_static", "efx_static", "eager_dynamic", "efx_dynamic")}


# -- one first call, in a subprocess -------------------------------------------------------------------------
def _warm_up(inductor: bool) -> None:
    """The one-time costs every system pays alike (see the module docstring)."""
    from effectfx.testing.effect_ops import recording

    if inductor:
        common_child.warm_up_inductor()  # a tiny torch.compile and efx.compile(backend="inductor")
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
    from effectfx.testing.effect_ops import recording

    common_child.quiet_transformers()
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
            cpu, wall = common_child.tree_cpu_s(), time.perf_counter()
            out = generate(f, system, tokens, ids)
            wall, cpu = time.perf_counter() - wall, common_child.tree_cpu_s() - cpu
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
        result["dynamo"] = common.dynamo_counts()
    return result


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

    common_child.quiet_transformers()
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
            checks[system]["dynamo"] = common.dynamo_counts()  # all tc systems of this process together
    medians = {s: {k: common.median(v) for k, v in got.items() if k != "forwards"}
               for s, got in samples.items()}
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
                first[system].append(common_child.run(__file__, spec, tempfile.mkdtemp(dir=tmp)))
                bar.step(f"{system} first call")
        spec = {"mode": "steady", "systems": steady_systems, "tokens": cfg["tokens"], "threads": threads,
                "budget_s": cfg["budget_s"], "min_rounds": cfg["min_rounds"]}
        steady = common_child.run(__file__, spec, tempfile.mkdtemp(dir=tmp))
        bar.step("steady state")
    from effectfx.testing import hf

    data = {"benchmark": NAME, "machine": {**common.machine_info(), "torch_threads": threads},
            "config": {"label": label, **common.effectfx_source(),
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 tokens, no torch.compile, one repetition")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of every first call")
    parser.add_argument("--tokens", type=int, default=None, help="new tokens per generate call")
    common.add_run_arguments(parser)
    common.add_output_arguments(parser, NAME)
    args = parser.parse_args(argv)

    def child(spec: dict[str, Any]) -> dict[str, Any]:
        if spec["mode"] == "first":
            return first_call(spec["system"], spec["tokens"], spec["threads"], spec["inductor"])
        return steady_state(spec["systems"], spec["tokens"], spec["threads"], spec["budget_s"],
                            spec["min_rounds"])

    def measure() -> dict[str, Any]:
        return run(args.quick, args.reps, args.tokens, args.threads, args.budget, not args.no_progress,
                   args.label)

    return common.dispatch(args, NAME, (summarize, table, plot), measure, child)


if __name__ == "__main__":
    sys.exit(main())
