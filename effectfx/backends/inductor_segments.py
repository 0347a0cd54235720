"""Inductor segments: a pure piece of a token-free graph run as Inductor's compiled code, or un-compiled
(``lower_to_inductor``'s steps 2 and 3, ``effectfx.backends.inductor``; compiling and caching them is
``effectfx.backends.inductor_cache``).  A segment Inductor cannot compile runs its aten graph un-compiled,
with an :class:`InductorFallbackWarning` naming the region: never a wrong result.  A segment with symbolic
sizes runs the variant whose guards admit the call's sizes (:class:`SymbolicSegment`).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.fx as fx

from ..errors import EffectfxWarning
from . import progress
from .inductor_cache import Compiled, Meta, compiled_or_why, guards_hold, input_metas, is_cached, symbol


class InductorFallbackWarning(EffectfxWarning):
    """A pure segment Inductor could not compile runs un-compiled (correct, slower)."""


class InductorSegment(torch.nn.Module):
    """One pure segment: ``forward(*tensors)`` returns the values later nodes read (a list or tuple).

    ``compiled`` is Inductor's artifact, or None when the segment runs its aten graph (``source``).  The
    first call runs the artifact; when it holds one Inductor-compiled graph whose outputs are exactly the
    artifact's (checked on that call, value for value), later calls run that graph directly, without the
    aot_autograd wrappers around it (about 20 us a call; a transformer block calls two segments a step).

    A *deferred* segment (one of the root graph's, which runs once a call; ``siblings``: that graph's
    deferred segments) whose artifact is not at hand (compiled in this process or saved by an earlier
    one) runs its aten graph on its first run and is compiled on its second: a program called once pays
    no compile for its root, one called in a loop runs compiled from its second call on.  The second
    call's compiles are one progress count: the first to compile counts its siblings in."""

    def __init__(self, source: fx.GraphModule, inputs: tuple[Meta, ...], where: str,
                 hints: tuple[int, ...] = (), siblings: list[InductorSegment] | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "source", source)  # the aten graph (not a submodule: printed apart)
        self.inputs = inputs
        self.hints = hints  # the example value of each symbol z<k> of ``inputs``
        self.where = where
        self.defer = siblings is not None  # until the first run
        self.siblings = siblings if siblings is not None else []
        self.siblings.append(self)
        self._found: Compiled | None = None  # on first use
        # how the first use got it ("compiled", "loaded", "cache hit", "fell back", "deferred" until its
        # second run; None: not run yet) and in how many seconds: what efx.explain shows per segment
        self.outcome: str | None = None
        self.compile_seconds = 0.0
        self.run: Any = None  # boxed: run([*tensors]) -> outputs; set by the first call

    @classmethod
    def ready(cls, source: fx.GraphModule, compiled: Any, inputs: tuple[Meta, ...]) -> InductorSegment:
        """A segment around an artifact compiled elsewhere (``compiled(*tensors)``)."""
        segment = cls(source, inputs, "a compiled graph")
        segment._found, segment.outcome = Compiled(compiled), "compiled elsewhere"
        return segment

    @property
    def compiled(self) -> Any:
        """Inductor's artifact, compiled (or loaded) on first use: a segment that never runs -- the full
        backward of a program whose callers only ever backpropagate some outputs (Note [Partial
        backward]) -- costs no compile."""
        if self._found is None:
            if self.outcome == "deferred":  # a new count: the siblings that will compile in this call
                for s in self.siblings:
                    if s.outcome == "deferred" and s._found is None:
                        progress.lowered(s)
            start = time.perf_counter()
            self._found, self.outcome = compiled_or_why(self.source, self.inputs, self.hints)
            self.compile_seconds = time.perf_counter() - start
            if self._found.artifact is None:
                self.fall_back(self._found.why or "")
            progress.finished(self, self.where, self.nodes, self.outcome, self.compile_seconds,
                              self._found.why)
        return self._found.artifact

    @property
    def nodes(self) -> int:
        return len(self.source.graph.nodes)

    @property
    def cost_seconds(self) -> float:
        """What compiling this segment takes: its compile's seconds, in this process or, for a loaded or
        shared one, in the one that compiled it (0 when unknown or not compiled yet)."""
        return self._found.seconds if self._found is not None else 0.0

    def fall_back(self, why: str) -> None:
        self._found, self.outcome = Compiled(None, why), "fell back"
        warnings.warn(f"Inductor could not compile a segment of {self.where} ({self.nodes} nodes); it runs "
                      f"un-compiled. {why}", InductorFallbackWarning, stacklevel=4)

    @property
    def guards(self) -> tuple[Any, ...]:
        """What the compiled code assumed of the sizes (over z<k>; () for a static segment)."""
        return self._found.guards if self.compiled is not None else ()  # type: ignore[union-attr]

    @property
    def reason(self) -> str | None:
        """Why the segment runs un-compiled, if it does."""
        return None if self.compiled is not None else self._found.why  # type: ignore[union-attr]

    @property
    def why(self) -> str | None:
        """:attr:`reason` as far as known: None also before the first run (it compiles nothing)."""
        return self._found.why if self._found is not None and self._found.artifact is None else None

    def __call__(self, *args: torch.Tensor) -> Any:
        # a segment is effectfx's, not the user's: torch's global module hooks must not see it
        return self.forward(*args)

    def forward(self, *args: torch.Tensor) -> Any:
        run = self.run
        if run is not None:
            try:
                return run(list(args))
            except AssertionError:  # compiled code checks its inputs' layout first, before any work
                return run(self._traced_layout(args))
        if self.compiled_later() or self.compiled is None:
            return self.source(*args)
        return self._first_call(args)

    def compiled_later(self) -> bool:
        """Whether this run, a deferred segment's first, runs the aten graph (noted as "deferred")."""
        if not self.defer:
            return False
        self.defer = False
        if is_cached(self.source, self.inputs, self.hints):
            return False
        self.outcome = "deferred"
        progress.finished(self, self.where, self.nodes, "deferred", 0.0)
        return True

    def _traced_layout(self, args: tuple) -> list[torch.Tensor]:
        """The inputs, copied into the strides they were traced with where they differ (an expanded
        tangent); dimensions of size 1 do not count, as in Inductor's check."""
        out = list(args)
        for i, (t, (shape, stride, _, _)) in enumerate(zip(args, self.inputs)):
            if self.hints:  # sizes and strides as expressions: the layout is their values here
                stride = _evaluated(shape, stride, t)
            if any(n > 1 and s != g for n, s, g in zip(t.shape, stride, t.stride())):
                out[i] = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
        return out

    def _first_call(self, args: tuple) -> Any:
        artifact = self.compiled
        args = tuple(self._traced_layout(args))
        outs = artifact(*args)
        run = lambda inputs: artifact(*inputs)  # noqa: E731
        direct = _compiled_graph(artifact)
        if direct is not None:
            try:
                mine = direct(list(args))
            except Exception:  # noqa: BLE001 -- the artifact's own path is the reference
                mine = None
            if mine is not None and len(mine) == len(outs) and all(
                    type(a) is type(b) and (not isinstance(a, torch.Tensor) or (
                        a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
                        and torch.equal(a, b))) for a, b in zip(mine, outs)):
                run, outs = direct, mine
        # Inductor hands an input back as an output where the op was an alias (detach, a no-op view);
        # an aten op never does: that output would be the caller's tensor itself, requiring grad
        inputs = {id(a) for a in args}
        returned = [k for k, o in enumerate(outs) if id(o) in inputs]
        if returned:
            self.run = lambda inputs, run=run: _fresh(run(inputs), returned)
            return _fresh(outs, returned)
        self.run = run
        return outs


