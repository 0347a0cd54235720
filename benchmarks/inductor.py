"""effectfx's Inductor backend beside torch.compile and eager: first call (fresh and warm Inductor caches)
and the steady-state training step, for a stack of N transformer-style blocks (N = 2, 16) and GPT-2.

Models (same weights in every system; each block/layer first calls the effect op ``efxbench::record``):

* ``stack``: N blocks of ``x + fc2(gelu(fc1(layer_norm(x))))``, width 64 (fc 256), input (8, 32, 64);
  training: ``out.pow(2).mean().backward()``;
* ``gpt2``: ``transformers``' GPT2LMHeadModel, 12 layers, hidden 64, 4 heads, vocab 100, random weights
  (``effectfx.testing.hf.gpt2_config``), input ids (4, 32); training: ``model(ids, labels=ids).loss``.

Systems: ``eager``; ``efx`` = ``efx.compile(model, backend="inductor")`` (each region body compiled once,
:mod:`effectfx.backends.inductor`); ``efx_hop`` = the same capture handed to torch's own Inductor lowering
of ``invoke_subgraph`` (:func:`hop_lowering`: one ``compile_fx_inner`` per root graph, bodies lowered once
inside it) -- the alternative the backend was chosen against; ``tc`` = ``torch.compile(model,
backend="inductor")`` on plain blocks; ``tc_ncr`` = the same with ``torch.compiler.nested_compile_region``
blocks; ``*_pure``: the same model without the effect op (torch.compile fails on some effectful
configurations; its effect-free run then stands in, marked ``*``).  Blocks are marked once per system (one
class per marker and effect).

First call = capture + compile + first forward and backward, each measured in its own subprocess whose
``TORCHINDUCTOR_CACHE_DIR`` is a fresh temporary directory ("fresh"), or the directory a fresh ``efx`` /
``tc`` run just filled ("warm": a second process starting).  Before measuring, every subprocess pays the
one-time costs every system pays alike (imports, Inductor's vector-ISA probe and precompiled header,
compile workers, dynamo's first frame): one tiny ``torch.compile`` and one tiny ``efx.compile`` of an
unrelated function; that warm-up is reported apart.  Each first call is checked against eager (outputs,
gradients, effect count).  Steady state: every system warmed up in one process, training steps timed
interleaved in shuffled order (samples of >= 20 ms, ~budget seconds per model), medians.

Run: ``python benchmarks/inductor.py [--quick] [--out DIR] [--reps R]``; a full run writes
``results/inductor.json`` (``--quick``: ``results/quick/``, never the committed figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import operator
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.fx as fx  # noqa: E402

import effectfx as efx  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks.common import LOG, median  # noqa: E402

NAME = "inductor"
WIDTH, BATCH, SEQ = 64, 8, 32
GPT2_LAYERS, GPT2_BATCH = 12, 4
# system -> (how it is compiled, how its blocks are marked, whether they call the effect op)
SYSTEMS: dict[str, tuple[str, str, bool]] = {
    "eager": ("eager", "eager", True),
    "eager_pure": ("eager", "eager", False),
    "efx": ("efx", "efx", True),
    "efx_hop": ("efx_hop", "efx", True),
    "efx_pure": ("efx", "efx", False),
    "tc": ("tc", "eager", True),
    "tc_ncr": ("tc", "tc", True),
    "tc_pure": ("tc", "eager", False),  # torch.compile fails on some effectful configurations (results)
    "tc_ncr_pure": ("tc", "tc", False),
}
FIRST_CALL = ("efx", "efx_hop", "tc", "tc_ncr", "tc_pure", "tc_ncr_pure")
WARM = ("efx", "tc", "tc_pure")  # also measured in a second process on the cache the first filled
FULL = {"configs": [("stack", 2), ("stack", 16), ("gpt2", GPT2_LAYERS)], "reps": 3, "budget_s": 20.0,
        "systems": FIRST_CALL}
QUICK = {"configs": [("stack", 2)], "reps": 1, "budget_s": 2.0, "systems": ("efx", "tc_pure")}


# -- models ----------------------------------------------------------------------------------------------
class BlockBase(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)


def _block(self: BlockBase, x: torch.Tensor) -> torch.Tensor:
    torch.ops.efxbench.record("block")
    return _block_pure(self, x)


def _block_pure(self: BlockBase, x: torch.Tensor) -> torch.Tensor:
    return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class LayerBase(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer


def _layer(self: LayerBase, *args: Any, **kwargs: Any) -> Any:
    torch.ops.efxbench.record("layer")  # a literal: torch.compile would specialize on a per-layer string
    return self.layer(*args, **kwargs)


def _layer_pure(self: LayerBase, *args: Any, **kwargs: Any) -> Any:
    return self.layer(*args, **kwargs)


def _classes(base: type, name: str, effect: Callable, pure: Callable) -> dict[tuple[str, bool], type]:
    """One class per (marker, effects): each system sees its own marker and nothing else."""
    return {(m, e): type(f"{name}_{m}{'' if e else '_pure'}", (base,),
                         {"forward": mark(effect if e else pure)})
            for m, mark in common.MARKERS.items() for e in (True, False)}


BLOCKS = _classes(BlockBase, "Block", _block, _block_pure)
LAYERS = _classes(LayerBase, "Layer", _layer, _layer_pure)


class Stack(torch.nn.Module):
    def __init__(self, n: int, marker: str, effects: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(BLOCKS[marker, effects](WIDTH) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build(model: str, n: int, system: str) -> tuple[torch.nn.Module, Callable[[Any], torch.Tensor]]:
    """(module, the loss of one call of ``f`` on the input) for ``system``: the same weights for all."""
    _, marker, effects = SYSTEMS[system]
    torch.manual_seed(0)
    if model == "stack":
        module: torch.nn.Module = Stack(n, marker, effects)
        x = torch.randn(BATCH, SEQ, WIDTH, generator=torch.Generator().manual_seed(1))
        return module, lambda f: f(x).pow(2).mean()
    import transformers

    from effectfx.testing import hf

    config = hf.gpt2_config()
    config.n_layer = n
    module = transformers.GPT2LMHeadModel(config)
    module.loss_type = "ForCausalLM"
    layers = module.transformer.h
    for i, layer in enumerate(layers):
        layers[i] = LAYERS[marker, effects](layer)
    ids = torch.randint(0, hf.VOCAB, (GPT2_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return module, lambda f: f(ids, labels=ids).loss


def compiled(system: str, module: torch.nn.Module) -> Callable[..., Any]:
    how = SYSTEMS[system][0]
    if how == "eager":
        return module
    if how in ("efx", "efx_hop"):
        return efx.compile(module, backend="inductor" if how == "efx" else "inductor_hop")
    return torch.compile(module, backend="inductor")


# -- the alternative: torch's Inductor lowering of invoke_subgraph ------------------------------------------
def _to_hop(gm: fx.GraphModule, memo: dict[int, fx.GraphModule]) -> fx.GraphModule:
    """A copy of a token-free graph calling torch's ``invoke_subgraph`` higher-order op (bodies recursively,
    each once).  Effects stay plain op calls: Inductor keeps them as side-effecting fallback kernels
    because ``efxbench::record`` is also in torch's effect registry (common.py)."""
    from effectfx import ops

    if id(gm) not in memo:
        graph, env, root = fx.Graph(), {}, torch.nn.Module()
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                setattr(root, node.target, _to_hop(getattr(gm, node.target), memo))
                env[node] = graph.get_attr(node.target)
            elif node.target is ops.invoke_subgraph:
                env[node] = graph.call_function(torch.ops.higher_order.invoke_subgraph,
                                                fx.map_arg(node.args, lambda n: env[n]))
            elif node.op == "output":
                graph.output(fx.map_arg(node.args[0], lambda n: env[n]))
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
        memo[id(gm)] = fx.GraphModule(root, graph)
    return memo[id(gm)]


