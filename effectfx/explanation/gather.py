"""``efx.explain``: what a capture made, and why -- the report to read when something is slow or surprising.

``efx.explain(fn, *args, **kwargs)`` captures ``fn`` (like ``efx.capture``) and reports:

* the regions found, how many bodies each got, and **why each new body was traced**: its region-cache key
  (Note [Region identity]) is compared part by part with the closest earlier body of the same region,
  and the differing parts are named (``argument 'n': 2 -> 3``, ``x: requires_grad False -> True``);
* the effect keys of each region (forward and backward);
* the size of every graph (nodes, ops, effects);
* the time spent per stage (capture and each pass).

It also takes an ``efx.compile``d callable: each cached program is explained, with why its signature was
compiled (which part of the compile key differed from the closest earlier signature).  With arguments,
the callable first compiles them (without running anything).  A ``Program`` or ``TrainingProgram`` can be
passed directly too.

This module gathers the facts into the dataclasses of :mod:`effectfx.explanation.report`, which also
renders them (``str(explanation)``).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_unflatten

from .. import ops
from ..backends.inductor_segments import segments_of
from ..capture.arguments import leaf_names
from ..drivers.callable import CompiledCallable
from ..drivers.capture import capture
from ..drivers.entry import CompiledEntry
from ..effects import effect_of, implicit_effects
from ..graph.walk import region_call, subgraphs
from ..guards.words import body_differences, key_differences, part_differences
from ..program.program import Program
from ..program.records import BodyInfo
from ..program.training import TrainingProgram
from .report import (
    BodyReport,
    Explanation,
    GraphSize,
    ProgramReport,
    RegionReport,
    SegmentGraph,
    SegmentReport,
    Stage,
    ident_order,
)

NOTES = "Note [Region identity] in effectfx/notes.py"


def _closest(candidates: Sequence[Any], diff: Callable[[Any], list[str]]) -> tuple[Any, list[str]] | None:
    best = None
    for cand in candidates:
        d = diff(cand)
        if best is None or len(d) < len(best[1]):
            best = (cand, d)
    return best


def _graph_size(program: str, graph: str, identifier: str | None, gm: fx.GraphModule) -> GraphSize:
    nodes = ops_ = effects = calls = 0
    for node in gm.graph.nodes:
        nodes += 1
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        ops_ += 1
        target = node.target
        if region_call(node) is not None:
            calls += 1
        elif target is ops.with_effects or (isinstance(target, torch._ops.OpOverload)
                                            and effect_of(target) is not None):
            effects += 1
    return GraphSize(program, graph, identifier, nodes, ops_, effects, calls)


def _segment_graphs(prog: Program | TrainingProgram) -> tuple[SegmentGraph, ...]:
    """The Inductor segments of each graph (root, then each body) of the program and of the partial
    backwards traced for it, with what their first runs recorded; none for other backends."""
    programs = _halves(prog)
    if isinstance(prog, TrainingProgram):
        programs += [(f"backward of outputs {[i for i, m in enumerate(live) if m]}", part)
                     for live, (part, _) in prog.partial.items()]
    out = []
    for half, p in programs:
        graphs = [("root", None, p.graph_module), *subgraphs(p.graph_module)]
        for attr, identifier, gm in graphs:
            found = segments_of(gm)
            region = p.regions[identifier].name if identifier in p.regions else None
            if found:
                out.append(SegmentGraph(half, attr, identifier, region, tuple(
                    SegmentReport(name, s.nodes, s.outcome, s.compile_seconds, s.why) for name, s in found)))
    return tuple(out)


def _halves(prog: Program | TrainingProgram) -> list[tuple[str, Program]]:
    if isinstance(prog, TrainingProgram):
        return [("forward", prog.forward), ("backward", prog.backward)]
    return [("program", prog)]


def _describe_inputs(prog: Program, fn: Any) -> str:
    sig = prog.signature
    try:
        n_leaves = sig.spec.num_leaves
        names = _leaf_names(fn, sig.spec, n_leaves)
    except Exception:  # noqa: BLE001 - names are a nicety
        names = []
    metas = dict(sig.tensor_meta)
    consts = dict(sig.constants)
    parts = []
    for i in sorted({*metas, *consts}):
        name = names[i] if i < len(names) else f"arg{i}"
        if i in metas:
            parts.append(f"{name}: {metas[i].short()}")
        else:
            parts.append(f"{name}={consts[i]!r}")
    return ", ".join(parts) or "(no arguments)"


def _leaf_names(fn: Any, spec: Any, n_leaves: int) -> list[str]:
    """Names of the leaves of ``(args, kwargs)`` shaped like ``spec``, from ``fn``'s signature."""
    args, kwargs = tree_unflatten(list(range(n_leaves)), spec)
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    return leaf_names(target, args, kwargs, nested="{base}[{rest}]")


