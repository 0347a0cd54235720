"""What happens when a region is called during capture (Note [Region identity], Note [Joint trace]).

The first call with a new cache key traces a body; every call then emits
``invoke_subgraph(subgraph, identifier, *operands)``.  Under autograd the call goes through
:class:`RegionCall`, whose backward emits the call of the body's backward subgraph.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_flatten_with_path, tree_is_leaf, tree_unflatten

from .. import ops
from ..autograd.partition import without_gradients
from ..errors import CaptureError, EffectfxError, RegionRecursionError, UnsupportedMutationError
from ..passes.dce import is_effectful
from ..regions import Region
from .identity import (
    ModuleWalk,
    ambient,
    ambient_context,
    call_key,
    code_reads,
    guards_hold,
    key_labels,
    leaf_of_key,
    module_tensors,
    promoted_key,
    resolve,
)
from .meta import (
    OperandSource,
    TensorMeta,
    TracedGraph,
    mask_text,
    same_forward,
    saved_positions,
    tangents_of,
)
from .python_print import region_result_grad_fn
from .reads import Reads, raw, recording, report_read
from .source import definition, user_location
from .trace import Scope, trace_graph
from .tracer import Tracer


@dataclass
class PartialBackward:
    """A body's backward for some of its outputs only (Note [Partial backward])."""

    backward: fx.GraphModule
    saved: tuple[int, ...]  # which of the forward's saved values it reads, in its order
    grad_meta: list[TensorMeta | None]
    attr: str


@dataclass
class RegionBody:
    """One traced body of a region: the region cache entry behind an identifier."""

    identifier: str
    region: Region
    key: Any  # identity.call_key of the call that traced it
    guards: tuple  # ((path, expectation), ...): what the trace read (effectfx.capture.identity)
    traced: TracedGraph
    attr: str  # attribute name of its forward subgraph in calling graphs
    key_labels: tuple[str, ...] = ()  # what each part of ``key`` is, for explanations
    trace_seconds: float = 0.0
    partial: dict[tuple[bool, ...], PartialBackward] = field(default_factory=dict)  # by outputs with grads
    # a backward without the gradients of promoted operands: (its attr, which it keeps) -> (module, metas)
    restricted: dict[tuple[str, tuple[bool, ...]], tuple[fx.GraphModule, list]] = field(default_factory=dict)
    unpromotable: str | None = None  # why it cannot serve calls promoted to require grad, if it cannot
    # its trace (or a region it calls) looked at autograd state or ran an autograd.Function of the code's
    grad_sensitive: bool = False
    _saved_values: list[torch.Tensor] | None = None

    def saved_values(self, tracer: Tracer) -> list[torch.Tensor]:
        """Fakes with the metadata of the saved values the forward returns, shared by every call site's
        saved nodes."""
        if self._saved_values is None:
            metas = self.traced.saved_meta
            self._saved_values = [tracer.new_fake(metas[k], requires_grad=False)
                                  for k in self.traced.returned_saved]
        return self._saved_values

    @property
    def backward_attr(self) -> str:
        return self.attr + "_backward"

    @property
    def cache_key(self) -> tuple:
        """The body's whole identity: its call key and its guards (Note [Region identity])."""
        return (self.key, self.guards)


_FLAT_SPECS: dict[int, Any] = {}


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """``tree_flatten((args, kwargs))``, without pytree's walk for the usual call site: positional
    arguments that are all leaves (a module, tensors)."""
    if kwargs or not all(tree_is_leaf(a) for a in args):
        return tree_flatten((args, kwargs))
    spec = _FLAT_SPECS.get(len(args))
    if spec is None:  # the spec of n leaves: pytree's own, made once
        spec = _FLAT_SPECS[len(args)] = tree_flatten((tuple(range(len(args))), {}))[1]
    return list(args), spec