def _evaluated(shape: tuple, stride: tuple, actual: torch.Tensor) -> tuple[int, ...]:
    """A symbolic stride's values for a tensor like ``actual`` (a symbol z<k> is the first dimension or
    stride that is exactly it: a view's row stride may be a symbol no size is)."""
    values: dict[Any, int] = {}
    for d, n in (*zip(shape, actual.shape), *zip(stride, actual.stride())):
        if type(d) is not int and d.is_Symbol:
            values.setdefault(d, int(n))
    return tuple(s if type(s) is int else int(s.xreplace(values)) for s in stride)


def _position(inputs: tuple[Meta, ...], k: int) -> tuple[int, int, bool] | None:
    """Where symbol z<k> is read from a call: (input, dimension, whether a stride) of the first input
    size, else stride, that is exactly it."""
    for stride in (False, True):
        for i, meta in enumerate(inputs):
            for d, n in enumerate(meta[1] if stride else meta[0]):
                if n == symbol(k):
                    return i, d, stride
    return None


class SymbolicSegment(torch.nn.Module):
    """A segment whose inputs have symbolic sizes.  Its first variant, compiled for the example's sizes,
    usually assumed nothing of them and serves every call; one that did (``InductorSegment.guards``) serves
    the sizes its guards admit, and other sizes get variants of their own, found by the call's sizes."""

    def __init__(self, source: fx.GraphModule, inputs: tuple[Meta, ...], where: str,
                 hints: tuple[int, ...], siblings: list[InductorSegment] | None = None) -> None:
        super().__init__()
        object.__setattr__(self, "source", source)
        self.inputs, self.where = inputs, where
        self.first = InductorSegment(source, inputs, where, hints, siblings)
        self.positions = [_position(inputs, k) for k in range(len(hints))]
        self.by_sizes: dict[tuple[int, ...], InductorSegment] = {}
        self._one: InductorSegment | None = None  # the variant for every size, once known

    @property
    def compiled(self) -> Any:
        return self.first.compiled

    @property
    def variants(self) -> list[InductorSegment]:
        """The first variant and each one made for other sizes (once each; several sizes may share one)."""
        out = [self.first]
        for v in self.by_sizes.values():
            if all(v is not o for o in out):
                out.append(v)
        return out

    @property
    def reason(self) -> str | None:
        return self.first.reason

    def __call__(self, *args: torch.Tensor) -> Any:
        return self.forward(*args)

    def forward(self, *args: torch.Tensor) -> Any:
        one = self._one
        if one is not None:
            return one.forward(*args)
        first = self.first
        if first.compiled_later():  # its first run, at whatever sizes
            return self.source(*args)
        if not first.guards:
            self._one = first
            return first.forward(*args)
        if None in self.positions:  # a symbol read only through an expression: no way to pick a variant
            first.fall_back(f"Inductor's code for it holds only where {first.guards}")
            self._one = first
            return first.forward(*args)
        sizes = tuple(int(args[i].stride(d) if stride else args[i].shape[d])  # type: ignore[misc]
                      for i, d, stride in self.positions)
        variant = self.by_sizes.get(sizes)
        if variant is None:
            known = (first, *self.by_sizes.values())
            variant = next((v for v in known if guards_hold(v.guards, sizes)), None)
            if variant is None:
                variant = InductorSegment(self.source, self.inputs, self.where, sizes)
                progress.lowered(variant)  # compiled right away, below: the count shows it
            self.by_sizes[sizes] = variant
        return variant.forward(*args)


