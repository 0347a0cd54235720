"""A Dynamo graph's inputs as effectfx takes them: its symbolic sizes symbolic, its numbers plain (Note
[Dynamo backend], "Dynamic sizes").

Under ``torch.compile(dynamic=True)``, or once automatic dynamic made a size dynamic, Dynamo's graph takes
each symbol of its sizes as a ``SymInt`` placeholder, which the graph's caller passes as a plain ``int``;
and it takes a float Dynamo did not specialize (``specialize_float=False``: a module's ``eps``, a dropout
``p``) as a 0-dim tensor the graph turns back into a number with ``.item()``.  effectfx keys a number
argument by value and cannot ``.item()`` a fake, so as they come, every length would be a capture of its
own and the floats would be refused.  :func:`effectfx_inputs` rewrites the graph so that:

- a size that is also a dimension of a tensor input (a sequence length: ``input_ids.size(1)``) is no input:
  the graph reads it from that dimension (``x.size(d)``), and that dimension is symbolic from the first
  capture (:attr:`~effectfx.capture.shapes.ShapeCache.declared`) -- as effectfx reads every size it needs
  from a tensor input (Note [Symbolic shapes], "Sizes are read, never passed");
- a size no tensor input has (an ``int`` argument Dynamo made dynamic) is passed as a *carrier*, an empty
  tensor of shape ``(n, 0)`` (nothing allocated) whose symbolic dimension 0 the graph reads;
- a float passed as a tensor is passed as the float again, its ``.item()`` is the float itself, and any
  other use of it a ``torch.scalar_tensor`` of it: a number, specialized by value as effectfx specializes
  floats passed to a compiled function (Note [Float inputs]).

Every other dimension Dynamo made symbolic (from its example inputs' fake tensors) is declared symbolic too,
so one effectfx capture serves every size one Dynamo graph serves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ..capture.shapes import Dynamic

_ITEM = {"item", torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}  # x.item()


@dataclass(frozen=True)
class Inputs:
    """How a call's arguments become the rewritten graph's: positions dropped (sizes read from a tensor),
    made carriers, or turned back into numbers; and the symbolic dimensions of the tensors it takes."""

    dropped: frozenset[int]
    carriers: frozenset[int]
    numbers: frozenset[int]
    dynamic: Dynamic

    def adapt(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """``run`` (the compiled rewritten graph) as Dynamo calls the original graph."""
        if not (self.dropped or self.carriers or self.numbers):
            return run
        dropped, carriers, numbers = self.dropped, self.carriers, self.numbers

        def call(*args: Any) -> Any:
            out = []
            for i, a in enumerate(args):
                if i in dropped:
                    continue
                if i in carriers:
                    a = torch.empty((a, 0))
                elif i in numbers:
                    a = a.item()
                out.append(a)
            return run(*out)

        call.compiled = run  # type: ignore[attr-defined]  # (what it calls: efx.explain, stats)
        return call


def _example(node: fx.Node, example: Any) -> Any:
    return node.meta.get("example_value", example)


def _symbol(value: Any) -> Any:
    """The sympy symbol a size is, or None (a number, or an expression of several)."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return expr if expr.is_Symbol else None
    return None


def _passed_as_tensor(node: fx.Node) -> bool:
    arg = node.meta.get("grapharg")
    return bool(getattr(arg, "pass_arg_as_tensor", False))


def effectfx_inputs(gm: fx.GraphModule, example_inputs: list[Any]) -> tuple[fx.GraphModule, Inputs]:
    """``gm`` rewritten as the module docstring says (a copy: Dynamo reads the arguments it passes from
    its graph's placeholders), and how to call it."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    examples = [_example(n, e) for n, e in zip(placeholders, example_inputs)]
    first = next((n for n in graph.nodes if n.op != "placeholder"), None)
    # where each symbol can be read: the first tensor input dimension that is that symbol
    found: dict[Any, tuple[fx.Node, int]] = {}
    for node, value in zip(placeholders, examples):
        if isinstance(value, torch.Tensor) and not _passed_as_tensor(node):
            for d, size in enumerate(value.shape):
                symbol = _symbol(size)
                if symbol is not None:
                    found.setdefault(symbol, (node, d))
    dropped, carriers, numbers = set(), set(), set()
    for i, (node, value) in enumerate(zip(placeholders, examples)):
        if isinstance(value, torch.SymInt):
            symbol = _symbol(value)
            with graph.inserting_before(first):
                if symbol in found:
                    tensor, d = found[symbol]
                    size = graph.call_method("size", (tensor, d))
                    dropped.add(i)
                else:
                    size = graph.call_method("size", (node, 0))
                    carriers.add(i)
            node.replace_all_uses_with(size, delete_user_cb=lambda user, size=size: user is not size)
            if i in dropped:
                graph.erase_node(node)
        elif isinstance(value, torch.Tensor) and _passed_as_tensor(node):
            numbers.add(i)
            items = [u for u in node.users if u.target in _ITEM]
            if len(items) < len(node.users):  # used as a tensor too: a tensor of the number
                with graph.inserting_after(node):
                    tensor = graph.call_function(torch.scalar_tensor, (node,), {"dtype": value.dtype})
                keep = {tensor, *items}
                node.replace_all_uses_with(tensor, delete_user_cb=lambda user, keep=keep: user not in keep)
            for item in items:
                item.replace_all_uses_with(node)
                graph.erase_node(item)
    # the symbolic dimensions of the tensors the rewritten graph takes, by its argument positions
    dynamic: Dynamic = {}
    kept = [i for i in range(len(placeholders)) if i not in dropped]
    for position, i in enumerate(kept):
        value = examples[i]
        if i in carriers:
            dynamic[position] = frozenset({0})
        elif isinstance(value, torch.Tensor) and i not in numbers:
            dims = frozenset(d for d, size in enumerate(value.shape) if isinstance(size, torch.SymInt)
                             and size.node.expr.free_symbols)
            if dims:
                dynamic[position] = dims
    inputs = Inputs(frozenset(dropped), frozenset(carriers), frozenset(numbers), dynamic)
    if not (dropped or carriers or numbers):
        return gm, inputs
    rewritten = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    rewritten.meta.update(gm.meta)
    return rewritten, inputs
