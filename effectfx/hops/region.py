"""What happens when a region is called during capture (Note [Region identity], Note [Joint trace]).

The first call with a new cache key traces a body (``region_body``); every call then emits
``invoke_subgraph(subgraph, identifier, *operands)`` (``call_site``).  Under autograd the call goes through
:class:`RegionCall`, whose backward emits the call of the body's backward subgraph.  Functions marked with
``torch.compiler.nested_compile_region`` are regions too (an interposer on torch's placeholder).

The region op is a higher-order op like every family in this package, with one difference: it is not
torch's HOP taken over, but effectfx's own ``Region.call`` handing the call to the tracer, which the
driver gives :func:`call_region` to (``effectfx.ops.HOPS``, its row).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_unflatten

from ..capture.arguments import flatten_call
from ..capture.python_state import replay
from ..capture.tracer import Tracer
from ..errors import CaptureError, RegionRecursionError, UnsupportedMutationError, UnsupportedOperatorError
from ..graph.source import definition, user_location
from ..graph.torch_func import FUNCTORCH, torch_func_kinds, torch_func_refusal, wrapped_or_grad
from ..graph.traced import OutputKind, SourceKind, TensorMeta, TracedGraph, tangents_of
from ..guards.check import resolve
from ..guards.identity import ModuleWalk, ambient_context, call_key
from ..guards.labels import raw
from ..interposers.interpose import interpose
from ..interposers.python_print import region_result_grad_fn
from ..program.containers import value_at, write_into
from ..regions.cache import RegionBody
from ..regions.decorator import Region, active_tracer
from ..regions.promotion import promoted_key, refusal_before_trace
from .call_site import CallSite, emit_invoke, operand_node
from .region_body import partial_backward, restricted, trace_body


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
                              body.saved_values(tracer.new_fake))
        outs = results[: traced.n_outs]
        # the backward reads the saved values the body returned, and the operands it saved as they are
        saved = iter(results[traced.n_outs:])
        ctx.saved = [next(saved) if j is None else _passed(tracer, operands[j]) for j in traced.saved_inputs]
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
        node = next((n for n in ctx.saved if isinstance(n, fx.Node)), None)
        if node is not None and node.graph is not ctx.tracer.builder.graph:
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
        if not any(live):  # no gradient reached it (its result fed only code under no_grad): as in eager's
            return (None, None, None, *[None] * len(traced.grad_mask))  # engine, no formula of it runs
        if all(live):
            backward, attr, grad_meta = traced.backward, body.backward_attr, traced.grad_meta
            operands = [*ctx.saved, *tangents]
        else:
            part = partial_backward(ctx.tracer, body, ctx.call, live)
            backward, attr, grad_meta = part.backward, part.attr, part.grad_meta
            operands = [*[ctx.saved[i] for i in part.saved], *[g for g in tangents if g is not None]]
        needs = ctx.needs_input_grad[3:]
        keep = tuple(need for need, m in zip(needs, traced.grad_mask) if m)
        if ctx.call.promoted and not all(keep):  # their gradients are not computed (Note [Region identity])
            backward, grad_meta = restricted(body, backward, attr, grad_meta, keep)
            attr += "_skip" + "_".join(str(j) for j, m in enumerate(traced.grad_mask) if m and not needs[j])
        results = emit_invoke(ctx.tracer, backward, body.identifier, attr, operands, grad_meta)
        it = iter(results)
        return (None, None, None, *[next(it) if m else None for m in traced.grad_mask])


def _passed(tracer: Tracer, operand: Any) -> Any:
    """What the call site hands the backward call for one of its operands the body's backward reads: the
    operand's node, or a label's (an effect a checkpoint's recompute performs again)."""
    if isinstance(operand, str):
        labels = tracer.builder.labels
        return labels.node_for(operand) if labels is not None else raw(operand)
    return operand_node(tracer, raw(operand))


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
    module_tensors = [(name, t) for walk in walks.values() for name, t in walk.tensors.items()]
    if FUNCTORCH.peek_interpreter_stack() is not None:
        _refuse_under_torch_func(region, leaves, module_tensors)
    # a module holding a tensor the capture received (torch.func.functional_call swaps it in): the body
    # would lift it by identity, and every later call site would pass this one's
    swapped = next((name for name, t in module_tensors
                    if isinstance(t, FakeTensor) and id(t) in tracer.real_of), None)
    if swapped is not None:
        raise UnsupportedOperatorError(
            f"region {region.name!r} (defined at {definition(region.fn)}) is called at {user_location()} "
            f"with a module whose {swapped!r} is a tensor the captured function received, not the module's "
            "own (torch.func.functional_call, or an assignment in the captured code?): one body serves every "
            "call site and would read that tensor for all of them.\nCall torch.func.functional_call outside "
            "the captured function (efx.compile(model) reads the module's parameters at each call: update "
            "them in place), or call the region's code without @efx.region there (its __wrapped__)."
        )
    key = call_key(leaves, spec, walks=walks)
    body, promoted = tracer.regions.find(region, key, leaves), False
    if body is None:
        # Note [Region identity], promotion: arguments without grad share the body of those with it
        pkey = promoted_key(key, leaves)
        why = refusal_before_trace(key) if pkey is not None else None
        if why is not None:
            tracer.regions.unpromotable.setdefault(region.fn, why)
            pkey = None
        if pkey is not None and region.fn not in tracer.regions.unpromotable:
            body = tracer.regions.find(region, pkey, leaves)
            if body is not None and body.unpromotable is not None:  # traced where nothing was promoted
                tracer.regions.unpromotable[region.fn], body = body.unpromotable, None
            elif body is None:
                body = trace_body(tracer, region, pkey, leaves, spec, args, kwargs, promoted=True)
            if body is not None:
                key, promoted = pkey, True
        if body is None:
            body = trace_body(tracer, region, key, leaves, spec, args, kwargs)
    tracer.regions.called(body)
    if body.grad_sensitive:  # so is every trace calling it (promotion, is_leaf guards): its reads count there
        tracer.label_mode.grad_state_read()
    traced = body.traced
    operands: list[Any] = []
    for src in traced.sources:
        if src.kind is SourceKind.ARG:
            operands.append(leaves[src.index])
        elif src.kind is SourceKind.MODULE:
            operands.append(walks[src.index].tensors[src.name])
        elif src.kind is SourceKind.LABEL:
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
    out_leaves = [outs[v] if kind is OutputKind.TENSOR else v for kind, v in traced.out_layout]
    result = out_leaves[0] if traced.out_spec.is_leaf() else tree_unflatten(out_leaves, traced.out_spec)
    if traced.python_writes:  # each call site writes the Python state the body wrote (Note [Python state])
        result, values = result
        replay(traced.python_writes, values, leaves)
    if traced.written_args:  # the caller's containers take the states the body left them in
        result, states = result
        for where, new in zip(traced.written_args, states):
            write_into(value_at(args, kwargs, where), new)
    return result


# -- torch.func (Note [Region identity]: a body is traced once, on plain tensors) ---------------------
def _refuse_under_torch_func(region: Region, leaves: list[Any],
                             module_tensors: list[tuple[str, Any]]) -> None:
    """A region called under a torch.func transform.  Its body is traced once on plain tensors and called
    through invoke_subgraph: only vmap, and only around a call whose tensors are neither batched nor need
    a gradient (``vmap(efx.compile(f))``, or ``vmap`` of code passing the region unbatched tensors), runs
    as eager does.  Every other transform -- and vmap's BatchedTensors -- would be baked into the graph,
    and under autograd the call is an autograd.Function (RegionCall), which torch.func cannot transform."""
    kinds = torch_func_kinds()
    others = [k for k in kinds if k != "Vmap"]
    tensors = [(f"argument {i}", leaf) for i, leaf in enumerate(leaves)]
    tensors += [(repr(name), t) for name, t in module_tensors]
    wrapped, needs_grad = wrapped_or_grad(tensors)
    if others:
        kind = others[-1]
        why = "the transform's wrapped tensors cannot pass through a region call (its body is traced once, " \
              "on plain tensors) and would be baked into the graph"
    elif wrapped is not None:
        kind = "Vmap"
        why = f"its {wrapped} is a BatchedTensor: the body would be traced for one example, run on the batch"
    elif needs_grad is not None:
        kind = "Vmap"
        why = (f"its {needs_grad} requires grad: the call would record its backward as an autograd.Function, "
               "which vmap cannot batch")
    else:
        return
    raise torch_func_refusal(
        f"region {region.name!r} (defined at {definition(region.fn)})", kind, why,
        f"Call the region's code without @efx.region under torch.func (its __wrapped__: "
        f"{region.name}.__wrapped__(...)), or apply {{transform}} inside the region"
        + (", or call it under torch.no_grad()" if kind == "Vmap" and needs_grad else ""))


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


# torch.compiler.nested_compile_region marks functions by routing their calls through
# invoke_subgraph_placeholder; during an effectfx capture those calls become effectfx regions
_NESTED_REGIONS: dict[Any, Region] = {}
_NESTED_LOCK = threading.Lock()


def _nested_region_call(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with _NESTED_LOCK:
        reg = _NESTED_REGIONS.get(func)
        if reg is None:
            reg = _NESTED_REGIONS[func] = Region(func)
    return active_tracer().call_region(reg, args, kwargs)


interpose(importlib.import_module("torch._higher_order_ops.invoke_subgraph"),  # (the package's is the HOP)
          "invoke_subgraph_placeholder", _nested_region_call)
