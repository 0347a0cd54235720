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
     is therefore one segment.  A segment of views only (a transpose, a detach), or of at most
     ``TINY_ROOT_SEGMENT`` ops in the root graph, is not compiled: its nodes run as they are (tier 2
     compiles those too: ``effectfx.backends.tiers``).
  2. Each segment is compiled by Inductor once per process (and loaded from disk in later processes):
     a body's on its first run, a root segment's on its second (deferred: the first call of a program
     costs one compile per distinct body forward and backward, and the root's work un-compiled);
  3. a segment Inductor cannot compile runs its aten graph un-compiled (the default backend's ops), with
     a warning naming the region: never a wrong result.  Both: ``effectfx.backends.inductor_segments``.

Why not torch's own lowering of ``invoke_subgraph`` (one ``compile_fx_inner`` per root graph, each body
lowered once inside it): measured (benchmarks/README.md, "Inductor backend") it compiles a 16-block stack
1.3x slower, runs no faster and gave wrong gradients on GPT-2; it also needs every effect inside Inductor
(registered in torch's effect registry, all keys collapsed onto one chain), a body is re-lowered for every
new root graph, and one failure loses the whole program.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from ..effects import effect_of
from ..errors import BackendError
from ..graph.build import Graph, graph_module
from ..graph.symbols import SYM_TYPES, Sizes, expr_of, has_symbols
from ..passes.direct_calls import DirectOpCodeGen
from ..program.program import Program
from ..program.records import Form
from .inductor_segments import compiled_segment

_RANDOM = torch.Tag.nondeterministic_seeded
# a root segment of at most this many ops (views aside) runs un-compiled: the root runs once a step, so
# fusing a few ops saves microseconds, and each compile costs a second or more of the first call
TINY_ROOT_SEGMENT = 4


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


def is_size(node: fx.Node) -> bool:
    """A size computation (``sym_size`` of an input and arithmetic on sizes): computed once, up front,
    in Python -- it reads only the graph's inputs (Note [Symbolic shapes]) -- and never a segment
    boundary; a segment reads the sizes it needs from its own inputs."""
    return node.op == "call_function" and isinstance(node.meta.get("val"), SYM_TYPES)


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

    def __init__(self, prog: Program, defer: bool = True, options: dict[str, Any] | None = None) -> None:
        self.prog = prog
        self.defer = defer
        self.options = tuple(sorted((options or {}).items()))
        self.bodies: dict[int, fx.GraphModule] = {}

    def body(self, gm: fx.GraphModule, identifier: str) -> fx.GraphModule:
        if id(gm) not in self.bodies:
            entry = self.prog.regions.get(identifier)
            region = entry.name if entry is not None else identifier
            self.bodies[id(gm)] = self.graph(gm, f"region {region!r} ({identifier}) of {self.prog.name!r}")
        return self.bodies[id(gm)]

    def graph(self, gm: fx.GraphModule, where: str, root: bool = False) -> fx.GraphModule:
        nodes = list(gm.graph.nodes)
        identifiers = {n.args[0]: n.args[1] for n in nodes if n.target is ops.invoke_subgraph}
        avail: dict[fx.Node, int] = {}
        segment_of: dict[fx.Node, int] = {}
        python: list[fx.Node] = []  # in program order
        sizes: list[fx.Node] = []
        for node in nodes:
            if node.op in ("placeholder", "get_attr"):
                avail[node] = 0
            elif is_size(node):
                sizes.append(node)
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
        for node in sizes:
            env[node] = new.node_copy(node, lambda n: env[n])
        self.inputs = [n for n in nodes if n.op == "placeholder"]
        self.root = root
        self.deferred: list = []  # the root's segments, compiled on their second run (inductor_segments)
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

    def size_inputs(self, sizes: list[fx.Node], inputs: list[fx.Node], where: str) -> list[fx.Node]:
        """The graph inputs a segment must also take to read ``sizes`` from: those of its inputs lack."""
        have = Sizes(Graph())
        for i in inputs:
            have.add_input(i, i.meta.get("val"))
        outer = Sizes(Graph())
        for i in self.inputs:
            outer.add_input(i, i.meta.get("val"))
        extra: list[fx.Node] = []
        for node in sizes:
            for symbol in sorted(_free_symbols(node), key=str):
                if have.source(symbol) is None:
                    found = outer.source(symbol)
                    if found is None:
                        raise BackendError(f"a segment of {where} needs the size {symbol}, which no input of "
                                           "its graph has (Note [Symbolic shapes]); use the default backend.")
                    extra.append(found[0])
                    have.add_input(found[0], found[0].meta.get("val"))
        return extra

    def segment(self, new: fx.Graph, holder: torch.nn.Module, env: dict[fx.Node, Any], members: list[fx.Node],
                attr: str, where: str) -> bool:
        inside = set(members)
        inputs: list[fx.Node] = []
        sizes: list[fx.Node] = []
        for node in members:
            for i in node.all_input_nodes:
                if i not in inside and i not in inputs and i not in sizes:
                    (sizes if is_size(i) else inputs).append(i)
        inputs.extend(self.size_inputs(sizes, inputs, where))
        outputs = [n for n in members if any(u not in inside for u in n.users)]
        if not outputs:
            return False  # nothing outside reads it: pure dead code
        work = [n for n in members if n.target is not operator.getitem and not n.target.is_view]
        if not work or (self.root and self.defer and len(work) <= TINY_ROOT_SEGMENT):
            # views only (a transpose, a detach), or a few ops of the root (an embedding's backward and a
            # sum between two region calls): a compile costs seconds and would save nothing; run them
            for node in members:
                env[node] = new.node_copy(node, lambda n: env[n])
            return False
        # canonical names (created, not copied): the same code is the same cache key wherever it occurs
        graph = fx.Graph()
        local: dict[fx.Node, fx.Node] = {}
        for k, i in enumerate(inputs):
            local[i] = graph.placeholder(f"in{k}")
            local[i].meta = dict(i.meta)
        if sizes:  # read from the segment's own inputs, as every graph reads them
            table = Sizes(graph)
            for i in inputs:
                table.add_input(local[i], i.meta.get("val"))
            for node in sizes:
                local[node] = table.node(node.meta["val"])
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
            metas.append(val)
        # (part of its cache key: inductor_cache.options_of); not for symbolic sizes, whose C++ wrapper's
        # guards name symbols of Inductor's own, which no variant's guards could be checked on
        if self.options and not any(has_symbols(m.shape) for m in metas):
            source.meta["inductor_options"] = self.options
        deferred = self.deferred if self.root and self.defer else None
        setattr(holder, attr, compiled_segment(source, metas, where, deferred))
        call = new.call_module(attr, tuple(env[i] for i in inputs))
        for k, out in enumerate(outputs):
            env[out] = new.call_function(operator.getitem, (call, k))
            env[out].meta = dict(out.meta)
        return True


def _free_symbols(node: fx.Node) -> set:
    expr = expr_of(node.meta["val"])
    return set(getattr(expr, "free_symbols", ()))


def lower_to_inductor(prog: Program, defer: bool = True, options: dict[str, Any] | None = None) -> Program:
    """Token-free -> token-free with compiled segments in every graph (module docstring); ``defer=False``
    (tier 2, compiled before it runs: ``effectfx.backends.tiers``) compiles every root segment, the tiny
    ones too, on its first use; ``options``: Inductor's, for every segment (tier 2's C++ wrapper)."""
    if prog.form is not Form.TOKEN_FREE:
        raise BackendError(f"lower_to_inductor needs the token-free form, got {prog.form}; run "
                           "thread_tokens and remove_effect_tokens first.")
    lowered = _Lowering(prog, defer, options).graph(prog.graph_module, repr(prog.name), root=True)
    return prog.replace(graph_module=lowered)
