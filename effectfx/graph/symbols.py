"""Symbolic sizes in a graph: each one is read from a dimension of one of the graph's own tensor inputs
(Note [Symbolic shapes]).

A size the trace computed (``x.shape[1] * 12``) is a ``SymInt`` whose expression is over the capture's
symbols; :class:`Sizes` turns it into nodes -- ``aten.sym_size.int`` of an input for each symbol, and the
expression's arithmetic over those, evaluated by ``torch.utils._sympy.interp`` (PyTorch's own evaluator of
size expressions, here on ``fx.Proxy`` values) -- once per expression per graph.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.interp import sympy_interp
from torch.utils._sympy.reference import PythonReferenceAnalysis

SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)
SYM_SIZE = torch.ops.aten.sym_size.int
# the Python targets of size arithmetic in a graph (what PythonReferenceAnalysis's operators make), by name
SIZE_TARGETS: dict[str, Any] = {
    **{f"operator.{name}": getattr(operator, name) for name in (
        "add", "sub", "mul", "floordiv", "mod", "truediv", "pow", "neg", "eq", "ne", "lt", "le", "gt", "ge",
        "and_", "or_")},
    **{f"torch.{name}": getattr(torch, name) for name in (
        "sym_max", "sym_min", "sym_not", "sym_float", "sym_int", "sym_ite")},
}


class _SizeArithmetic(PythonReferenceAnalysis):
    """PythonReferenceAnalysis with every handler a graph node of :data:`SIZE_TARGETS`: torch's own makes a
    sympy expression of ``int_truediv`` and ``trunc_to_int`` and calls ``math.floor`` / ``round`` on its
    operands, which on ``fx.Proxy`` values ask for a bool (``x.shape[0] / 2``, ``math.floor(n / 2)``,
    ``round(n / 3)`` in user code: test_dynamic_shapes.py, sizes as ints)."""

    @staticmethod
    def int_truediv(a: Any, b: Any) -> Any:
        return operator.truediv(a, b)

    @staticmethod
    def trunc_to_int(x: Any, dtype: Any) -> Any:
        return torch.sym_int(x)

    @staticmethod
    def floor(x: Any) -> Any:
        return x // 1  # (a float's floor, as a float)

    @staticmethod
    def ceil(x: Any) -> Any:
        return -((-x) // 1)

    @staticmethod
    def floor_to_int(x: Any, dtype: Any) -> Any:
        return torch.sym_int(x // 1)

    @staticmethod
    def ceil_to_int(x: Any, dtype: Any) -> Any:
        return torch.sym_int(-((-x) // 1))

    @staticmethod
    def round_to_int(a: Any, dtype: Any) -> Any:
        # Python's round: half to even -- floor(a + 0.5), less one where that was a tie to an odd number
        up = (a + 0.5) // 1
        n = torch.sym_int(up)
        return torch.sym_ite(operator.and_(up == a + 0.5, n % 2 == 1), n - 1, n)


def is_symbolic(value: Any) -> bool:
    """A size (or a number computed from sizes) that is not a constant."""
    return isinstance(value, SYM_TYPES) and value.node.maybe_as_int() is None and not value.node.is_constant()


def expr_of(value: Any) -> Any:
    """The expression of a symbolic value as its capture knows it now (equalities found while tracing
    replace one symbol by another), or the value itself."""
    if not isinstance(value, SYM_TYPES):
        return value
    node = value.node
    return node.shape_env.replace(node.expr) if node.shape_env is not None else node.expr


def dims(values: Iterable[Any]) -> tuple:
    """Sizes (or strides) as hashable values compared without guards: ints, or their expressions."""
    return tuple(v if type(v) is int else expr_of(v) for v in values)


def has_symbols(values: Iterable[Any]) -> bool:
    return any(type(v) is not int and is_symbolic(v) for v in values)


def hint(value: Any) -> Any:
    """The value a symbolic size has in the call it was captured for (the example)."""
    if not isinstance(value, SYM_TYPES):
        return value
    node = value.node
    return node.hint if node.hint is not None else node.shape_env.guarding_hint_or_throw(node.expr)


class MissingSize(Exception):
    """A size needs a symbol no tensor input of the graph has as a dimension."""

    def __init__(self, symbol: Any) -> None:
        super().__init__(str(symbol))
        self.symbol = symbol


class Sizes:
    """The nodes of one graph's symbolic sizes, from its tensor inputs' dimensions (``add_input``)."""

    def __init__(self, graph: fx.Graph, stamp: dict | None = None) -> None:
        self.graph = graph
        self.stamp = stamp if stamp is not None else {}  # metadata every new node gets (a builder's phase)
        self.inputs: list[tuple[fx.Node, torch.Tensor]] = []
        self.symbols: dict[Any, fx.Node] = {}
        self.exprs: dict[Any, Any] = {}
        self._tracer = fx.proxy.GraphAppendingTracer(graph)

    def add_input(self, node: fx.Node, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and has_symbols(tensor.shape):
            self.inputs.append((node, tensor))

    def source(self, symbol: Any) -> tuple[fx.Node, int] | None:
        """The input and dimension whose size is ``symbol``, if any."""
        for node, tensor in self.inputs:
            for d, size in enumerate(tensor.shape):
                if type(size) is not int and expr_of(size) == symbol:
                    return node, d
        return None

    def node(self, value: Any) -> Any:
        """A node computing ``value`` (a SymInt, SymFloat or SymBool), or its constant; raises MissingSize."""
        expr = expr_of(value)
        if not isinstance(expr, sympy.Basic) or expr.is_number:
            return value.node.pytype(expr) if isinstance(expr, sympy.Basic) else expr
        found = self.exprs.get(expr)
        if found is None:
            last = self.graph._root.prev
            env = {}
            for symbol in sorted(expr.free_symbols, key=str):
                env[symbol] = fx.Proxy(self._symbol(symbol), self._tracer)
            try:
                result = sympy_interp(_SizeArithmetic, env, expr)
            except (TypeError, NotImplementedError, fx.proxy.TraceError):
                # no node form (``round(n / 3, 2)``): the value, with a guard, as Python asking for it gets
                self._erase_after(last)
                return value.node.pytype(value)
            found = result.node if isinstance(result, fx.Proxy) else result
            node = last.next
            while node is not self.graph._root:
                node.meta.update(self.stamp)
                node = node.next
            if isinstance(found, fx.Node):
                found.meta["val"] = value
            self.exprs[expr] = found
        return found

    def _erase_after(self, last: fx.Node) -> None:
        made = []
        node = last.next
        while node is not self.graph._root:
            made.append(node)
            node = node.next
        for node in reversed(made):
            self.graph.erase_node(node)
        self.symbols = {k: n for k, n in self.symbols.items() if n not in made}

    def _symbol(self, symbol: Any) -> fx.Node:
        node = self.symbols.get(symbol)
        if node is None:
            where = self.source(symbol)
            if where is None:
                raise MissingSize(symbol)
            tensor_node, d = where
            node = self.graph.call_function(SYM_SIZE, (tensor_node, d))
            node.meta["val"] = next(t for n, t in self.inputs if n is tensor_node).shape[d]
            self.symbols[symbol] = node
        return node


class ShapeGuards:
    """A symbolic program's guards on its arguments' sizes, as torch's ShapeEnv writes them (Python over
    ``L['t<k>']``, the k-th tensor argument), compiled once and checked on a call's tensors."""

    def __init__(self, guards: tuple[str, ...]) -> None:
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        self.guards = guards
        self._globals = SYMPY_INTERP
        self._code = compile(" and ".join(f"({g})" for g in guards) or "True", "<shape guards>", "eval")

    def hold(self, tensors: list[torch.Tensor]) -> bool:
        return bool(eval(self._code, self._globals, {"L": {f"t{k}": t for k, t in enumerate(tensors)}}))

    def failed(self, tensors: list[torch.Tensor]) -> list[str]:
        scope = {"L": {f"t{k}": t for k, t in enumerate(tensors)}}
        return [g for g in self.guards if not eval(g, self._globals, scope)]