def hop_lowering(prog: Any) -> Any:
    """Token-free Program -> one whose root is a single Inductor-compiled call of the whole graph."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import _recursive_record_user_visible_output_idxs, compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from effectfx.backends.inductor import InductorSegment, _example, _meta

    gm = prog.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    metas = tuple(_meta(n.meta["val"]) for n in placeholders)
    # as the backend does: one fake mode with a shape environment (Inductor's FX graph cache needs it);
    # the tracing context's invoke_subgraph cache makes every call site of one identifier share a body
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with tracing(TracingContext(fake_mode)), torch.no_grad():
        with fake_mode:
            examples = [_example(m) for m in metas]
        decomposed = make_fx(_to_hop(gm, {}), decomposition_table=select_decomp_table(),
                             tracing_mode="fake")(*examples)
        # as torch.compile's own path does: body outputs keep their traced strides (compile_fx.py)
        _recursive_record_user_visible_output_idxs(decomposed)
        inner = compile_fx_inner(decomposed, examples)
    whole = InductorSegment(decomposed, lambda *args: inner(list(args)), metas)  # boxed convention
    graph, holder = fx.Graph(), torch.nn.Module()
    holder.whole = whole
    call = graph.call_module("whole", tuple(graph.placeholder(n.name) for n in placeholders))
    n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    graph.output(tuple(graph.call_function(operator.getitem, (call, i)) for i in range(n_out)))
    return prog.replace(graph_module=fx.GraphModule(holder, graph))


def _register_hop_backend() -> None:
    from effectfx.functionalize import thread_tokens
    from effectfx.passes.remove_tokens import remove_effect_tokens_pass
    from effectfx.runtime.compile import BACKEND_PASSES

    BACKEND_PASSES["inductor_hop"] = [thread_tokens, remove_effect_tokens_pass, hop_lowering]


# -- one first call, in a subprocess -----------------------------------------------------------------------
def tree_cpu_s() -> float:
    """CPU seconds of this process, its finished children, and every live descendant with theirs: Inductor
    compiles C++ in worker processes (each running the compiler), which wall-clock time on a shared
    machine mixes with other users' work."""
    import resource

    total = sum(getattr(resource.getrusage(who), f) for f in ("ru_utime", "ru_stime")
                for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)], stats[int(entry)] = int(fields[1]), fields
    mine = {os.getpid()}
    for pid in sorted(parents):  # descendants: walk each chain of parents up to this process
        chain, p = [], pid
        while p in parents and p not in mine and p > 1:
            chain.append(p)
            p = parents[p]
        if p in mine:
            mine.update(chain)
    for pid in mine - {os.getpid()}:
        total += sum(int(v) for v in stats[pid][11:15]) / tick  # utime stime cutime cstime
    return total


