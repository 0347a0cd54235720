"""lower_to_inductor: token-free form -> token-free form whose pure parts run as Inductor kernels (CPU).

Contract: requires the token-free form; gives a new Program computing the same values with the same effects
in the same order, in which every graph -- the root and each region body, forward and backward -- calls
compiled *segments* (``call_module`` of :class:`InductorSegment`) between the nodes that must run in
Python: effects, region calls, random ops.  Regions stay regions: a body shared by N call sites is lowered
once, its segments compiled once, and every call site runs the compiled body (Note [Region identity]).
Inductor never sees an effect, so effects run exactly where eager runs them, whatever their keys.

How (see Note [Effect tokens] for why order needs care):
  1. Per graph, the *Python nodes* (:func:`runs_in_python`: effects, ``invoke_subgraph``, random and
     mutating ops, anything Inductor cannot take) keep their order; Python node ``k`` runs after segment
     ``k``.  A pure node may go to any segment between the first in which all its inputs exist and the
     last before its first reader; :func:`_fewest_segments` picks the fewest segments.  Pure work moves
     (it is pure); Python nodes never do.  A body whose effects only read values (``record``, ``log``)
     is therefore one segment.  A segment of views only (a transpose, a detach) is not compiled: its
     nodes run as they are.
  2. Each segment is compiled by ``torch._inductor.standalone_compile`` (aot_autograd's decompositions to
     core aten, then Inductor) on fake example inputs built from the capture's tensor metadata.  Compiled
     segments are cached for the process by their code and input metadata (:data:`SEGMENTS`), so a body
     is compiled once however many call sites, programs or input signatures share it; and saved as
     ``CompiledArtifact`` files in Inductor's cache directory (:func:`artifact_path`), so a second
     process loads each in milliseconds.
  3. A segment Inductor cannot compile runs its aten graph un-compiled (the default backend's ops),
     with an :class:`InductorFallbackWarning` naming the region: never a wrong result.

Why not torch's own lowering of ``invoke_subgraph`` (one ``compile_fx_inner`` per root graph, each body
lowered once inside it): measured (benchmarks/README.md, "Inductor backend") it compiles a 16-block stack
1.3x slower, runs no faster and gave wrong gradients on GPT-2; it also needs every effect inside Inductor
(registered in torch's effect registry, all keys collapsed onto one chain), a body is re-lowered for every
new root graph, and one failure loses the whole program.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import operator
import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from ..effects import effect_of
from ..errors import BackendError, EffectfxWarning
from ..graph.build import Graph, graph_module
from ..passes.direct_calls import DirectOpCodeGen
from ..program.program import Program


class InductorFallbackWarning(EffectfxWarning):
    """A pure segment Inductor could not compile runs un-compiled (correct, slower)."""


Meta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


def _meta(t: torch.Tensor) -> Meta:
    device = getattr(t, "fake_device", None) or t.device
    return tuple(t.shape), tuple(t.stride()), t.dtype, device


def _example(meta: Meta) -> torch.Tensor:
    shape, stride, dtype, device = meta
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


class InductorSegment(torch.nn.Module):
    """One pure segment: ``forward(*tensors)`` returns the values later nodes read (a list or tuple).

    ``compiled`` is Inductor's artifact, or None when the segment runs its aten graph (``source``).  The
    first call runs the artifact; when it holds one Inductor-compiled graph whose outputs are exactly the
    artifact's (checked on that call, value for value), later calls run that graph directly, without the
    aot_autograd wrappers around it (about 20 us a call; a transformer block calls two segments a step)."""

    def __init__(self, source: fx.GraphModule, inputs: tuple[Meta, ...], where: str) -> None:
        super().__init__()
        object.__setattr__(self, "source", source)  # the aten graph (not a submodule: printed apart)
        self.inputs = inputs
        self.where = where
        self._found: tuple[Any, str | None] | None = None  # (artifact or None, why not): on first use
        self.run: Any = None  # boxed: run([*tensors]) -> outputs; set by the first call

    @classmethod
    def ready(cls, source: fx.GraphModule, compiled: Any, inputs: tuple[Meta, ...]) -> InductorSegment:
        """A segment around an artifact compiled elsewhere (``compiled(*tensors)``)."""
        segment = cls(source, inputs, "a compiled graph")
        segment._found = (compiled, None)
        return segment

    @property
    def compiled(self) -> Any:
        """Inductor's artifact, compiled (or loaded) on first use: a segment that never runs -- the full
        backward of a program whose callers only ever backpropagate some outputs (Note [Partial
        backward]) -- costs no compile."""
        if self._found is None:
            self._found = _compiled_or_why(self.source, self.inputs)
            if self._found[0] is None:
                size = len(self.source.graph.nodes)
                warnings.warn(f"Inductor could not compile a segment of {self.where} ({size} nodes); it runs "
                              f"un-compiled. {self._found[1]}", InductorFallbackWarning, stacklevel=3)
        return self._found[0]

    @property
    def reason(self) -> str | None:
        """Why the segment runs un-compiled, if it does."""
        return None if self.compiled is not None else self._found[1]  # type: ignore[index]

    def forward(self, *args: torch.Tensor) -> Any:
        run = self.run
        if run is not None:
            try:
                return run(list(args))
            except AssertionError:  # compiled code checks its inputs' layout first, before any work
                return run(self._traced_layout(args))
        if self.compiled is None:
            return self.source(*args)
        return self._first_call(args)

    def _traced_layout(self, args: tuple) -> list[torch.Tensor]:
        """The inputs, copied into the strides they were traced with where they differ (an expanded
        tangent); dimensions of size 1 do not count, as in Inductor's check."""
        out = list(args)
        for i, (t, (shape, stride, _, _)) in enumerate(zip(args, self.inputs)):
            if any(n > 1 and s != g for n, s, g in zip(shape, stride, t.stride())):
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