def _read_types(old: BodyInfo, new: BodyInfo) -> tuple[str, ...]:
    """Type names of the values two bodies with the same key read differently (their guards)."""
    if key_differences(old.key, new.key, old.key_labels, new.key_labels):
        return ()
    a, b = {g.path: g for g in old.guards}, {g.path: g for g in new.guards}
    types = []
    for path in a.keys() & b.keys():
        if a[path] == b[path]:
            continue
        types.extend(t for t in (a[path].value_type(), b[path].value_type()) if t is not None)
    return tuple(sorted(set(types)))


def _body_reports(prog: Program | TrainingProgram,
                  sizes: dict[tuple[str, str], int]) -> tuple[RegionReport, ...]:
    halves = dict(_halves(prog))
    first = next(iter(halves.values()))
    bodies: tuple[BodyInfo, ...] = first.bodies
    fwd = halves.get("forward", halves.get("program"))
    bwd = halves.get("backward")

    def effects(p: Program | None, ident: str) -> tuple[str, ...] | None:
        if p is None or ident not in p.regions or p.regions[ident].effects is None:
            return None
        return tuple(sorted(p.regions[ident].effects))

    by_region: dict[str, list[BodyReport]] = {}
    seen: dict[str, list[BodyInfo]] = {}
    for info in sorted(bodies, key=lambda b: ident_order(b.identifier)):
        earlier = seen.setdefault(info.region, [])
        read_types: tuple[str, ...] = ()
        if not earlier:
            reason, diffs, compared = f"first body of region '{info.region}'", [], None
        else:
            best = _closest(earlier, lambda e, info=info: body_differences(
                e.key, e.guards, info.key, info.guards, e.key_labels, info.key_labels))
            assert best is not None
            other, diffs = best
            compared = other.identifier
            read_types = _read_types(other, info)
            if not diffs:
                diffs = ["same cache key as " + other.identifier + ": two different regions share the name "
                         f"'{info.region}' (defined twice?)"]
            reason = "; ".join(diffs) + f" (vs {other.identifier})"
        earlier.append(info)
        report = BodyReport(
            info.identifier, info.region, info.calls, info.trace_seconds, reason, tuple(diffs), compared,
            effects(fwd, info.identifier), effects(bwd, info.identifier),
            sizes.get(("forward" if bwd is not None else "program", info.identifier)),
            sizes.get(("backward", info.identifier)) if bwd is not None else None, read_types,
            info.unshared,
        )
        by_region.setdefault(info.region, []).append(report)
    # regions known to the program but without body info (e.g. a program made by an older capture)
    known = {b.identifier for bs in by_region.values() for b in bs}
    for ident, entry in (fwd.regions if fwd is not None else {}).items():
        if ident not in known:
            by_region.setdefault(entry.name, []).append(BodyReport(
                ident, entry.name, 0, 0.0, "no body information recorded", (), None,
                effects(fwd, ident), effects(bwd, ident),
                sizes.get(("forward" if bwd is not None else "program", ident)), None))
    return tuple(RegionReport(name, tuple(reports)) for name, reports in by_region.items())


def _program_report(prog: Program | TrainingProgram, title: str, fn: Any, why: str | None = None,
                    why_differences: Sequence[str] = (),
                    compile_seconds: float | None = None) -> ProgramReport:
    graphs: list[GraphSize] = []
    sizes: dict[tuple[str, str], int] = {}
    for half, p in _halves(prog):
        graphs.append(_graph_size(half, "root", None, p.graph_module))
        for attr, identifier, gm in subgraphs(p.graph_module):
            g = _graph_size(half, attr, identifier, gm)
            graphs.append(g)
            sizes.setdefault((half, identifier), g.nodes)
    stages: list[Stage] = []
    halves = _halves(prog)
    shared = 0
    if len(halves) == 2:  # both halves carry the joint capture's record; count it once
        fh, bh = halves[0][1].history, halves[1][1].history
        while shared < min(len(fh), len(bh)) and fh[shared] == bh[shared]:
            stages.append(Stage(fh[shared].name, fh[shared].seconds, ""))
            shared += 1
    for half, p in halves:
        for record in p.history[shared:]:
            stages.append(Stage(record.name, record.seconds, half if len(halves) == 2 else ""))
    first = halves[0][1]
    symbolic, guards, _ = _shapes(first, fn)
    return ProgramReport(
        title=title, training=isinstance(prog, TrainingProgram), form=first.form,
        inputs=_describe_inputs(first, fn), token_keys=tuple(first.token_keys),
        regions=_body_reports(prog, sizes), graphs=tuple(graphs), stages=tuple(stages), why=why,
        why_differences=tuple(why_differences), compile_seconds=compile_seconds,
        symbolic=symbolic, shape_guards=guards, specialized=first.specialized, segments=_segment_graphs(prog),
    )


