"""What the control-flow families (``cond``, ``loops``) share: tracing a function into a subgraph, giving
the subgraphs of one op the same inputs, and emitting the node that runs them.

See Note [Control flow] in ``effectfx.notes``.  During a capture the higher-order ops are taken over before
torch dispatches them (``effectfx.interposers.takeover``): eager torch would hand the user's functions to
Dynamo or to its own ``make_fx``; here each function is traced by the tracer itself (regions, effects,
prints and labels work inside it as anywhere else) into a :class:`~torch.fx.GraphModule` held by the
calling graph, and one ``effectfx.ops.cond`` / ``while_loop`` / ``scan`` node runs it at run time.  The
predicate and the trip count are values of the run, never of the capture.

Inputs of a subgraph are the op's operands, then every tensor of an enclosing graph the functions read
(a parameter, an intermediate of the caller): lifted as extra operands, as torch's own tracing lifts them;
all subgraphs of one op take the same inputs (one that does not read an input ignores it).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from ..capture.python_state import refuse_writes
from ..capture.trace import Scope, trace_graph
from ..capture.tracer import Tracer
from ..errors import CaptureError, UnsupportedMutationError, UnsupportedOperatorError
from ..graph.source import user_location
from ..graph.traced import OperandSource, SourceKind, TensorMeta
from ..interposers.interpose import interpose, interposed
from ..regions.decorator import active_tracer


class SubgraphScope(Scope):
    """The inputs of one control-flow subgraph: its operands, then the enclosing graphs' tensors it reads."""

    def __init__(self, tracer: Tracer, name: str) -> None:
        super().__init__(tracer, name)
        # id(outer tensor) -> (the tensor user code holds -- a parameter itself, not its fake --, its fake,
        # the placeholder)
        self.free: dict[int, tuple[torch.Tensor, torch.Tensor, fx.Node]] = {}

    def lift(self, fake: torch.Tensor) -> fx.Node:
        visible = self.tracer.real_of.get(id(fake), fake)
        builders = self.tracer.builders
        nested = len(builders) > 1 and builders[-1] is self.builder
        outer = builders[-2].values.get(id(fake)) if nested else None  # name it as the enclosing graph does
        node = self.builder.placeholder(outer.name if outer is not None else "lifted", fake)
        self.free[id(visible)] = (visible, fake, node)
        return node


@dataclass
class Traced:
    """One traced subgraph and what its placeholders stand for."""

    gm: fx.GraphModule
    inputs: list[tuple[Any, fx.Node]]  # (("op", i) | ("free", id) | ("tangent", j), placeholder)
    outs: list[torch.Tensor] = field(default_factory=list)  # the trace's output tensors
    spec: Any = None


def trace_subgraph(tracer: Tracer, fn: Any, operands: list[torch.Tensor], what: str, class_name: str,
                   tangents: int = 0, grads: Any = None, names: Any = None) -> Traced:
    """Trace ``fn(*operands)`` (fresh fakes standing for ``operands``) into a subgraph returning tensors.
    With ``grads``, the subgraph is a backward: ``grads(inputs, outs, tangents)`` runs inside the trace."""
    scope = SubgraphScope(tracer, class_name)
    fakes = []
    for i, t in enumerate(operands):
        fake = tracer.new_fake(TensorMeta.of(t))
        name = names[i] if names and i < len(names) else f"arg{i}"
        scope.add_input(name, OperandSource(SourceKind.ARG, i), fake)
        fakes.append(fake)
    tangent_fakes = []
    for j in range(tangents):
        meta = grads.tangent_meta[j]
        tangent_fakes.append(tracer.new_fake(meta))
        scope.builder.placeholder(f"tangent_{j}", tangent_fakes[-1])
    found: dict[str, Any] = {}

    def run() -> Any:
        out = fn(*fakes)
        leaves, found["spec"] = tree_flatten(out)
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                raise UnsupportedOperatorError(
                    f"{what} returns a {type(leaf).__name__} ({leaf!r:.40}) at {user_location()}; effectfx "
                    "captures control flow whose functions return tensors only. Return a tensor "
                    "(torch.tensor(value)) instead.")
        found["outs"] = leaves
        if grads is None:
            return leaves
        return grads.run(fakes, scope, leaves, tangent_fakes)

    # a branch runs at some calls only, a loop's body any number of times: no Python state written
    traced = trace_graph(scope, lambda: refuse_writes(run, tracer, what), what, class_name)
    if traced.mutated or any(scope.builder.values.get(id(f)) is not n for _, f, n in scope.free.values()):
        raise UnsupportedMutationError(
            f"{what} updates one of its inputs (or a tensor of the enclosing code) in place, at "
            f"{user_location()}.\nThe functions of torch.cond, while_loop and scan must be functional in "
            "effectfx: return the new value instead (eager torch refuses this under autograd too).")
    gm = traced.forward
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_node = {n: key for key, n in itertools.chain(
        ((("op", i), n) for i, n in enumerate(placeholders[: len(operands)])),
        ((("tangent", j), n) for j, n in enumerate(placeholders[len(operands): len(operands) + tangents])),
        ((("free", k), n) for k, (_, _, n) in scope.free.items()))}
    inputs = [(by_node[n], n) for n in placeholders]
    result = Traced(gm, inputs, found.get("outs", []), found.get("spec"))
    result.free = [t for t, _, _ in scope.free.values()]  # type: ignore[attr-defined]
    return result