# -- the caches of compiled segments ----------------------------------------------------------------------
@dataclass
class CacheStats:
    compiles: int = 0  # segments handed to Inductor
    loads: int = 0  # segments loaded from an artifact an earlier process saved
    hits: int = 0  # segments found compiled (another call site, body, program or signature)
    fallbacks: int = 0  # segments run un-compiled


SEGMENTS: dict[tuple, tuple[Any, str | None]] = {}  # _key(segment) -> (compiled or None, why not)
STATS = CacheStats()
_LOCK = threading.Lock()  # one Inductor compile at a time (Inductor's state is global)
ARTIFACT_FORMAT = 1  # bump when what a saved artifact means changes


def clear_cache() -> None:
    """Forget every compiled segment of this process (saved artifacts stay; see :func:`artifact_path`)."""
    with _LOCK:
        SEGMENTS.clear()


def artifact_path(source: fx.GraphModule, inputs: tuple[Meta, ...]) -> Path:
    """Where a segment's compiled artifact is saved: inside Inductor's cache directory (so
    ``TORCHINDUCTOR_CACHE_DIR`` governs both), named by everything the compiled code depends on."""
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = repr((ARTIFACT_FORMAT, torch.__version__, _key(source, inputs), inductor_config.get_hash(),
                torch._functorch.config.get_hash()))
    return Path(cache_dir()) / "effectfx" / f"{hashlib.sha256(key.encode()).hexdigest()}.bin"


@contextlib.contextmanager
def _quiet_unsaveable() -> Iterator[None]:
    """Silence standalone_compile's warning that it has nothing to save (a graph that compiles to no
    kernel): on stderr it would interleave with the program's own output; the next process compiles such
    a segment again from Inductor's caches instead of loading our artifact."""
    logger = logging.getLogger("torch._inductor.standalone_compile")
    quiet = lambda record: "cannot save" not in record.getMessage()  # noqa: E731
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _compile(source: fx.GraphModule, inputs: tuple[Meta, ...]) -> tuple[Any, str | None]:
    """``torch._inductor.standalone_compile`` (aot_autograd's decompositions, then Inductor) of one segment,
    saved as a ``CompiledArtifact`` that a later process loads in milliseconds instead of tracing and
    looking up Inductor's caches again."""
    from torch._inductor import CompiledArtifact, standalone_compile
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    path = artifact_path(source, inputs)
    if path.is_file():
        try:
            loaded = CompiledArtifact.load(path=str(path), format="binary")
            STATS.loads += 1
            return loaded, None
        except Exception:  # written by another torch, or damaged: compile anew (and overwrite it)
            pass
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())  # static shapes: specialized on these examples
    try:
        with fake_mode:
            examples = [_example(m) for m in inputs]
        with torch.no_grad(), _quiet_unsaveable():  # the inference path: segments run without grad
            artifact = standalone_compile(source, examples, dynamic_shapes="from_example_inputs",
                                          fake_mode=fake_mode)
    except Exception as e:  # any Inductor failure: run the aten graph instead
        STATS.fallbacks += 1
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    STATS.compiles += 1
    if getattr(artifact, "is_saveable", lambda: True)():
        try:  # atomically: two processes may save the same segment at once
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
            artifact.save(path=str(tmp), format="binary")
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache: the next process compiles again
    return artifact, None