def leaf_names(fn: Any, args: tuple, kwargs: dict, nested: str = "{base}_{rest}") -> list[str]:
    """A name per leaf of ``(args, kwargs)`` from ``fn``'s parameters: ``x``, ``args_0``, ``cfg_1``."""
    try:
        positional = [
            p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        positional = []
    names = []
    for path, _ in tree_flatten_with_path((args, kwargs))[0]:
        head = path[1]
        if path[0].idx == 0:
            base = positional[head.idx] if head.idx < len(positional) else f"arg{head.idx}"
        else:
            base = str(head.key)
        rest = "_".join(str(getattr(p, "idx", getattr(p, "key", ""))) for p in path[2:])
        names.append(nested.format(base=base, rest=rest) if rest else base)
    return names


def check_containers_unchanged(where: str, fn: Any, names: list[str], spec: Any, leaves: list[Any],
                               args: tuple, kwargs: dict) -> None:
    """A trace runs on copies of the caller's lists and dicts: one that the code changed (``z.append``)
    would leave the caller's unchanged, so it is refused rather than silently lost."""
    after, after_spec = tree_flatten((args, kwargs))
    if after_spec == spec and len(after) == len(leaves) and all(a is b for a, b in zip(after, leaves)):
        return
    changed = next((names[i] for i, (a, b) in enumerate(zip(after, leaves)) if a is not b), None)
    what = f"argument {changed!r}" if changed and after_spec == spec else "a list or dict argument"
    raise UnsupportedMutationError(
        f"{where} (defined at {definition(fn)}) changes {what} in place (append, item assignment...).\n"
        "effectfx cannot write Python containers back to the caller, so the change would be lost. Return "
        "the new values instead and update the container outside the captured code."
    )


def operand_node(tracer: Tracer, value: Any) -> Any:
    """The node of a call site's operand in the current graph; a real tensor (a module's parameter) is
    lifted as it is, without a fake (``Scope.lift_real``)."""
    builder = tracer.builder
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        lift_real = getattr(builder, "lift_real", None)
        if lift_real is not None and id(value) not in tracer.fake_of:
            return builder.values.get(id(value)) or lift_real(value)
    return builder.node_of(tracer.to_fake(value))


def emit_invoke(tracer: Tracer, subgraph: fx.GraphModule, identifier: str, attr: str,
                operands: list[Any], metas: list[TensorMeta | None], hidden: Sequence[torch.Tensor] = ()
                ) -> list[Any]:
    """Emit ``invoke_subgraph`` in the current graph and return fresh fakes for its results.  Operands may
    be nodes of this graph already.  The last ``len(hidden)`` results are returned as ``getitem`` nodes
    only: values no user code sees (a body's saved values) need no fake of their own, and every call site
    shares ``hidden``'s as their nodes' metadata."""
    n_tensors = len(metas) - len(hidden)
    builder = tracer.builder
    labels = getattr(builder, "labels", None)
    nodes = [v if type(v) is fx.Node else labels.node_for(v) if labels is not None and isinstance(v, str)
             else operand_node(tracer, raw(v)) for v in operands]
    call = builder.call(ops.invoke_subgraph, (builder.get_attr(subgraph, attr), identifier, *nodes))
    results: list[Any] = []
    for i, meta in enumerate(metas):
        if meta is None:
            results.append(None)
        elif i >= n_tensors:
            item = builder.call(operator.getitem, (call, i))
            item.meta["val"] = hidden[i - n_tensors]
            results.append(item)
        else:
            fake = tracer.new_fake(meta, requires_grad=False)
            builder.bind(fake, builder.call(operator.getitem, (call, i)))
            results.append(fake)
    return results


class CallSite:
    """What a call site's backward may need to trace the body again (Note [Partial backward]): the
    arguments, and their tensors as they were at the call -- the forward may have written one in place
    since (a body updating its argument), which made it require grad and gave it a history.  One object,
    not a tuple: ``Function.apply`` walks its arguments with pytree, and this is a leaf."""

    __slots__ = ("leaves", "spec", "args", "kwargs", "ambient", "key", "nonleaf", "promoted")

    def __init__(self, leaves: list[Any], spec: Any, args: tuple, kwargs: dict, ambient: Any, key: tuple,
                 promoted: bool = False) -> None:
        self.leaves, self.spec, self.args, self.kwargs, self.ambient = leaves, spec, args, kwargs, ambient
        self.key = key  # identity.call_key: each tensor's metadata at the call (as the body was keyed)
        self.promoted = promoted  # the body was keyed with arguments promoted to require grad
        self.nonleaf = [isinstance(leaf, torch.Tensor) and not leaf.is_leaf for leaf in leaves]

    def tensor_at_call(self, i: int) -> tuple[TensorMeta, bool]:
        """Leaf ``i``'s metadata and whether it had a history, when the call was made."""
        return leaf_of_key(self.key, i), self.nonleaf[i]


class RegionCall(torch.autograd.Function):
    """A region call under autograd: forward emits the forward body, backward the backward body."""

    efx_region_call = True  # its nodes in a body's autograd graph are not the code's own Functions

    @staticmethod
    def forward(ctx: Any, tracer: Tracer, body: RegionBody, call: CallSite,  # type: ignore[override]
                *operands: Any) -> tuple:
        traced = body.traced
        returned = traced.returned_saved
        results = emit_invoke(tracer, traced.forward, body.identifier, body.attr, list(operands),
                              [*traced.out_meta, *[traced.saved_meta[k] for k in returned]],
                              body.saved_values(tracer))
        outs = results[: traced.n_outs]
        # the backward reads the saved values the body returned, and the operands it saved as they are
        saved = iter(results[traced.n_outs:])
        ctx.saved = [next(saved) if j is None else operand_node(tracer, raw(operands[j]))
                     for j in traced.saved_inputs]
        ctx.tracer, ctx.body = tracer, body
        # which operands are tensors: the node's edges, in order (an output's operands: TracedGraph.out_deps)
        ctx.tensor_operands = tuple(j for j, o in enumerate(operands) if isinstance(o, torch.Tensor))
        ctx.call = call
        differentiable = traced.tangent_mask
        if call.promoted:  # an output reaching only promoted operands does not require grad, as in eager
            differentiable = tuple(m and any(_requires_grad(operands[j]) for j in deps)
                                   for m, deps in zip(differentiable, traced.out_deps))
        ctx.mark_non_differentiable(*[o for o, m in zip(outs, differentiable) if not m])
        ctx.set_materialize_grads(False)  # an output nothing used gets no gradient: Note [Partial backward]
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:  # type: ignore[override]
        body: RegionBody = ctx.body
        traced = body.traced
        tangents = tangents_of(grads, traced.tangent_mask)  # a copy made here is recorded in the graph
        live = tuple(g is not None for g in tangents)
        if ctx.saved and ctx.saved[0].graph is not ctx.tracer.builder.graph:
            raise CaptureError(
                f"the backward of region {body.region.name!r} ({body.identifier}) runs while another graph "
                f"is being traced (torch.autograd.grad inside a region, of a tensor its caller computed?) "
                f"at {user_location()}; take the gradient in the code that calls the region."
            )
        assert traced.backward is not None
        if torch.is_grad_enabled():  # create_graph=True: the gradient itself would need a gradient
            raise CaptureError(
                f"the captured code differentiates the gradient of region {body.region.name!r} "
                f"({body.identifier}, defined at {definition(body.region.fn)}) at {user_location()} "
                "(torch.autograd.grad(..., create_graph=True), a gradient penalty?); effectfx does not "
                "differentiate a region's backward. Take that gradient outside the captured function, or "
                "call the region's code without @effectfx.region there."
            )
        if all(live):
            backward, attr, grad_meta = traced.backward, body.backward_attr, traced.grad_meta
            operands = [*ctx.saved, *tangents]
        else:
            part = _partial_backward(ctx.tracer, body, ctx.call, live)
            backward, attr, grad_meta = part.backward, part.attr, part.grad_meta
            operands = [*[ctx.saved[i] for i in part.saved], *[g for g in tangents if g is not None]]
        needs = ctx.needs_input_grad[3:]
        keep = tuple(need for need, m in zip(needs, traced.grad_mask) if m)
        if ctx.call.promoted and not all(keep):  # their gradients are not computed (Note [Region identity])
            backward, grad_meta = _restricted(body, backward, attr, grad_meta, keep)
            attr += "_skip" + "_".join(str(j) for j, m in enumerate(traced.grad_mask) if m and not needs[j])
        results = emit_invoke(ctx.tracer, backward, body.identifier, attr, operands, grad_meta)
        it = iter(results)
        return (None, None, None, *[next(it) if m else None for m in traced.grad_mask])


def call_region(tracer: Tracer, region: Region, args: tuple, kwargs: dict) -> Any:
    if any(r.fn is region.fn for r in tracer.region_stack):
        chain_names = " -> ".join(r.name for r in (*tracer.region_stack, region))
        raise RegionRecursionError(
            f"region {region.name!r} calls itself ({chain_names}) at {user_location()}.\n"
            "A region's body must be finite to trace once; unroll the recursion or remove @region "
            "from the recursive function."
        )
    if torch.is_grad_enabled() and torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        raise CaptureError(
            f"region {region.name!r} (defined at {definition(region.fn)}) is called under saved-tensor hooks "
            f"at {user_location()} (torch.utils.checkpoint with use_reentrant=False around the call, "
            "torch.autograd.graph.save_on_cpu...): a region call saves nothing through autograd, so the "
            "hooks would not see its tensors and a checkpoint would not recompute its effects as eager does. "
            "Checkpoint inside the region instead, or call the code without @effectfx.region there."
        )
    leaves, spec = flatten_call(args, kwargs)
    walks = {i: ModuleWalk(leaf) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.nn.Module)}
    key = call_key(leaves, spec, walks=walks)
    body, promoted = _find(tracer, region, key, leaves), False
    if body is None:
        # Note [Region identity], promotion: arguments without grad share the body of those with it
        pkey = promoted_key(key, leaves)
        if pkey is not None and any(key[0][1:]):  # autocast caches its casts of leaves requiring grad
            why = "autocast is on, and it casts a leaf that requires grad once for all its uses"
            tracer.unpromotable.setdefault(region.fn, why)
            pkey = None
        if pkey is not None and region.fn not in tracer.unpromotable:
            body = _find(tracer, region, pkey, leaves)
            if body is not None and body.unpromotable is not None:  # traced where nothing was promoted
                tracer.unpromotable[region.fn], body = body.unpromotable, None
            elif body is None:
                body = _trace_body(tracer, region, pkey, leaves, spec, args, kwargs, promoted=True)
            if body is not None:
                key, promoted = pkey, True
        if body is None:
            body = _trace_body(tracer, region, key, leaves, spec, args, kwargs)
    tracer.region_calls[body.identifier] = tracer.region_calls.get(body.identifier, 0) + 1
    if body.grad_sensitive:  # so is every trace calling it (promotion, is_leaf guards): its reads count there
        tracer.label_mode.grad_state_read()
    traced = body.traced
    operands: list[Any] = []
    for src in traced.sources:
        if src.kind == "arg":
            operands.append(leaves[src.index])
        elif src.kind == "module":
            operands.append(walks[src.index].tensors[src.name])
        elif src.kind == "label":
            operands.append(resolve(src.path, leaves))  # read through the caller: its reads see it
        else:
            operands.append(src.tensor)
    if traced.backward is not None:
        call = CallSite(leaves, spec, args, kwargs, ambient_context(), key, promoted)
        outs = list(RegionCall.apply(tracer, body, call, *operands))
    else:
        outs = emit_invoke(tracer, traced.forward, body.identifier, body.attr, operands, traced.out_meta)
    if traced.mutated:
        _write_operands(tracer, region, traced, operands, outs[traced.n_user_outs:])
    # a body that returns an operand unchanged hands the caller that very tensor, as eager does (under
    # no_grad too, where a fresh result would wrongly stop requiring grad)
    for k, j in traced.passthrough().items():
        outs[k] = operands[j]
    out_leaves = [outs[v] if kind == "tensor" else v for kind, v in traced.out_layout]
    return out_leaves[0] if traced.out_spec.is_leaf() else tree_unflatten(out_leaves, traced.out_spec)