def _shapes(prog: Program, fn: Any) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
    """The inputs with symbolic sizes, the shape guards spelled with the inputs' names, and those names."""
    sig = prog.signature
    try:
        names = _leaf_names(fn, sig.spec, sig.spec.num_leaves)
    except Exception:  # noqa: BLE001 - names are a nicety
        names = [f"arg{i}" for i in range(sig.spec.num_leaves)]
    tensor_names = [names[i] if i < len(names) else f"arg{i}" for i, _ in sig.tensor_meta]
    symbolic = tuple(f"{name} {m.short()}" for name, (_, m) in zip(tensor_names, sig.tensor_meta)
                     if m.symbolic)
    return symbolic, tuple(sig.guard_text(g, tensor_names) for g in sig.shape_guards), tensor_names


def _signature_labels(cc: CompiledCallable, entry: CompiledEntry) -> tuple[str, ...]:
    sig = entry.forward.signature
    try:
        names = _leaf_names(cc.fn, sig.spec, sig.spec.num_leaves)
    except Exception:  # noqa: BLE001
        names = [f"arg{i}" for i in range(sig.spec.num_leaves)]
    return ("ambient", "argument structure", *names, "closure and globals")


def _compiled_reports(cc: CompiledCallable) -> list[ProgramReport]:
    entries: list[tuple[tuple, CompiledEntry]] = [(key, e) for key, es in cc.cache.items() for e in es]
    # compile order: CompiledEntry has no timestamp; programs keep their capture order by insertion
    reports = []
    done: list[tuple[tuple, CompiledEntry, tuple[str, ...]]] = []
    name = getattr(cc.fn, "__name__", type(cc.fn).__name__)
    for n, (key, entry) in enumerate(entries, 1):
        labels = _signature_labels(cc, entry)
        if not done:
            why, diffs = "first call", []
        elif entry.why and any(okey == key for okey, _, _ in done):
            diffs = list(entry.why)
            other_n = next(i for i, (okey, _, _) in enumerate(done, 1) if okey == key)
            why = "; ".join(diffs) + f" (vs signature {other_n}: a value its capture read changed)"
        elif entry.why_shapes:  # symbolic programs serve these sizes, but a shape guard of each failed
            diffs, parts = [], []
            for other, failed in entry.why_shapes:
                sig = other.forward.signature
                names = _shapes(other.forward, cc.fn)[2]
                texts = [sig.guard_text(text, names) for text in failed]
                other_n = next(i for i, (_, e, _) in enumerate(done, 1) if e is other)
                diffs += texts
                parts.append("; ".join(texts) + f" (vs signature {other_n}: a guard of its symbolic sizes)")
            why = "; ".join(parts)
        else:
            def diff(item: tuple, key: tuple = key, labels: tuple = labels) -> list[str]:
                okey, _, olabels = item
                if len(okey) != len(key) or olabels != labels:
                    return key_differences(okey[:2], key[:2], olabels[:2], labels[:2]) or [
                        f"argument structure: ({', '.join(olabels[2:-1])}) -> ({', '.join(labels[2:-1])})"]
                out = []
                for label, x, y in zip(labels, okey, key):
                    out.extend(part_differences(label, x, y))
                return out

            best = _closest(done, diff)
            assert best is not None
            (_, other, _), diffs = best
            other_n = next(i for i, (_, e, _) in enumerate(done, 1) if e is other)
            if not diffs:
                diffs = ["a tensor the function reads by identity (a parameter or global) changed "
                         "requires_grad"]
            why = "; ".join(diffs) + f" (vs signature {other_n})"
        if entry.why_dynamic:
            why = f"{why}; symbolic sizes ({entry.why_dynamic})"
        done.append((key, entry, labels))
        report = _program_report(entry.program, f"{name}, signature {n} of {len(entries)}", cc.fn, why,
                                 diffs, entry.compile_seconds)
        tiers = entry.tiers
        reports.append(report if tiers is None else dataclasses.replace(report, tier=tiers.describe()))
    return reports