def _warm_up() -> None:
    """The one-time costs every system pays alike (see the module docstring)."""
    torch.compile(lambda a: torch.cos(a) * 3, backend="inductor")(torch.randn(5))
    efx.compile(lambda a: torch.sin(a) + 1, backend="inductor")(torch.randn(3))
    torch._dynamo.reset()
    LOG.clear()
    common.freeze_heap()


def _check(model: str, n: int, system: str, module: torch.nn.Module, loss: torch.Tensor) -> dict[str, Any]:
    """The loss and every parameter's gradient against eager's (the same model without a compiler)."""
    reference, loss_of = build(model, n, "eager" if SYSTEMS[system][2] else "eager_pure")
    want = loss_of(reference)
    want.backward()
    grads = dict(reference.named_parameters())
    diffs = [float((loss.detach() - want.detach()).abs())]
    for name, p in module.named_parameters():
        ref = grads[name].grad
        if ref is not None:  # a missing gradient is infinitely wrong
            diffs.append(float((p.grad - ref).abs().max() / (ref.abs().max() + 1e-12)) if p.grad is not None
                         else float("inf"))
    return {"max_rel_diff": max(diffs), "ok": max(diffs) < 1e-3}


def first_call(model: str, n: int, system: str) -> dict[str, Any]:
    """Measure one first call in this process (a subprocess of the benchmark: see ``--child``)."""
    torch.set_num_threads(1)
    _register_hop_backend()
    start = time.perf_counter()
    _warm_up()
    warmup_s = time.perf_counter() - start
    module, loss_of = build(model, n, system)
    f = compiled(system, module)
    gc.collect()
    cpu, wall = tree_cpu_s(), time.perf_counter()
    try:
        loss = loss_of(f)
        loss.backward()
    except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
        return {"status": f"{type(e).__name__}: {str(e)[:300]}", "warmup_s": warmup_s}
    wall = time.perf_counter() - wall
    cpu = tree_cpu_s() - cpu
    effects = len(LOG)
    result = {"status": "ok", "wall_s": wall, "cpu_s": cpu, "warmup_s": warmup_s, "effects": effects,
              "effects_expected": n if SYSTEMS[system][2] else 0}
    result.update(_check(model, n, system, module, loss))
    if system == "efx":
        from effectfx.backends import inductor

        result["segments_compiled"] = inductor.STATS.compiles - 1  # minus the warm-up's
    return result


def _child(spec: dict[str, Any], cache_dir: str) -> dict[str, Any]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=3600)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"status": f"child failed (exit {proc.returncode}): {proc.stderr[-500:]}"}