def _find(tracer: Tracer, region: Region, key: tuple, leaves: list[Any]) -> RegionBody | None:
    """Note [Region identity]: the first body with this key whose guards hold on these arguments."""
    found = tracer.candidates.get((region.fn, key), ())
    return next((b for b in found if guards_hold(b.guards, leaves)), None)


def _requires_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _write_operands(tracer: Tracer, region: Region, traced: TracedGraph, operands: list[Any],
                    new_values: list[Any]) -> None:
    """The caller's tensors get the new values of the operands the body wrote (Note [Mutations]): an
    in-place copy in the caller's graph, which the caller's own trace records like any other write."""
    def base(t: Any) -> Any:
        return tracer.base_of.get(id(tracer.to_fake(t)), tracer.to_fake(t))

    for j, new in zip(traced.mutated, new_values):
        operand = operands[j]
        problem = None
        if operand.requires_grad and operand.is_leaf and torch.is_grad_enabled():
            problem = "a leaf tensor that requires grad (eager refuses this too)"
        elif any(k != j and isinstance(o, torch.Tensor) and base(o) is base(operand)
                 for k, o in enumerate(operands)):
            problem = "a tensor that another of its operands aliases (the body would read a stale copy)"
        if problem:
            raise UnsupportedMutationError(
                f"region {region.name!r} (defined at {definition(region.fn)}) updates its operand "
                f"{traced.forward.graph.find_nodes(op='placeholder')[j].target!r} in place, and the caller "
                f"passes {problem}, at {user_location()}.\nPass a clone, or update the tensor outside the "
                "region."
            )
        fake = tracer.to_fake(operand)
        if (not new.requires_grad and id(fake) not in tracer.base_of and not tracer.views_of.get(id(fake))
                and TensorMeta.of(fake).without_grad() == TensorMeta.of(new)):
            tracer.builder.bind(fake, tracer.builder.node_of(new))  # a buffer's new statistics, say
        else:
            operand.copy_(new)  # recorded like the user's own copy_: views, dtypes and autograd as in eager
            if operand.grad_fn is not None:  # print shows the body's op that wrote it, as eager's does
                name = region_result_grad_fn(tracer, new)
                if name is not None:
                    tracer.written_by_region[id(operand)] = (operand.grad_fn, name)


