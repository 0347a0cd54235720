"""What an explanation holds, and how it reads: the report's dataclasses and their text.

The facts are gathered by :mod:`effectfx.explanation.gather`; this module only describes and renders
them, so it imports nothing of capture or the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class BodyReport:
    """One traced body of a region, and why it exists."""

    identifier: str
    region: str
    calls: int
    trace_seconds: float
    reason: str
    differences: tuple[str, ...] = ()
    compared_with: str | None = None
    forward_effects: tuple[str, ...] | None = None
    backward_effects: tuple[str, ...] | None = None
    forward_nodes: int | None = None
    backward_nodes: int | None = None
    # when only the reads differ (not the key): the type names of the values the two bodies read
    # differently ("str" for a label whose value the body used, "int" for a layer index, ...)
    read_types: tuple[str, ...] = ()
    unshared: str = ""  # why a call whose tensors need no gradient could not share the region's body

    @property
    def new(self) -> bool:
        """Whether this body exists because an earlier body of its region did not fit."""
        return self.compared_with is not None


@dataclass(frozen=True)
class RegionReport:
    name: str
    bodies: tuple[BodyReport, ...]

    @property
    def calls(self) -> int:
        return sum(b.calls for b in self.bodies)

    @property
    def effects(self) -> tuple[str, ...]:
        keys = {k for b in self.bodies for k in (*(b.forward_effects or ()), *(b.backward_effects or ()))}
        return tuple(sorted(keys))

    @property
    def forward_effects(self) -> tuple[str, ...]:
        return tuple(sorted({k for b in self.bodies for k in (b.forward_effects or ())}))

    @property
    def backward_effects(self) -> tuple[str, ...]:
        return tuple(sorted({k for b in self.bodies for k in (b.backward_effects or ())}))


@dataclass(frozen=True)
class GraphSize:
    program: str  # "forward", "backward" or "program"
    graph: str  # "root" or the subgraph's attribute name
    identifier: str | None
    nodes: int
    ops: int  # call_function nodes other than getitem
    effects: int  # effectful op calls (wrapped or not)
    region_calls: int


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: float
    program: str  # which half ran the stage ("forward", "backward", or "" when both or the whole)


@dataclass(frozen=True)
class SegmentReport:
    """One Inductor segment (or one variant of a symbolic one) and its compile, from its first run."""

    name: str  # its attribute: "segment_0", "segment_0 variant 2"
    nodes: int
    outcome: str | None  # "compiled", "loaded", "cache hit", "fell back", "deferred"; None: not run yet
    seconds: float
    why: str | None = None  # why it fell back


@dataclass(frozen=True)
class SegmentGraph:
    """The Inductor segments of one graph of a program (its root, or a region body)."""

    program: str  # "forward", "backward", "program", "backward of outputs [0]"
    graph: str  # "root" or the subgraph's attribute name
    identifier: str | None
    region: str | None
    segments: tuple[SegmentReport, ...]

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.segments)


@dataclass(frozen=True)
class ProgramReport:
    """One program (one capture, or one compiled signature)."""

    title: str
    training: bool
    form: str
    inputs: str
    token_keys: tuple[str, ...]
    regions: tuple[RegionReport, ...]
    graphs: tuple[GraphSize, ...]
    stages: tuple[Stage, ...]
    why: str | None = None  # compiled callables: why this signature was compiled
    why_differences: tuple[str, ...] = ()
    compile_seconds: float | None = None
    # Note [Symbolic shapes]: the inputs with symbolic sizes, the guards on them, the ops that pinned one
    symbolic: tuple[str, ...] = ()
    shape_guards: tuple[str, ...] = ()
    specialized: tuple[str, ...] = ()
    segments: tuple[SegmentGraph, ...] = ()  # backend="inductor": the compiled segments of each graph
    tier: str | None = None  # backend="inductor": which tier runs, and tier 2's build (backends.tiers)

    @property
    def bodies(self) -> tuple[BodyReport, ...]:
        bodies = (b for r in self.regions for b in r.bodies)
        return tuple(sorted(bodies, key=lambda b: ident_order(b.identifier)))

    @property
    def total_seconds(self) -> float:
        return sum(s.seconds for s in self.stages)


@dataclass(frozen=True)
class Explanation:
    """What :func:`effectfx.explain` found; ``str()`` is the readable report."""

    target: str
    programs: tuple[ProgramReport, ...]
    compiled: bool = False
    compiles: int | None = None
    calls: int | None = None
    notes: tuple[str, ...] = field(default=())

    # convenient views over every program
    @property
    def bodies(self) -> tuple[BodyReport, ...]:
        return tuple(b for p in self.programs for b in p.bodies)

    @property
    def regions(self) -> dict[str, RegionReport]:
        """Region reports by name (of the first program that has each region)."""
        out: dict[str, RegionReport] = {}
        for p in self.programs:
            for r in p.regions:
                out.setdefault(r.name, r)
        return out

    @property
    def reasons(self) -> dict[str, str]:
        """``{identifier: why that body was traced}`` of the first program."""
        return {b.identifier: b.reason for b in self.programs[0].bodies} if self.programs else {}

    def region_effects(self) -> dict[str, tuple[str, ...]]:
        return {name: r.effects for name, r in self.regions.items()}

    def __str__(self) -> str:
        return render(self)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython
        p.text(str(self))


def ident_order(identifier: str) -> tuple[int, str]:
    """``subgraph_2`` before ``subgraph_10``: identifiers in the order they were traced."""
    tail = identifier.rsplit("_", 1)[-1]
    return (int(tail), identifier) if tail.isdigit() else (1 << 30, identifier)


# -- text ------------------------------------------------------------------------------------------------

_PLURALS = {"body": "bodies"}


def count(n: int, noun: str) -> str:
    """``1 body``, ``2 bodies``, ``0 calls``."""
    return f"{n} {noun if n == 1 else _PLURALS.get(noun, noun + 's')}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _keys(keys: tuple[str, ...] | None) -> str:
    if keys is None:
        return "?"
    return ", ".join(keys) if keys else "-"


def _table(rows: Sequence[Sequence[str]], right: Sequence[bool], indent: str) -> list[str]:
    """Rows as lines with every column as wide as its widest cell (numbers right-aligned)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    cells = ((c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(r, widths, right)) for r in rows)
    return [(indent + "  ".join(line)).rstrip() for line in cells]