# -- steady state, in one process ---------------------------------------------------------------------------
def steady_state(model: str, n: int, budget_s: float) -> dict[str, Any]:
    """Training step of every system, interleaved in shuffled order; medians (ms)."""
    torch.set_num_threads(1)
    _register_hop_backend()
    steps: dict[str, Callable[[], None]] = {}
    status: dict[str, str] = {}
    for system in SYSTEMS:
        module, loss_of = build(model, n, system)
        f = compiled(system, module)
        params = list(module.parameters())

        def step(f: Any = f, loss_of: Any = loss_of, params: list = params) -> None:
            loss_of(f).backward()
            for p in params:
                p.grad = None

        try:
            step()
            step()
            loss = loss_of(f)
            loss.backward()
            check = _check(model, n, system, module, loss)  # fast but wrong is not a result
            step()
        except Exception as e:  # noqa: BLE001 -- a system failing is a result, reported as such
            status[system] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        if not check["ok"]:
            status[system] = f"wrong results: max relative difference {check['max_rel_diff']:.2g} from eager"
            continue
        status[system] = "ok"
        steps[system] = step
    calls = {}
    for system, step in steps.items():  # calls per sample: at least 20 ms
        t = time.perf_counter()
        step()
        calls[system] = max(1, int(0.02 / max(time.perf_counter() - t, 1e-6)))
    common.freeze_heap()
    samples: dict[str, list[float]] = {system: [] for system in steps}
    end, rounds = time.perf_counter() + budget_s, 0
    while time.perf_counter() < end or rounds < 3:
        order = list(steps)
        random.shuffle(order)
        for system in order:
            t = time.perf_counter()
            for _ in range(calls[system]):
                steps[system]()
            samples[system].append((time.perf_counter() - t) / calls[system])
        rounds += 1
    return {"status": status, "step_ms": {k: median(v) * 1e3 for k, v in samples.items()}, "rounds": rounds,
            "samples_ms": {k: [x * 1e3 for x in v] for k, v in samples.items()}}