def _trace(tracer: Tracer, region: Region, leaves: list[Any], spec: Any, args: tuple, kwargs: dict,
           grad_outputs: tuple[bool, ...] | None = None, call: CallSite | None = None,
           key: tuple | None = None) -> tuple[TracedGraph, tuple]:
    """Trace ``region``'s body on fakes of ``leaves`` (as they were at ``call``, when retraced for it; with
    the metadata ``key`` holds, when promoted): its graph(s) and its guards."""
    module_params: dict[int, tuple[int, str]] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.nn.Module):
            for name, t in module_tensors(leaf):
                module_params.setdefault(id(t), (i, name))
    scope = Scope(tracer, region.name, region, module_params)
    labels = scope.labels
    assert labels is not None
    reads = labels.reads = Reads(tracer.watcher, structural=True, on_label=labels.make)
    names = leaf_names(region.fn, args, kwargs)
    new_leaves = list(leaves)
    leafness: dict[int, bool] = {}  # per tensor argument: whether it was a leaf of autograd (no history)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if call is not None:
                meta, nonleaf = call.tensor_at_call(i)
            else:
                meta = leaf_of_key(key, i) if key is not None else TensorMeta.of(leaf)
                nonleaf = not leaf.is_leaf
            leafness[i] = not nonleaf
            fake = tracer.new_fake(meta)
            scope.add_input(names[i], OperandSource("arg", i), fake)
            new_leaves[i] = scope.writable(fake, nonleaf=nonleaf)
        elif isinstance(leaf, str):  # a string argument: an operand while only effects use it
            new_leaves[i] = labels.make((("leaf", i),), raw(leaf), parent=leaf)
        else:
            reads.root(leaf, (("leaf", i),))
    body_args, body_kwargs = tree_unflatten(new_leaves, spec)
    # labels live only in bodies: the root's own calls (and the bookkeeping of its call sites) skip the mode
    label_mode = contextlib.nullcontext() if tracer.region_stack else tracer.label_mode
    tracer.region_stack.append(region)
    grad_state_reads = tracer.label_mode.grad_state_reads
    # autocast's cached casts of weights are values of the graph that made them: a body neither reads its
    # caller's (nor an earlier trace's, a partial backward's retrace) nor leaves its own to its caller
    torch.clear_autocast_cache()
    try:
        with label_mode, recording(reads):
            for holder, step, value in code_reads(region.fn):
                report_read(holder, step, value)
            traced = trace_graph(scope, lambda: region.fn(*body_args, **body_kwargs),
                                 f"region {region.name!r}", region.name, region.fn, grad_outputs)
        check_containers_unchanged(f"region {region.name!r}", region.fn, names, spec, new_leaves,
                                   body_args, body_kwargs)
    finally:
        tracer.region_stack.pop()
        torch.clear_autocast_cache()
    if tracer.label_mode.grad_state_reads > grad_state_reads or any(ambient()[1:]):
        # the code looked at autograd state (``x.is_leaf``, ``x.grad_fn is None``), or autocast caches its
        # casts of leaves that require grad: whether each tensor argument has a history is part of what the
        # body is for (the key has its requires_grad)
        for i, leaf in leafness.items():
            reads.guards.setdefault((("leaf", i), "is_leaf"), ("=", bool, leaf))
    return traced, tuple(reads.guards.items())


