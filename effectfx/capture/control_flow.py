"""torch.cond, while_loop and scan in captured code: nodes holding subgraphs traced by effectfx's tracer.

See Note [Control flow] in ``effectfx.notes``.  During a capture the three higher-order ops are taken
over before torch dispatches them (``hooks``): eager torch would hand the user's functions to Dynamo or
to its own ``make_fx``; here each function is traced by the tracer itself (regions, effects, prints and
labels work inside it as anywhere else) into a :class:`~torch.fx.GraphModule` held by the calling graph,
and one ``effectfx.ops.cond`` / ``while_loop`` / ``scan`` node runs it at run time.  The predicate and the
trip count are values of the run, never of the capture.

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
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import ops
from ..errors import CaptureError, UnsupportedMutationError, UnsupportedOperatorError
from .meta import OperandSource, TensorMeta
from .region_call import leaf_names
from .source import user_location
from .trace import Scope, trace_graph
from .tracer import Tracer


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


def _count(tracer: Tracer) -> int:
    n = tracer.__dict__.get("control_flow_count", 0)
    tracer.__dict__["control_flow_count"] = n + 1
    return n


def trace_subgraph(tracer: Tracer, fn: Any, operands: list[torch.Tensor], what: str, class_name: str,
                   tangents: int = 0, grads: Any = None, names: Any = None) -> Traced:
    """Trace ``fn(*operands)`` (fresh fakes standing for ``operands``) into a subgraph returning tensors.
    With ``grads``, the subgraph is a backward: ``grads(inputs, outs, tangents)`` runs inside the trace."""
    scope = SubgraphScope(tracer, class_name)
    fakes = []
    for i, t in enumerate(operands):
        fake = tracer.new_fake(TensorMeta.of(t))
        scope.add_input(names[i] if names and i < len(names) else f"arg{i}", OperandSource("arg", i), fake)
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

    traced = trace_graph(scope, run, what, class_name)
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


def _check_same(what: str, a: list[torch.Tensor], b: list[torch.Tensor], names: tuple[str, str]) -> None:
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


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta.of(t).without_grad()


def _needs_grad(tensors: list[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _flat_tensors(what: str, values: Any) -> list[torch.Tensor]:
    leaves = tree_flatten(values)[0]
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise UnsupportedOperatorError(
                f"{what} at {user_location()} gets a {type(leaf).__name__} ({leaf!r:.40}) as an operand or "
                "carried value; effectfx captures static graphs, so a Python number cannot change at run "
                "time. Pass a tensor (torch.tensor(value)) instead.")
    return leaves


def _where(tracer: Tracer, op: str) -> str:
    return f"{op} in {tracer.where()}"


# -- cond ------------------------------------------------------------------------------------------------
class _Grads:
    """The backward of one branch: the branch again (eager's cond recomputes it), then autograd; one
    gradient per input that requires grad (zeros where the branch does not use it)."""

    def __init__(self, tangent_meta: list[TensorMeta], diff: list[bool], free: list[torch.Tensor]) -> None:
        self.tangent_meta = tangent_meta
        self.diff = diff  # per output: whether it gets a tangent
        self.free = free  # the lifted tensors of both forward branches

    def run(self, fakes: list[torch.Tensor], scope: SubgraphScope, outs: list[torch.Tensor],
            tangents: list[torch.Tensor]) -> list[torch.Tensor]:
        wrt = [t for t in [*fakes, *self.free] if t.requires_grad]
        it = iter(tangents)
        pairs = [(o, next(it)) for o, d in zip(outs, self.diff) if d]
        pairs = [(o, g) for o, g in pairs if o.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True) \
            if pairs and wrt else [None] * len(wrt)
        return [g if g is not None else torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                for g, t in zip(got, wrt)]


class CondCall(torch.autograd.Function):
    """A cond under autograd: forward emits the forward branches, backward the backward branches."""

    @staticmethod
    def forward(ctx: Any, tracer: Tracer, plan: dict, pred: torch.Tensor, *inputs: Any) -> tuple:  # type: ignore[override]
        outs = emit(tracer, ops.cond, plan["forward"], (pred,), [list(inputs)], plan["out_meta"])
        ctx.tracer, ctx.plan, ctx.pred, ctx.inputs = tracer, plan, pred, inputs
        ctx.mark_non_differentiable(*[o for o, m in zip(outs, plan["diff"]) if not m])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:  # type: ignore[override]
        plan = ctx.plan
        tangents = [g for g, m in zip(grads, plan["diff"]) if m]
        results = iter(emit(ctx.tracer, ops.cond, plan["backward"], (ctx.pred,),
                            [[*ctx.inputs, *tangents]], plan["grad_meta"]))
        return (None, None, None, *[next(results) if t.requires_grad else None for t in ctx.inputs])


def capture_cond(tracer: Tracer, pred: Any, true_fn: Any, false_fn: Any, operands: Any) -> Any:
    what = _where(tracer, "torch.cond")
    if not isinstance(pred, torch.Tensor):  # a Python bool: torch.cond itself runs one branch
        return true_fn(*operands) if pred else false_fn(*operands)
    if pred.numel() != 1:
        raise UnsupportedOperatorError(f"{what} at {user_location()}: the predicate must have one element.")
    flat, spec = tree_flatten(operands)
    flat = _flat_tensors(what, flat)

    def branch(fn: Any) -> Any:
        return lambda *xs: fn(*tree_unflatten(list(xs), spec))

    def param_names(fn: Any) -> list[str]:
        return leaf_names(fn, tuple(operands), {})

    n = _count(tracer)
    names = (f"cond_true_{n}", f"cond_false_{n}")
    with torch.no_grad():
        fw = [trace_subgraph(tracer, branch(f), flat, f"the {side} branch of {what}", f"Cond{side.title()}",
                             names=param_names(f))
              for f, side in ((true_fn, "true"), (false_fn, "false"))]
    _check_same(what, fw[0].outs, fw[1].outs, ("true branch", "false branch"))
    if fw[0].spec != fw[1].spec:
        raise UnsupportedOperatorError(f"{what} at {user_location()}: the branches return different "
                                       f"structures ({fw[0].spec} and {fw[1].spec}).")
    free = arrange_inputs(fw, len(flat))
    inputs = [*flat, *free]
    out_meta = [_meta(t) for t in fw[0].outs]
    if not _needs_grad(inputs):
        outs = emit(tracer, ops.cond, list(zip([t.gm for t in fw], names)), (pred,), [inputs], out_meta)
        return tree_unflatten(outs, fw[0].spec)
    # training: each backward branch recomputes its forward, as eager's cond backward does (its effects too)
    diff = [m.dtype.is_floating_point or m.dtype.is_complex for m in out_meta]
    grads = _Grads([m for m, d in zip(out_meta, diff) if d], diff, free)
    with torch.enable_grad():
        bw = [trace_subgraph(tracer, branch(f), flat, f"the {side} branch of {what} (backward)",
                             f"Cond{side.title()}Backward", tangents=sum(diff), grads=grads,
                             names=param_names(f))
              for f, side in ((true_fn, "true"), (false_fn, "false"))]
    arrange_inputs(bw, len(flat), sum(diff), free)
    plan = {
        "forward": list(zip([t.gm for t in fw], names)),
        "backward": list(zip([t.gm for t in bw], [f"{x}_backward" for x in names])),
        "out_meta": out_meta, "diff": diff,
        "grad_meta": [_meta(t) for t in inputs if t.requires_grad],
    }
    outs = CondCall.apply(tracer, plan, pred, *inputs)
    return tree_unflatten(list(outs), fw[0].spec)


# -- taking the ops over during a capture ------------------------------------------------------------------
def _install() -> None:
    """During a capture (an active tracer on this thread) the ops are captured before torch dispatches them,
    and torch's eager path skips Dynamo (which would trace the user's functions itself)."""
    import torch._higher_order_ops.utils as hop_utils
    from torch._higher_order_ops.cond import CondOp
    from torch._higher_order_ops.scan import ScanOp
    from torch._higher_order_ops.while_loop import WhileLoopOp

    from ..regions import active_tracer
    from .loops import capture_scan, capture_while_loop, restructure_scan

    if getattr(hop_utils._hop_compile_and_call, "__effectfx_hook__", False):
        return
    for cls, capture in ((CondOp, capture_cond), (WhileLoopOp, capture_while_loop), (ScanOp, capture_scan)):
        original = cls.__call__

        def call(self: Any, *args: Any, _original: Any = original, _capture: Any = capture,
                 **kwargs: Any) -> Any:
            tracer = active_tracer()
            if tracer is None:
                return _original(self, *args, **kwargs)
            return _capture(tracer, *args, **kwargs)

        cls.__call__ = call

    compile_and_call = hop_utils._hop_compile_and_call

    def hop_compile_and_call(fn: Any, args: tuple, kwargs: dict | None = None) -> Any:
        tracer = active_tracer()
        if tracer is None:
            return compile_and_call(fn, args, kwargs)
        out = fn(*args, **(kwargs or {}))  # eager torch's wrapper calls the op: captured above
        return restructure_scan(tracer, out) if fn.__name__ == "run_flattened_scan" else out

    hop_compile_and_call.__effectfx_hook__ = True  # type: ignore[attr-defined]
    hop_utils._hop_compile_and_call = hop_compile_and_call


_install()
