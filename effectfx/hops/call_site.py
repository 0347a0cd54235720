"""A region's call site in the calling graph: its operands' nodes, the ``invoke_subgraph`` node and its
results (Note [Joint trace]: a call site is cheap by construction), and what its backward may need to trace
the body again (:class:`CallSite`, Note [Partial backward])."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from .. import ops
from ..capture.tracer import Tracer
from ..graph.traced import TensorMeta
from ..guards.identity import leaf_of_key
from ..guards.labels import raw


def operand_node(tracer: Tracer, value: Any) -> Any:
    """The node of a call site's operand in the current graph; a real tensor (a module's parameter) is
    lifted as it is, without a fake (``Scope.lift_real``)."""
    builder = tracer.builder
    if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
        if builder.lift_real is not None and id(value) not in tracer.fake_of:
            return builder.values.get(id(value)) or builder.lift_real(value)
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
    labels = builder.labels
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