def _trace_body(tracer: Tracer, region: Region, key: Any, leaves: list[Any], spec: Any,
                args: tuple, kwargs: dict, promoted: bool = False) -> RegionBody:
    """A new body for ``key``; with ``promoted``, the body of a key some arguments were promoted in, or
    None when the trace shows it cannot serve them (the region cache is then as it was before)."""
    state = tracer.region_state() if promoted else None
    reads = tracer.label_mode.grad_state_reads
    identifier = tracer.next_identifier()
    start = time.perf_counter()
    traced: TracedGraph | None = None
    why: str | None = None
    try:
        traced, guards = _trace(tracer, region, leaves, spec, args, kwargs, key=key if promoted else None)
    except (EffectfxError, RuntimeError) as exc:
        if not promoted:
            raise
        why = f"its trace failed ({type(exc).__name__})"  # an exact trace says why, if it must
    reads = tracer.label_mode.grad_state_reads - reads
    if traced is not None:
        why = _unpromotable(traced, reads)
    if promoted and why is not None:
        tracer.restore_region_state(state)
        tracer.unpromotable[region.fn] = why
        return None  # type: ignore[return-value]
    assert traced is not None
    body = RegionBody(identifier, region, key, guards, traced, "",
                      key_labels(leaf_names(region.fn, args, kwargs)), time.perf_counter() - start,
                      unpromotable=why,
                      grad_sensitive=bool(reads) or (traced.backward is not None and traced.custom_autograd))
    traced.forward.meta["effectfx_region"] = (region, body.cache_key, identifier, "forward")
    if traced.backward is not None:
        traced.backward.meta["effectfx_region"] = (region, body.cache_key, identifier, "backward")
    body.attr = re.sub(r"\W", "_", region.name) + "_" + identifier.replace("_", "")
    tracer.bodies[(region.fn, body.cache_key)] = body
    tracer.candidates.setdefault((region.fn, key), []).append(body)
    tracer.trace_counts[identifier] = tracer.trace_counts.get(identifier, 0) + 1
    return body


