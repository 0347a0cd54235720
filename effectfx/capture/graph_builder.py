"""GraphBuilder: one FX graph under construction, and the map from traced tensors to its nodes."""

from __future__ import annotations

import enum
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..errors import CaptureError
from ..graph.build import Graph, graph_module, node_name
from ..graph.symbols import SYM_TYPES, MissingSize, Sizes
from ..graph.traced import SourceKind

# argument values FX writes into generated code as literals; anything else (a torchbind object, a
# ProcessGroup, a Generator) would be written as its repr -- ``<torch.ScriptObject object at 0x..>``, a
# SyntaxError at the first call -- so it becomes a constant of the program, read through get_attr
_LITERAL_TYPES = frozenset({fx.Node, int, float, bool, str, complex, type(None), torch.dtype, torch.device,
                            torch.layout, torch.memory_format, slice, type(Ellipsis), torch.Size})
_LITERAL_BASES = (fx.Node, int, float, str, torch.dtype, enum.Enum, type, types.FunctionType,
                  types.BuiltinFunctionType, torch._ops.OperatorBase)


def _opaque(value: Any) -> bool:
    kind = type(value)
    if kind in _LITERAL_TYPES:
        return False
    if kind is list or kind is tuple:
        return _any_opaque(value)
    if kind is dict:
        return _any_opaque(value.values())
    return not isinstance(value, _LITERAL_BASES)


def _any_opaque(values: Any) -> bool:
    # on every node's arguments: a loop with the common case inline is ~4x cheaper than any(generator)
    for v in values:
        if type(v) not in _LITERAL_TYPES and _opaque(v):
            return True
    return False


class GraphBuilder:
    """Builds one graph (the root, or one region body).

    ``values`` maps ``id(fake tensor)`` to the node that produces it in *this* graph; tensors of other
    graphs are unknown here and must be lifted (Note [Region identity]).  ``lift`` is asked for a node
    when an unknown tensor shows up, and raises if the tensor may not be lifted.  ``lift_real`` makes the
    input of a real tensor read by identity (a module's parameter a call site passes), and ``labels`` are
    a region body's labels (``effectfx.guards.labels.BodyLabels``; None for graphs that bake every string
    in): both given by the graph's scope (``effectfx.capture.trace.Scope``).
    """

    def __init__(self, name: str, lift: Callable[[torch.Tensor], fx.Node],
                 lift_real: Callable[[torch.Tensor], fx.Node] | None = None, labels: Any = None) -> None:
        self.name = name
        self.lift_real = lift_real
        self.labels = labels
        self.graph = Graph()
        self.values: dict[int, fx.Node] = {}
        self.keepalive: list[torch.Tensor] = []
        self.phase = "forward"
        self.lift = lift
        self.attrs: dict[int, fx.Node] = {}
        self.constants: dict[int, fx.Node] = {}  # id(opaque object) -> its get_attr node
        self.holder = torch.nn.Module()
        self._placeholders_end: fx.Node | None = None
        self._input_names: set[str] = set()
        self.sizes = Sizes(self.graph)  # its symbolic sizes, read from its inputs (Note [Symbolic shapes])

    def bind(self, tensor: torch.Tensor, node: fx.Node) -> None:
        self.values[id(tensor)] = node
        self.keepalive.append(tensor)
        node.meta.setdefault("val", tensor)

    def node_of(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            node = self.values.get(id(value))
            if node is None:
                node = self.lift(value)
                self.bind(value, node)
            return node
        if isinstance(value, SYM_TYPES):
            return self.size(value)
        return value

    def size(self, value: Any) -> Any:
        """The node of a symbolic size in this graph (or its constant): Note [Symbolic shapes]."""
        self.sizes.stamp["phase"] = self.phase
        try:
            return self.sizes.node(value)
        except MissingSize as missing:
            raise CaptureError(
                f"the graph {self.name!r} uses the size {missing.symbol} (as {value}), which none of its "
                "tensor inputs has as a dimension (a region whose operands' sizes are sums or products of "
                "the sizes it computes with?): effectfx reads every size of a graph from its inputs "
                "(Note [Symbolic shapes]). Pass a tensor with that size to the region, or compile with "
                "dynamic=False."
            ) from None

    def placeholder(self, name: str, value: Any) -> fx.Node:
        # a placeholder's target is its parameter name in the generated code: it must be unique
        base, n = name, 0
        while name in self._input_names:
            n += 1
            name = f"{base}_{n}"
        self._input_names.add(name)
        # placeholders must precede every other node, even when lifted in the middle of a trace
        # (named explicitly: FX would derive the name from the target through a regex)
        if self._placeholders_end is None:
            node = self.graph.create_node("placeholder", name, name=name)
        else:
            with self.graph.inserting_after(self._placeholders_end):
                node = self.graph.create_node("placeholder", name, name=name)
        self._placeholders_end = node
        node.meta["phase"] = self.phase
        if isinstance(value, torch.Tensor):
            self.bind(value, node)
            self.sizes.add_input(node, value)
        return node

    def describe_input(self, node: fx.Node) -> str:
        """The user's name for the graph input ``node``: "the argument 'x'", "the buffer 'bn.running_mean'"
        (for error messages; the inputs' sources are kept by the Scope whose ``lift`` this builder calls)."""
        scope = getattr(self.lift, "__self__", None)
        inputs = [n for n in self.graph.nodes if n.op == "placeholder"]
        sources, values = getattr(scope, "sources", ()), getattr(scope, "values", ())
        i = inputs.index(node) if node in inputs else len(sources)
        if i >= min(len(sources), len(values)):
            return f"the input {node.target!r}"
        source, value = sources[i], values[i]
        if source.kind is SourceKind.ARG:
            return f"the argument {node.target!r}"
        module = source.kind is SourceKind.MODULE
        name = source.name if module else getattr(scope, "param_names", {}).get(id(value))
        if name is None:
            return f"the tensor {node.target!r} read from outside (a global or closed-over constant)"
        return f"the {'parameter' if isinstance(value, torch.nn.Parameter) else 'buffer'} {name!r}"

    def call(self, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        if _any_opaque(args) or (kwargs and _any_opaque(kwargs.values())):
            args, kwargs = fx.node.map_aggregate((args, kwargs), self._constant_or_literal)
        node = self.graph.create_node("call_function", target, args, kwargs or {}, name=node_name(target))
        node.meta["phase"] = self.phase
        return node

    def _constant_or_literal(self, value: Any) -> Any:
        if not _opaque(value):
            return value
        if isinstance(value, SYM_TYPES):
            return self.size(value)
        node = self.constants.get(id(value))
        if node is None:
            # torch.export's name for torchbind objects; kept alive by the holder, shared by every use
            stem = "_torchbind_obj" if isinstance(value, torch.ScriptObject) else "_constant"
            name = f"{stem}{len(self.constants)}"
            setattr(self.holder, name, value)
            node = self.constants[id(value)] = self.graph.get_attr(name)
            node.meta["phase"] = self.phase
        return node

    def get_attr(self, module: torch.nn.Module, base_name: str) -> fx.Node:
        """The get_attr node of a subgraph: one per subgraph per graph, shared by all its call sites."""
        node = self.attrs.get(id(module))
        if node is None:
            setattr(self.holder, base_name, module)
            node = self.attrs[id(module)] = self.graph.get_attr(base_name)
            node.meta["phase"] = self.phase
        return node

    def finish(self, outputs: tuple, class_name: str) -> fx.GraphModule:
        self.graph.output(tuple(outputs))
        return graph_module(self.holder, self.graph, class_name)