def _body_hint(new: Sequence[BodyReport], labels: Sequence[str]) -> str:
    """What to do about a region's extra bodies, from what made them differ."""
    differences = [d for b in new for d in b.differences]
    read_types = {t for b in new for t in b.read_types}
    if any(lbl.startswith("argument '") for lbl in labels):
        return (" Each value of a non-tensor argument gets its own body; pass values that vary as tensors to "
                "share one body.")
    if any("requires_grad" in d for d in differences):
        unshared = next((b.unshared for b in new if b.unshared), "")
        if unshared:
            return (" A call whose tensor arguments need no gradient shares the body of calls whose do when "
                    f"that body can serve it; this one cannot: {unshared} ({NOTES}).")
        return " A call in which no tensor requires grad gets a body of its own, without a backward."
    if any("shape" in d for d in differences):
        return " Each input shape gets its own body."
    if "str" in read_types:
        return (" The bodies differ only in a string the region reads. A string it only passes to effectful "
                "ops becomes an operand (one body serves every value); this body used the value otherwise "
                "(a comparison, formatting, a method such as .upper(), a non-effect op), so each value got "
                "its own body. Pass the string to the effect op as it is, or do the string work outside the "
                f"region ({NOTES}).")
    if read_types:
        return (" The bodies differ only in a value the region's code reads from an attribute or global; "
                "numbers and bools always specialize a body. Stop reading it inside the region, or pass it "
                f"as a tensor, to share one body ({NOTES}).")
    return ""


def _notes(programs: Sequence[ProgramReport], compiled: CompiledCallable | None) -> list[str]:
    notes = []
    for p in programs:
        for r in p.regions:
            new = [b for b in r.bodies if b.new]
            if not new:
                continue
            labels = sorted({d.split(":", 1)[0] for b in new for d in b.differences})
            notes.append(f"{p.title}: region '{r.name}' got {len(r.bodies)} bodies for {r.calls} calls "
                         f"(differing: {', '.join(labels)}).{_body_hint(new, labels)}")
        for r in p.regions:
            if r.calls == 1 and len(r.bodies) == 1:
                notes.append(f"{p.title}: region '{r.name}' is called once; a region saves tracing only "
                             "when its body is reused.")
    if any(g.effects for p in programs for g in p.graphs):
        # custom ops kept as effects only by their schema (effects.effect_of); the registry answers per op,
        # not per program, so these are the ones seen in this process
        for qualname in implicit_effects():
            notes.append(f"op '{qualname}' is treated as an ordered effect (key 'ordered') because it "
                         "returns nothing and mutates nothing, so it exists only for its side effect; "
                         f"register it with efx.register_effect('{qualname}', key=...) to choose its key.")
    slow = [s for p in programs for s in p.stages if s.name == "capture" and s.seconds > 1.0]
    if slow:
        notes.append(f"capture took {slow[0].seconds:.1f} s. The first capture in a process also pays "
                     "one-time imports (FakeTensorMode loads torch._dynamo, seconds on a cold start); a "
                     "second capture shows the steady cost.")
    if compiled is not None and compiled.stats.compiles > 1:
        notes.append(f"compiled {compiled.stats.compiles} signatures in "
                     f"{sum(compiled.stats.compile_seconds) * 1e3:.1f} ms; each new signature (see 'why') "
                     "captures again.")
    return list(dict.fromkeys(notes))


def explain(fn_or_compiled: Any, *args: Any, **kwargs: Any) -> Explanation:
    """Explain what effectfx makes of ``fn(*args, **kwargs)`` (see the module docstring)."""
    target = fn_or_compiled
    module = getattr(target, "_orig_mod", None)
    if isinstance(module, torch.nn.Module) and isinstance(getattr(target, "compiled", None),
                                                          CompiledCallable):
        target = target.compiled  # a compiled module (efx.compile(model)): its callable
    if isinstance(target, CompiledCallable):
        if args or kwargs:
            target.entry_for(args, kwargs)  # compile these arguments' signature; runs nothing
        programs = _compiled_reports(target)
        fn = module if isinstance(module, torch.nn.Module) else target.fn
        name = getattr(fn, "__name__", type(fn).__name__)
        return Explanation(f"efx.compile({name})", tuple(programs), True, target.stats.compiles,
                           target.stats.calls, tuple(_notes(programs, target)))
    if isinstance(target, (Program, TrainingProgram)):
        name = target.forward.name if isinstance(target, TrainingProgram) else target.name
        report = _program_report(target, name, None)
        return Explanation(name, (report,), notes=tuple(_notes([report], None)))
    if not callable(target):
        raise TypeError(f"efx.explain: expected a function, module, efx.compile'd callable or Program, "
                        f"got {type(target).__name__}")
    prog = capture(target, *args, **kwargs)
    name = getattr(target, "__name__", type(target).__name__)
    report = _program_report(prog, name, target)
    return Explanation(name, (report,), notes=tuple(_notes([report], None)))


__all__ = ["explain"]
