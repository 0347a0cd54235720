"""Trace one graph -- the root function or one region body -- jointly with its backward when needed.

See Note [Joint trace] and Note [Region identity] in effectfx.notes.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from ..autograd.partition import partition_joint
from ..errors import (
    CaptureError,
    EffectfxError,
    FreeTensorError,
    UnsupportedMutationError,
    UnsupportedOperatorError,
    UnsupportedReturnError,
)
from ..graph.source import in_library, return_lines, trim_traceback, user_location
from ..graph.traced import OperandSource, OutputKind, OutputLeaf, SourceKind, TensorMeta, TracedGraph
from ..graph.walk import eliminate_dead_code
from ..guards.labels import BodyLabels, raw
from ..interposers import rng
from .arguments import PLAIN_LEAVES
from .graph_builder import GraphBuilder
from .tracer import Tracer
from .unsupported import unsupported_operator


def placeholder_name(name: str) -> str:
    """A valid Python identifier for a graph input ("0.weight" of an nn.Sequential -> "p_0_weight")."""
    dotted = name.replace(".", "_")  # the usual parameter path: no regex needed
    if dotted.isidentifier() and dotted[0] != "_" and dotted[-1] != "_" and not keyword.iskeyword(dotted):
        return dotted
    name = re.sub(r"\W", "_", name).strip("_") or "arg"
    if name[0].isdigit() or keyword.iskeyword(name):
        name = "p_" + name
    return name


class Scope:
    """The inputs of one graph: explicit ones first, then tensors lifted while tracing."""

    def __init__(self, tracer: Tracer, name: str, region: Any = None,
                 module_params: dict[int, tuple[int, str]] | None = None,
                 param_names: dict[int, str] | None = None) -> None:
        self.tracer = tracer
        self.region = region
        self.module_params = module_params or {}
        self.param_names = param_names or {}
        self.sources: list[OperandSource] = []
        self.values: list[Any] = []  # autograd-level value of each input (a str for a label)
        self.nodes: list[fx.Node] = []  # the placeholder of each input
        self.visible: dict[int, torch.Tensor] = {}  # input -> the tensor user code holds, when not its value
        self.real_nodes: dict[int, fx.Node] = {}  # id(real tensor read by identity) -> its input
        # a body's labels (effectfx.guards.labels); the root bakes every string in
        self.labels = BodyLabels(self.add_label) if region is not None else None
        self.builder = GraphBuilder(name, self.lift, self.lift_real, self.labels)

    def add_input(self, name: str, source: OperandSource, fake: torch.Tensor) -> None:
        self.nodes.append(self.builder.placeholder(placeholder_name(name), fake))
        self.sources.append(source)
        self.values.append(fake)

    def index_of(self, tensor: torch.Tensor) -> int | None:
        """The input ``tensor`` is (its value, or the tensor user code holds for it), or None."""
        for i, value in enumerate(self.values):
            if value is tensor or self.visible.get(i) is tensor:
                return i
        return None

    def writable(self, fake: torch.Tensor, nonleaf: bool) -> torch.Tensor:
        """The tensor user code gets for the input ``fake``.  A non-leaf the caller passes may be updated
        in place, as in eager; the input itself is a leaf of the trace's autograd (gradients are taken
        with respect to it), so user code gets an alias with history (Note [Mutations])."""
        if not (nonleaf and fake.requires_grad and torch.is_grad_enabled()):
            return fake
        with self.tracer.paused():
            alias = fake.clone()
        self.builder.bind(alias, self.nodes[-1])
        self.visible[len(self.values) - 1] = alias
        return alias

    def written(self) -> list[tuple[fx.Node, torch.Tensor]]:
        """``(placeholder, tensor holding the new value)`` for each input written in place."""
        found = []
        for i, (value, node) in enumerate(zip(self.values, self.nodes)):
            if not isinstance(value, torch.Tensor):
                continue
            tensor = self.visible.get(i)
            if tensor is None:  # a real tensor no op saw has no fake: nothing wrote it
                tensor = self.tracer.fake_of.get(id(value), value)
            # rebound to a computed value (one tensor may be two inputs: compare kinds, not nodes)
            if self.builder.values.get(id(tensor), node).op != "placeholder":
                found.append((node, tensor))
        return found

    def add_label(self, label: Any, path: tuple) -> fx.Node:
        """A string operand: the call site passes the value found at ``path`` (Note [Region identity])."""
        step = path[-1]
        node = self.builder.placeholder(placeholder_name(step if isinstance(step, str) else "label"), label)
        node.meta["val"] = raw(label)
        self.sources.append(OperandSource(SourceKind.LABEL, path=path))
        self.values.append(label)
        self.nodes.append(node)
        return node

    def finish_labels(self, graph: fx.Graph, layout: list[OutputLeaf]) -> None:
        if self.labels is None:
            return
        for label in self.labels.finish(graph, [v for kind, v in layout if kind is OutputKind.CONST]):
            i = next(i for i, v in enumerate(self.values) if v is label)
            del self.values[i], self.sources[i], self.nodes[i]
            self.visible = {j - (j > i): t for j, t in self.visible.items()}

    def lift(self, fake: torch.Tensor) -> fx.Node:
        real = self.tracer.real_of.get(id(fake))
        if real is None:
            if self.region is None:
                raise CaptureError(
                    f"the captured function read a tensor it neither computed nor received (at "
                    f"{user_location()}): one computed inside a region and kept in Python state (appended to "
                    "a list, stored on an object, or by a hook such as transformers' output_attentions and "
                    "output_hidden_states), or one from another capture. A region's body is traced once for "
                    "all its calls, so such a tensor has no value per call: return it from the region."
                )
            raise FreeTensorError(
                f"region {self.region.name!r} reads a tensor computed by its caller that is not one of its "
                f"arguments (at {user_location()}).\nA reused body would silently see a stale value. Pass "
                "the tensor to the region as an argument."
            )
        return self.lift_real(real, fake)

    def lift_real(self, real: torch.Tensor, fake: torch.Tensor | None = None) -> fx.Node:
        """The input of a real tensor read by identity (a parameter), made on first use.  A region call
        site passes its module's parameters as they are: no fake is made for them, and the placeholder's
        metadata is the tensor itself (Note [Joint trace])."""
        node = self.real_nodes.get(id(real))
        if node is not None:
            return node
        where = self.module_params.get(id(real))
        if where is not None:
            source = OperandSource(SourceKind.MODULE, where[0], where[1])
            name = where[1]
        else:
            source = OperandSource(SourceKind.LIFTED, tensor=real)
            name = self.param_names.get(id(real), "lifted")
        node = self.builder.placeholder(placeholder_name(name), fake if fake is not None else real)
        self.real_nodes[id(real)] = node
        self.sources.append(source)
        self.values.append(real)
        self.nodes.append(node)
        return node


def _meta(value: Any) -> TensorMeta | None:
    return TensorMeta.of(value) if isinstance(value, torch.Tensor) else None


def _requires_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _flatten_outputs(out: Any, where: str, fn: Any) -> tuple[Any, list[OutputLeaf], list[torch.Tensor]]:
    leaves, spec = tree_flatten(out)
    layout: list[OutputLeaf] = []
    tensors: list[torch.Tensor] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            layout.append(OutputLeaf(OutputKind.TENSOR, len(tensors)))
            tensors.append(leaf)
        elif isinstance(leaf, PLAIN_LEAVES):
            layout.append(OutputLeaf(OutputKind.CONST, leaf))
        else:
            # a library's function (a transformers model's forward) returns through its decorators: point
            # at the user's call instead
            at = f"called at {user_location()}" if fn is None or in_library(fn) else f"at {return_lines(fn)}"
            cache = type(leaf).__name__.endswith("Cache")
            hint = (" (a cache class pytree does not know: register it with "
                    "torch.utils._pytree.register_pytree_node)") if cache else ""
            raise UnsupportedReturnError(
                f"{where} returned a {type(leaf).__name__} ({leaf!r:.60}) {at}; effectfx graphs can return "
                "tensors, numbers, strings and None inside tuples, lists and dicts. Return tensors (or a "
                f"pytree of them) and build other objects outside{hint}."
            )
    return spec, layout, tensors


def _node_key(fn: Any, nr: int) -> Any:
    """How a walk of an autograd graph names a node: a region call's node by its output too -- its outputs
    run different formulas of the body (Note [Partial backward])."""
    return (fn, nr) if getattr(getattr(fn, "_forward_cls", None), "efx_region_call", False) else fn


def _walk(out: torch.Tensor) -> set[Any]:
    """The nodes (``_node_key``) of ``out``'s autograd graph.  Through a region call, only the operands its
    output reaches are followed (the call's node has an edge to every operand: ``TracedGraph.out_deps``)."""
    seen: set[Any] = set()
    stack = [(out.grad_fn, out.output_nr)]
    while stack:
        fn, nr = stack.pop()
        key = _node_key(fn, nr)
        if fn is None or key in seen:
            continue
        seen.add(key)
        edges = fn.next_functions
        if key is not fn and fn.body.traced.out_deps:
            position = {j: p for p, j in enumerate(fn.tensor_operands)}
            edges = tuple(edges[position[j]] for j in fn.body.traced.out_deps[nr] if j in position)
        stack.extend(edges)
    return seen


def _covered_by(outs: list[torch.Tensor]) -> tuple[frozenset[int], ...]:
    """For each output, the other outputs whose autograd graph reaches its own ``grad_fn``: a backward
    from those runs every formula it would run (Note [Partial backward])."""
    reached = [_walk(out) for out in outs]
    keys = [_node_key(out.grad_fn, out.output_nr) for out in outs]
    return tuple(frozenset(j for j, seen in enumerate(reached) if j != i and out.grad_fn is not None
                           and keys[i] in seen) for i, out in enumerate(outs))


def _reaches(outs: list[torch.Tensor], inputs: list[Any]) -> tuple[tuple[frozenset[int], ...], bool]:
    """For each output, the inputs (by index) its autograd graph reaches -- whether it would require grad
    if only some of them did -- and whether that graph holds an ``autograd.Function`` other than a nested
    region call (Note [Region identity], promotion)."""
    index: dict[int, list[int]] = {}
    for j, v in enumerate(inputs):
        if isinstance(v, torch.Tensor):
            index.setdefault(id(v), []).append(j)
    custom = False
    reached = []
    for out in outs:
        found: set[int] = set()
        for key in _walk(out):
            fn = key[0] if type(key) is tuple else key
            variable = getattr(fn, "variable", None)  # an AccumulateGrad: a leaf
            if variable is not None:
                found.update(index.get(id(variable), ()))
            forward_cls = getattr(fn, "_forward_cls", None)
            if forward_cls is not None and key is fn and forward_cls.__module__ != "torch._library.autograd":
                custom = True  # (a custom op's registered formula is an op)
        reached.append(frozenset(found))
    return tuple(reached), custom


def trace_graph(scope: Scope, run: Callable[[], Any], where: str, class_name: str,
                fn: Any = None, grad_outputs: tuple[bool, ...] | None = None) -> TracedGraph:
    """Run ``run`` (the user's code) with ``scope``'s builder current and return the traced graph.

    ``grad_outputs`` says which differentiable outputs get a gradient (default: all); the backward is
    autograd's over those only (Note [Partial backward])."""
    tracer, builder = scope.tracer, scope.builder
    with tracer.graph(builder):
        try:
            out = run()
        except EffectfxError as exc:
            refused = unsupported_operator(exc, where)  # tripped inside a higher-order op
            if refused is not None:
                raise refused from None
            # the message names the user's line: drop the dispatcher's frames (the cause stays)
            raise trim_traceback(exc) from exc.__cause__
        except RuntimeError as exc:
            if "leaf Variable that requires grad" in str(exc):
                raise UnsupportedMutationError(
                    f"{where} updates a leaf tensor that requires grad in place at {user_location(exc)}; "
                    "eager PyTorch refuses this too (Note [Mutations]). Update a clone, or do it under "
                    "torch.no_grad()."
                ) from None
            refused = unsupported_operator(exc, where)
            if refused is not None:
                raise refused from None
            if "tensor subclass" not in str(exc) and "FakeTensor" not in str(exc):
                raise
            raise CaptureError(
                f"{where} needs a tensor's data in Python at {user_location(exc)} ({exc}).\neffectfx traces "
                "with fake tensors, which have no data: keep .numpy(), .tolist() and the like outside the "
                "captured function, or use tensor ops."
            ) from None  # the message quotes torch's
        spec, layout, tensors = _flatten_outputs(out, where, fn)
        # a returned label is used; finish_labels sees it
        layout = [OutputLeaf(kind, raw(v)) for kind, v in layout]
        # inputs written in place: their new values follow the outputs (Note [Mutations])
        written = scope.written()
        tensors.extend(t for _, t in written)
        out_nodes = [builder.node_of(tracer.to_fake(t)) for t in tensors]
        out_meta = [TensorMeta.of(t) for t in tensors]
        # a written leaf that requires grad was updated under no_grad (eager refuses it otherwise: an
        # optimizer's step): its new value has no gradient
        n_written = len(written)
        tangent_mask = tuple(t.requires_grad and not (k >= len(tensors) - n_written and t.is_leaf)
                             for k, t in enumerate(tensors))
        if not (torch.is_grad_enabled() and any(tangent_mask)):
            gm = builder.finish(out_nodes, class_name)
            scope.finish_labels(gm.graph, layout)
            input_meta = [_meta(v) for v in scope.values]
            rng.simplify(gm.graph)
            eliminate_dead_code(gm.graph)
            gm.recompile()  # lazy: only marks the code stale
            return TracedGraph(gm, None, scope.sources, input_meta, spec, layout, out_meta,
                               mutated=tuple(scope.nodes.index(n) for n, _ in written))

        builder.phase = "backward"
        diff_outs = [t for t, m in zip(tensors, tangent_mask) if m]
        if grad_outputs is not None:
            diff_outs = [t for t, live in zip(diff_outs, grad_outputs) if live]
        tangents = []
        for i, t in enumerate(diff_outs):
            tangent = tracer.new_fake(TensorMeta.of(t).tangent())
            builder.placeholder(f"tangent_{i}", tangent).meta["tangent"] = True
            tangents.append(tangent)
        # the root's outputs only, and only when there are several (Note [Partial backward])
        root = grad_outputs is None and scope.region is None and len(diff_outs) > 1
        covered_by = _covered_by(diff_outs) if root else ()
        n_inputs = len(scope.values)
        wrt = [v for v in scope.values if isinstance(v, torch.Tensor) and v.requires_grad]
        try:
            with tracer.label_mode.uncounted():  # autograd's reads here are effectfx's, not the code's
                grads = torch.autograd.grad(diff_outs, wrt, tangents, allow_unused=True) if wrt else ()
        except RuntimeError as exc:
            if "use_reentrant=True" not in str(exc):
                raise CaptureError(
                    f"{where}: autograd failed while effectfx derived its backward, at capture (captured at "
                    f"{user_location()}): {str(exc).splitlines()[0]}\nEager raises such an error only at "
                    "backward() (a tensor saved for the backward updated in place afterwards, say); effectfx "
                    "derives the backward while capturing. Update a clone, or run the code under "
                    "torch.no_grad() when it needs no gradient."
                ) from exc
            raise UnsupportedOperatorError(
                f"{where} calls torch.utils.checkpoint with use_reentrant=True (captured at "
                f"{user_location()}): effectfx derives the backward with torch.autograd.grad, which "
                "reentrant checkpointing does not support. Pass use_reentrant=False, PyTorch's recommended "
                "setting."
            ) from None
        grad_nodes = [builder.node_of(tracer.to_fake(g)) if g is not None else None for g in grads]
        joint = builder.finish((*out_nodes, *grad_nodes), class_name)
        n_labels = len(scope.values)
        scope.finish_labels(joint.graph, layout)
        n_inputs -= n_labels - len(scope.values)
        out_deps, custom_autograd = ((), True) if scope.region is None else _reaches(tensors, scope.values)
    # inputs lifted while tracing backward are forward inputs too; they never receive a gradient
    grad_mask = tuple(_requires_grad(v) for v in scope.values[:n_inputs]) + (False,) * (
        len(scope.values) - n_inputs
    )
    input_meta = [_meta(v) for v in scope.values]
    rng.simplify(joint.graph)
    part = partition_joint(joint, len(out_nodes), pass_inputs=scope.region is not None)
    return TracedGraph(
        part.forward, part.backward, scope.sources, input_meta, spec, layout, out_meta,
        saved_meta=[_meta(n.meta["val"]) for n in part.saved],  # (None: a label the call site passes)
        saved_names=tuple(n.name for n in part.saved), saved_inputs=part.inputs,
        tangent_mask=tangent_mask, grad_mask=grad_mask,
        grad_meta=[TensorMeta.of(g) if g is not None else None for g in grads],
        mutated=tuple(scope.nodes.index(n) for n, _ in written), covered_by=covered_by,
        out_deps=out_deps, custom_autograd=custom_autograd,
    )