def _render_regions(p: ProgramReport, lines: list[str], indent: str) -> None:
    n_bodies = sum(len(r.bodies) for r in p.regions)
    n_calls = sum(r.calls for r in p.regions)
    lines.append(f"{indent}  regions: {count(len(p.regions), 'region')}, {count(n_bodies, 'body')}, "
                 f"{count(n_calls, 'call')}")
    if not p.regions:
        lines.append(f"{indent}    (none: mark a repeated function or module method with @efx.region)")
    for r in p.regions:
        effects = f"effects: {_keys(r.forward_effects)}"
        if p.training:
            effects = (f"forward effects: {_keys(r.forward_effects)}; "
                       f"backward effects: {_keys(r.backward_effects)}")
        lines.append(f"{indent}    {r.name}: {count(len(r.bodies), 'body')}, {count(r.calls, 'call')}; "
                     f"{effects}")
        for b in r.bodies:
            size = f"{b.forward_nodes if b.forward_nodes is not None else '?'} nodes"
            eff = f"effects {_keys(b.forward_effects)}"
            if p.training and b.backward_nodes is None:
                size += " (no backward: its inputs need no grad)"
            elif p.training:
                size = f"forward {size} / backward {b.backward_nodes} nodes"
                eff += f" | backward {_keys(b.backward_effects)}"
            lines.append(f"{indent}      {b.identifier}: {count(b.calls, 'call')}, traced in "
                         f"{_ms(b.trace_seconds)}, {size}, {eff}")
            lines.append(f"{indent}        why: {b.reason}")