def _unpromotable(traced: TracedGraph, grad_state_reads: int) -> str | None:
    """Why a body traced with promoted arguments would not be eager's for a call that passes them without
    grad (Note [Region identity]), or None."""
    if traced.mutated:
        return "it updates an operand in place"
    if grad_state_reads:
        return ("its code (or a region it calls) reads a tensor's autograd state (requires_grad, grad_fn, "
                "is_leaf or grad) or calls an autograd.Function")
    if traced.backward is None:
        return None
    if traced.custom_autograd:
        return "it calls a torch.autograd.Function"
    if any(is_effectful(n) for n in traced.backward.graph.nodes if n.op == "call_function"):
        return "its backward has effects, which eager runs only for the gradients it needs"
    return None


def _restricted(body: RegionBody, backward: fx.GraphModule, attr: str, grad_meta: list,
                keep: tuple[bool, ...]) -> tuple[fx.GraphModule, list]:
    """``backward`` returning only the gradients in ``keep`` (None for the others): the gradients of
    operands a call site promoted are not computed (Note [Region identity]).  Made once per backward."""
    found = body.restricted.get((attr, keep))
    if found is None:
        found = body.restricted[(attr, keep)] = (without_gradients(backward, keep),
                                                 [m if k else None for m, k in zip(grad_meta, keep)])
    return found


def _partial_backward(tracer: Tracer, body: RegionBody, call: CallSite, live: tuple[bool, ...]
                      ) -> PartialBackward:
    """The body's backward for the outputs in ``live`` only (Note [Partial backward]), traced once."""
    found = body.partial.get(live)
    if found is not None:
        return found
    leaves, spec, args, kwargs, ambient_state = call.leaves, call.spec, call.args, call.kwargs, call.ambient
    counts = dict(tracer.region_calls)  # the retrace's region calls are not call sites of the program
    with ambient_state:
        traced, _ = _trace(tracer, body.region, leaves, spec, args, kwargs, live, call)
    tracer.region_calls = counts
    assert traced.backward is not None
    where = f"region {body.region.name!r} ({body.identifier}, defined at {definition(body.region.fn)})"
    same_forward(body.traced.forward, traced.forward, where)
    found = PartialBackward(traced.backward, saved_positions(body.traced.saved, traced.saved, where),
                            traced.grad_meta, body.backward_attr + "_" + mask_text(live))
    found.backward.meta["effectfx_region"] = (body.region, body.cache_key, body.identifier, "backward")
    found.backward.meta["effectfx_grad_outputs"] = live
    body.partial[live] = found
    return found