# -- the whole run -------------------------------------------------------------------------------------------
def run(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    reps = reps or cfg["reps"]
    configs = cfg["configs"]
    first: dict[str, list[dict[str, Any]]] = {}
    systems = cfg["systems"]
    progress = common.Progress(reps * len(configs) * (len(systems) + len(set(WARM) & set(systems)))
                               + len(configs), NAME)
    with tempfile.TemporaryDirectory(prefix="efx-inductor-bench-") as tmp:
        for rep in range(reps):
            for model, n in configs:
                order = list(systems)
                random.Random(rep).shuffle(order)  # no system always runs first (or last) on a busy machine
                for system in order:
                    cache = tempfile.mkdtemp(dir=tmp)
                    spec = {"mode": "first", "model": model, "n": n, "system": system}
                    for kind in ("fresh", "warm") if system in WARM else ("fresh",):
                        key = f"{model}/{n}/{system}/{kind}"
                        first.setdefault(key, []).append(_child(spec, cache))
                        progress.step(key)
        steady = {}
        for model, n in configs:
            steady[f"{model}/{n}"] = _child({"mode": "steady", "model": model, "n": n,
                                              "budget_s": cfg["budget_s"]}, tempfile.mkdtemp(dir=tmp))
            progress.step(f"{model}/{n} steady state")
    data = {"machine": common.machine_info(),
            "config": {"quick": quick, "reps": reps, "configs": configs, "budget_s": cfg["budget_s"],
                       "systems": {k: SYSTEMS[k] for k in systems},
                       "stack": {"width": WIDTH, "batch": BATCH, "seq": SEQ},
                       "gpt2": {"layers": GPT2_LAYERS, "batch": GPT2_BATCH, "seq": SEQ}},
            "first_call": first, "steady_state": steady}
    data["summary"] = summarize(data)
    return data


def _median_of(runs: list[dict[str, Any]], field: str) -> float | None:
    values = [r[field] for r in runs if r.get("status") == "ok"]
    return median(values) if values else None


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Per configuration: effectfx's first call (fresh, warm) and step, and its ratios to the others.
    Where torch.compile failed on the effectful model, its effect-free run stands in (``*_used`` says)."""
    first, steady = data["first_call"], data["steady_state"]
    wall = {k: _median_of(v, "wall_s") for k, v in first.items()}
    cpu = {k: _median_of(v, "cpu_s") for k, v in first.items()}
    out: dict[str, Any] = {"first_call_s": wall, "first_call_cpu_s": cpu,
                           "warmup_s": median([r["warmup_s"] for v in first.values() for r in v
                                               if "warmup_s" in r])}
    for tag, st in steady.items():
        ms = st.get("step_ms", {})
        s: dict[str, Any] = {"efx_first_s": wall.get(f"{tag}/efx/fresh"),
                             "efx_first_cpu_s": cpu.get(f"{tag}/efx/fresh"),
                             "efx_warm_s": wall.get(f"{tag}/efx/warm"),
                             "efx_warm_cpu_s": cpu.get(f"{tag}/efx/warm")}
        for other in ("tc", "tc_ncr", "efx_hop"):
            used = other if wall.get(f"{tag}/{other}/fresh") is not None else f"{other}_pure"
            s[f"first_{other}_used"] = used
            s[f"first_{other}_over_efx"] = _div(wall.get(f"{tag}/{used}/fresh"), s["efx_first_s"])
            s[f"first_{other}_over_efx_cpu"] = _div(cpu.get(f"{tag}/{used}/fresh"), s["efx_first_cpu_s"])
            used = other if other in ms else f"{other}_pure"
            s[f"step_{other}_used"] = used
            s[f"step_efx_over_{other}"] = _div(ms.get("efx"), ms.get(used))
        s["step_efx_over_eager"] = _div(ms.get("efx"), ms.get("eager"))
        s["step_tc_over_eager"] = _div(ms.get(s["step_tc_used"]), ms.get("eager"))
        out[tag] = s
    out["efx_growth_stack_2_to_16"] = _div(wall.get("stack/16/efx/fresh"), wall.get("stack/2/efx/fresh"))
    out["efx_growth_stack_2_to_16_cpu"] = _div(cpu.get("stack/16/efx/fresh"), cpu.get("stack/2/efx/fresh"))
    return out


def _f(v: float | None, unit: str = "", digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}{unit}"


def table(data: dict[str, Any]) -> str:
    summary, first = data["summary"], data["first_call"]
    rows = []
    for key in sorted(first):
        runs = first[key]
        bad = [r["status"] for r in runs if r.get("status") != "ok"]
        ok = [r for r in runs if r.get("status") == "ok"]
        checks = "-" if not ok else "same" if all(
            r["ok"] and r["effects"] == r["effects_expected"] for r in ok) else "MISMATCH"
        rows.append([key, _f(summary["first_call_s"][key], " s"), _f(summary["first_call_cpu_s"][key], " s"),
                     f"{len(ok)}/{len(runs)}", checks, bad[0][:70] if bad else ""])
    warm = _f(summary["warmup_s"], " s")
    text = [f"first call: median wall and CPU (process tree); one-time warm-up apart, median {warm}",
            common.format_table(["model/N/system/cache", "wall", "cpu", "ok", "vs eager", "failure"], rows)]
    rows = []
    for tag, st in data["steady_state"].items():
        ms = st.get("step_ms", {})
        rows.append([tag, *[_f(ms.get(k), "") for k in SYSTEMS]])
        for k, v in st.get("status", {}).items():
            if v != "ok":
                text_fail = f"  {tag} {k}: {v[:100]}"
                rows.append([text_fail, *[""] * len(SYSTEMS)])
    text += ["", "training step, median ms (interleaved)", common.format_table(["model/N", *SYSTEMS], rows)]
    rows = []
    for tag in data["steady_state"]:
        s = summary[tag]
        rows.append([tag, _f(s["efx_first_s"], " s"), _f(s["efx_warm_s"], " s"),
                     *[f"{_f(s[f'first_{o}_over_efx'], 'x')} / {_f(s[f'first_{o}_over_efx_cpu'], 'x')}"
                       + ("*" if s[f"first_{o}_used"] != o else "") for o in ("tc_ncr", "tc", "efx_hop")],
                     _f(s["step_efx_over_eager"], "x"),
                     _f(s["step_efx_over_tc"], "x") + ("*" if s["step_tc_used"] != "tc" else ""),
                     _f(s["step_efx_over_efx_hop"], "x")])
    text += ["", "ratios (first call: other / effectfx, wall / CPU; step: effectfx / other; "
             "* = torch.compile failed with effects, its effect-free run stands in)",
             common.format_table(["model/N", "efx first", "efx warm", "tc_ncr/efx", "tc/efx", "efx_hop/efx",
                                  "step efx/eager", "step efx/tc", "step efx/efx_hop"], rows),
             f"effectfx first-call growth, stack N=2 -> 16: {_f(summary['efx_growth_stack_2_to_16'], 'x')} "
             f"wall, {_f(summary['efx_growth_stack_2_to_16_cpu'], 'x')} CPU"]
    return "\n".join(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="stack N=2 only, one repetition, short budget")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of every first call")
    parser.add_argument("--out", type=Path, default=None,
                        help="where inductor.json goes (default: results/, or results/quick/ with --quick)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        if spec["mode"] == "first":
            result = first_call(spec["model"], spec["n"], spec["system"])
        else:
            result = steady_state(spec["model"], spec["n"], spec["budget_s"])
        print(json.dumps(result, default=str))
        return 0
    data = run(args.quick, args.reps)
    path = common.write_json(data, common.output_dir(args.out, args.quick), NAME)
    print(table(data))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