def compiled_segment(source: fx.GraphModule, inputs: list[torch.Tensor], where: str,
                     deferred: list[InductorSegment] | None = None) -> torch.nn.Module:
    """The segment ``source`` (canonical names, see ``_Lowering.segment``) on inputs like ``inputs`` (fakes,
    perhaps with symbolic sizes), compiled once per process, on its first use; with ``deferred`` (its
    graph's deferred segments, which it joins), on its second (:class:`InductorSegment`)."""
    metas, hints = input_metas(inputs)
    segment = (SymbolicSegment(source, metas, where, hints, deferred) if hints
               else InductorSegment(source, metas, where, siblings=deferred))
    progress.lowered(segment.first if isinstance(segment, SymbolicSegment) else segment)
    return segment


def segments_of(gm: torch.nn.Module) -> list[tuple[str, InductorSegment]]:
    """The segments ``gm``'s graph calls, in call order, as (attribute, segment); a symbolic segment's
    variants each (``segment_0``, ``segment_0 variant 2``, ...).  Reads only what was recorded: compiles
    nothing."""
    graph = getattr(gm, "graph", None)
    out: list[tuple[str, InductorSegment]] = []
    for node in graph.nodes if graph is not None else ():
        module = getattr(gm, node.target, None) if node.op == "call_module" else None
        if isinstance(module, InductorSegment):
            out.append((node.target, module))
        elif isinstance(module, SymbolicSegment):
            out.extend((node.target if k == 0 else f"{node.target} variant {k + 1}", v)
                       for k, v in enumerate(module.variants))
    return out


def _fresh(outs: Any, indices: list[int]) -> list[Any]:
    """``outs`` with the tensors at ``indices`` replaced by new aliases (graphs run without autograd, so
    the alias requires no grad, as eager's detach or view would not in the same place)."""
    outs = list(outs)
    for k in indices:
        outs[k] = outs[k].detach()
    return outs


def _compiled_graph(artifact: Any) -> Any:
    """The boxed callable of the one Inductor graph inside a ``standalone_compile`` artifact (found
    through the closures of aot_autograd's wrappers), or None when there is not exactly one, the
    wrappers pass parameters of their own, or the graph mutates inputs."""
    from torch._inductor.output_code import CompiledFxGraph

    found: list[Any] = []
    seen: set[int] = set()
    stack = [getattr(artifact, "_compiled_fn", None)]
    while stack and len(seen) < 100:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, CompiledFxGraph):
            found.append(obj)
        elif callable(getattr(obj, "__code__", None)) or hasattr(obj, "__closure__"):
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if name == "params_buffers_flat" and value:  # leading inputs of the wrappers' own
                    return None
                if callable(value):
                    stack.append(value)
        else:  # aot_autograd's SerializableCompiledFunction holds the graph
            stack.append(getattr(obj, "compiled_fn", None))
    if len(found) != 1 or found[0].mutated_inputs or found[0].current_callable is None:
        return None
    return found[0].current_callable