def _render_segments(p: ProgramReport, lines: list[str], indent: str) -> None:
    """Compile time per graph and segment (backend="inductor"): where a long first call went."""
    every = [s for g in p.segments for s in g.segments]
    ran = [s for s in every if s.outcome is not None]
    total = sum(s.seconds for s in every)
    lines.append(f"{indent}  Inductor compile time per segment: {count(len(every), 'segment')}, "
                 f"{len(ran)} run, {total:.2f} s")
    rows = [["graph", "segment", "nodes", "outcome", "seconds", ""]]
    for g in p.segments:
        where = f"{g.program} {g.graph}" if p.training else g.graph  # as the graphs table names it
        rows.append([where, count(len(g.segments), "segment"), "", "", f"{g.seconds:.2f} s", ""])
        for s in g.segments:
            seconds = f"{s.seconds:.2f} s" if s.outcome is not None else "-"
            rows.append(["", s.name, str(s.nodes), s.outcome or "not run yet", seconds, s.why or ""])
    lines.extend(_table(rows, [False, False, True, False, True, False], f"{indent}    "))


def _render_program(p: ProgramReport, lines: list[str], indent: str = "") -> None:
    kind = "training program (forward + backward)" if p.training else "program"
    lines.append(f"{indent}{p.title}: {kind}, {p.form} form")
    if p.compile_seconds is not None:
        lines.append(f"{indent}  compiled in {_ms(p.compile_seconds)}; why: {p.why}")
    if p.tier is not None:
        lines.append(f"{indent}  runs {p.tier}")
    lines.append(f"{indent}  inputs: {p.inputs}")
    if p.symbolic:
        lines.append(f"{indent}  symbolic sizes: {', '.join(p.symbolic)}")
        lines.append(f"{indent}  shape guards: {' and '.join(p.shape_guards) or '(none)'}")
    for text in p.specialized:
        lines.append(f"{indent}  specialized: {text}")
    if p.token_keys:
        lines.append(f"{indent}  tokens at the root: {', '.join(p.token_keys)}")
    _render_regions(p, lines, indent)
    lines.append(f"{indent}  graphs:")
    half = ["half"] if p.training else []  # training programs: forward and backward graphs
    rows = [[*half, "graph", "nodes", "ops", "effects", "region calls", "region"]]
    rows += [[*([g.program] if half else []), g.graph, str(g.nodes), str(g.ops), str(g.effects),
              str(g.region_calls), g.identifier or ""] for g in p.graphs]
    lines.extend(_table(rows, [False] * len(half) + [False, True, True, True, True, False], f"{indent}    "))
    lines.append(f"{indent}  time per stage:")
    rows = [[s.name + (f" ({s.program})" if s.program else ""), _ms(s.seconds)] for s in p.stages]
    lines.extend(_table([*rows, ["total", _ms(p.total_seconds)]], [False, True], f"{indent}    "))
    if p.segments:
        _render_segments(p, lines, indent)


def render(e: Explanation) -> str:
    """The readable report (``str(explanation)``)."""
    lines = [f"effectfx explain: {e.target}"]
    if e.compiled:
        lines.append(f"  {count(e.compiles or 0, 'compiled signature')}, {count(e.calls or 0, 'call')} "
                     "so far")
        if not e.programs:
            lines.append("  nothing compiled yet: call it once, or pass example arguments to explain")
    for p in e.programs:
        lines.append("")
        _render_program(p, lines)
    if e.notes:
        lines.append("")
        lines.append("notes:")
        lines.extend(f"  - {n}" for n in e.notes)
    return "\n".join(lines)


__all__ = ["BodyReport", "Explanation", "GraphSize", "ProgramReport", "RegionReport", "SegmentGraph",
           "SegmentReport", "Stage", "count",
           "ident_order", "render"]