def arrange_inputs(traced: list[Traced], n_operands: int, n_tangents: int = 0,
                   known: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Give every subgraph the same inputs: operands, the union of lifted tensors (order of first read;
    ``known`` when given), tangents; a subgraph gets an unused placeholder for what it does not read.
    Returns the lifted tensors."""
    free: dict[int, torch.Tensor] = {id(t): t for t in known or ()}
    for t in traced:
        for tensor in t.free:  # type: ignore[attr-defined]
            if known is not None and id(tensor) not in free:
                raise CaptureError(
                    f"the backward of a control-flow function reads a tensor its forward does not (at "
                    f"{user_location()}); effectfx cannot capture this under autograd.")
            free.setdefault(id(tensor), tensor)
    keys = [("op", i) for i in range(n_operands)] + [("free", k) for k in free] + [
        ("tangent", j) for j in range(n_tangents)]
    for t in traced:
        have = dict(t.inputs)
        graph = t.gm.graph
        first = next(n for n in graph.nodes if n.op != "placeholder")
        for i, key in enumerate(keys):
            node = have.get(key)
            if node is None:
                with graph.inserting_before(first):
                    node = graph.placeholder(f"unused_{i}")
                node.meta["val"] = free[key[1]] if key[0] == "free" else None
            first.prepend(node)  # placeholders in ``keys`` order, before the first computation
        t.gm.recompile()
    return list(free.values())


def check_same(what: str, a: list[torch.Tensor], b: list[torch.Tensor], names: tuple[str, str]) -> None:
    ma = [(tuple(t.shape), t.dtype) for t in a]
    mb = [(tuple(t.shape), t.dtype) for t in b]
    if ma != mb:
        raise UnsupportedOperatorError(
            f"{what} at {user_location()}: the {names[0]} gives tensors {ma} but the {names[1]} gives {mb}.\n"
            "Both must give tensors of the same shapes and dtypes (eager torch requires it too).")


def emit(tracer: Tracer, target: Any, graphs: list[tuple[fx.GraphModule, str]], head: tuple,
         groups: list[list[torch.Tensor]], metas: list[TensorMeta]) -> list[torch.Tensor]:
    """Emit ``target(*head, *graphs, *groups)`` (graphs as attributes, groups as tuples of nodes) and return
    fresh fakes for its results."""
    builder = tracer.builder
    attrs = [builder.get_attr(gm, name) for gm, name in graphs]
    nodes = [tuple(builder.node_of(tracer.to_fake(t)) for t in group) for group in groups]
    head_nodes = tuple(builder.node_of(tracer.to_fake(h)) for h in head)
    call = builder.call(target, (*head_nodes, *attrs, *nodes))
    call.meta["location"] = user_location()
    results = []
    for i, meta in enumerate(metas):
        fake = tracer.new_fake(meta.without_grad())
        builder.bind(fake, builder.call(operator.getitem, (call, i)))
        results.append(fake)
    call.meta["val"] = tuple(results)
    return results


def result_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta.of(t).without_grad()


def needs_grad(tensors: list[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def flat_tensors(what: str, values: Any) -> list[torch.Tensor]:
    leaves = tree_flatten(values)[0]
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise UnsupportedOperatorError(
                f"{what} at {user_location()} gets a {type(leaf).__name__} ({leaf!r:.40}) as an operand or "
                "carried value; effectfx captures static graphs, so a Python number cannot change at run "
                "time. Pass a tensor (torch.tensor(value)) instead.")
    return leaves


def where(tracer: Tracer, op: str) -> str:
    return f"{op} in {tracer.where()}"


# what eager torch's wrapper returns, by the wrapped function's name, when it differs from the op's result
_AFTER_WRAPPER: dict[str, Any] = {}


def skip_eager_compile(name: str | None = None, restructure: Any = None) -> None:
    """During a capture, eager torch's wrapper of the control-flow ops calls the op (taken over) instead
    of compiling it with Dynamo (which would trace the user's functions itself).  ``restructure(tracer,
    out)`` turns the op's flat result into what the wrapper's function ``name`` returns."""
    import torch._higher_order_ops.utils as hop_utils

    if name is not None:
        _AFTER_WRAPPER[name] = restructure
    if interposed(hop_utils, "_hop_compile_and_call"):
        return

    def hop_compile_and_call(fn: Any, args: tuple, kwargs: dict | None = None) -> Any:
        out = fn(*args, **(kwargs or {}))  # eager torch's wrapper calls the op: captured
        after = _AFTER_WRAPPER.get(fn.__name__)
        return after(active_tracer(), out) if after is not None else out

    interpose(hop_utils, "_hop_compile_and_call", hop_compile_and_call)