def _key(source: fx.GraphModule, inputs: tuple[Meta, ...]) -> tuple:
    """What a segment's compiled code depends on: its code, the objects that code names (FX writes some
    arguments as globals, not literals) and its inputs' metadata."""
    code = source.graph.python_code("self")
    return code.src, tuple(sorted((k, repr(v)) for k, v in code.globals.items())), inputs


def compiled_segment(source: fx.GraphModule, inputs: tuple[Meta, ...], where: str) -> InductorSegment:
    """The segment ``source`` (canonical names, see ``_Lowering.segment``), compiled once per process, on
    its first use."""
    return InductorSegment(source, inputs, where)


def _compiled_or_why(source: fx.GraphModule, inputs: tuple[Meta, ...]) -> tuple[Any, str | None]:
    key = _key(source, inputs)
    with _LOCK:
        found = SEGMENTS.get(key)
        if found is None:
            found = SEGMENTS[key] = _compile(source, inputs)
        else:
            STATS.hits += 1
    return found


# -- splitting graphs ------------------------------------------------------------------------------------
_RANDOM = torch.Tag.nondeterministic_seeded


def runs_in_python(node: fx.Node) -> bool:
    """Whether ``node`` runs in Python, in program order, instead of inside a segment: effects, region
    calls, random ops (eager's generator, in eager's order), mutating ops, non-aten calls, ops reading a
    program constant (a ProcessGroup) and ops whose result is not tensors."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return runs_in_python(node.args[0]) if isinstance(node.args[0], fx.Node) else True
    if not isinstance(target, torch._ops.OpOverload) or effect_of(target) is not None:
        return True
    if _RANDOM in target.tags or target._schema.is_mutable:
        return True
    if any(i.op == "get_attr" for i in node.all_input_nodes):
        return True
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return not all(isinstance(v, torch.Tensor) for v in vals)


def _fewest_segments(earliest: dict[fx.Node, int], python: list[fx.Node]) -> dict[fx.Node, int]:
    """Each pure node's segment, using as few segments as the order allows: every compile costs seconds.

    A pure node may run in any segment from ``earliest`` (its inputs exist) to ``latest`` (before the first
    Python node or segment reading it).  Choosing the fewest segments is interval stabbing: take intervals
    by ``latest``, and open a segment at ``latest`` whenever none chosen so far lies inside the interval;
    then every node goes to the first chosen segment at or after its ``earliest``.  Producers stay at or
    before their consumers, since both bounds grow along every edge."""
    position = {node: k for k, node in enumerate(python)}  # Python node k runs after segment k
    latest: dict[fx.Node, int] = {}
    for node in reversed(list(earliest)):
        bound = len(python)
        for user in node.users:
            if user in latest:
                bound = min(bound, latest[user])
            elif user in position:
                bound = min(bound, position[user])
        if node.users:  # unread pure nodes are dead code: no segment computes them
            latest[node] = bound
    chosen: list[int] = []
    for node in sorted(latest, key=latest.__getitem__):
        if not any(earliest[node] <= c <= latest[node] for c in chosen[-1:]):
            chosen.append(latest[node])
    return {node: next(c for c in chosen if c >= earliest[node]) for node in earliest if node in latest}


class _Lowering:
    """Lowers one Program's graphs; each body object once (shared bodies stay shared)."""

    def __init__(self, prog: Program) -> None:
        self.prog = prog
        self.bodies: dict[int, fx.GraphModule] = {}

    def body(self, gm: fx.GraphModule, identifier: str) -> fx.GraphModule:
        if id(gm) not in self.bodies:
            entry = self.prog.regions.get(identifier)
            region = entry.name if entry is not None else identifier
            self.bodies[id(gm)] = self.graph(gm, f"region {region!r} ({identifier}) of {self.prog.name!r}")
        return self.bodies[id(gm)]

    def graph(self, gm: fx.GraphModule, where: str) -> fx.GraphModule:
        nodes = list(gm.graph.nodes)
        identifiers = {n.args[0]: n.args[1] for n in nodes if n.target is ops.invoke_subgraph}
        avail: dict[fx.Node, int] = {}
        segment_of: dict[fx.Node, int] = {}
        python: list[fx.Node] = []  # in program order
        for node in nodes:
            if node.op in ("placeholder", "get_attr"):
                avail[node] = 0
            elif node.op == "output":
                continue
            elif node.target in (ops.with_effects, ops.make_token, ops.sink_tokens):
                raise BackendError(f"lower_to_inductor needs the token-free form ({where} has "
                                   f"{node.format_node()}); run remove_effect_tokens first.")
            elif node.op != "call_function":
                raise BackendError(f"cannot lower {node.format_node()} ({node.op}) in {where} to Inductor.")
            elif runs_in_python(node):
                python.append(node)
                avail[node] = len(python)
            else:
                segment_of[node] = avail[node] = max((avail[i] for i in node.all_input_nodes), default=0)

        segment_of = _fewest_segments(segment_of, python)

        new = Graph()
        new.set_codegen(DirectOpCodeGen())  # effect ops called without OpOverload.__call__
        holder = torch.nn.Module()
        env: dict[fx.Node, Any] = {}
        members: list[list[fx.Node]] = [[] for _ in range(len(python) + 1)]
        for node, seg in segment_of.items():
            members[seg].append(node)
        for node in nodes:
            if node.op == "placeholder":
                env[node] = new.node_copy(node)
            elif node.op == "get_attr":
                value = getattr(gm, node.target)
                if isinstance(value, fx.GraphModule):
                    value = self.body(value, identifiers.get(node, node.target))
                setattr(holder, node.target, value)
                env[node] = new.node_copy(node)
        emitted = 0
        for seg, group in enumerate(members):
            if group and self.segment(new, holder, env, group, f"segment_{emitted}", where):
                emitted += 1
            if seg < len(python):
                node = python[seg]
                env[node] = new.node_copy(node, lambda n: env[n])
        output = next(n for n in nodes if n.op == "output")
        new.output(fx.map_arg(output.args[0], lambda n: env[n]))
        lowered = graph_module(holder, new, f"Inductor{type(gm).__name__}")
        lowered.meta.update(gm.meta)
        return lowered

    def segment(self, new: fx.Graph, holder: torch.nn.Module, env: dict[fx.Node, Any], members: list[fx.Node],
                attr: str, where: str) -> bool:
        inside = set(members)
        inputs: list[fx.Node] = []
        for node in members:
            for i in node.all_input_nodes:
                if i not in inside and i not in inputs:
                    inputs.append(i)
        outputs = [n for n in members if any(u not in inside for u in n.users)]
        if not outputs:
            return False  # nothing outside reads it: pure dead code
        if all(n.target is operator.getitem or n.target.is_view for n in members):
            for node in members:  # views only (a transpose, a detach): nothing to compile, run them
                env[node] = new.node_copy(node, lambda n: env[n])
            return False
        # canonical names (created, not copied): the same code is the same cache key wherever it occurs
        graph = fx.Graph()
        local: dict[fx.Node, fx.Node] = {}
        for k, i in enumerate(inputs):
            local[i] = graph.placeholder(f"in{k}")
            local[i].meta = dict(i.meta)
        for node in members:
            local[node] = graph.create_node(node.op, node.target, fx.map_arg(node.args, lambda n: local[n]),
                                            fx.map_arg(node.kwargs, lambda n: local[n]))
            local[node].meta = dict(node.meta)
        graph.output(tuple(local[o] for o in outputs))
        source = fx.GraphModule(torch.nn.Module(), graph, "Segment")
        metas = []
        for i in inputs:
            val = i.meta.get("val")
            if not isinstance(val, torch.Tensor):  # runs_in_python keeps non-tensors out; be sure
                raise BackendError(f"{i.format_node()} in {where} passes a {type(val).__name__} into an "
                                   "Inductor segment; use the default backend for this program.")
            metas.append(_meta(val))
        setattr(holder, attr, compiled_segment(source, tuple(metas), where))
        call = new.call_module(attr, tuple(env[i] for i in inputs))
        for k, out in enumerate(outputs):
            env[out] = new.call_function(operator.getitem, (call, k))
            env[out].meta = dict(out.meta)
        return True


def lower_to_inductor(prog: Program) -> Program:
    """Token-free -> token-free with compiled segments in every graph (module docstring)."""
    if prog.form != "token-free":
        raise BackendError(f"lower_to_inductor needs the token-free form, got {prog.form}; run "
                           "thread_tokens and remove_effect_tokens first.")
    return prog.replace(graph_module=_Lowering(prog).graph(prog.graph_module, repr(prog.name)))
