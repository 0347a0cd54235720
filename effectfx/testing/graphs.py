"""Small FX graphs for the tests of how graphs run (``effectfx.graph.codegen``,
``effectfx.graph.interpreter``): a fixed sample with nested tuple results, and a hypothesis strategy of random
ones."""

from __future__ import annotations

import operator

import hypothesis.strategies as st
import torch
import torch.fx as fx

from ..graph.build import Graph

aten = torch.ops.aten


def _pair(x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    return x + 1, (x * 2, x - 3)


def sample_graph() -> fx.Graph:
    g = Graph()
    x = g.placeholder("x")
    call = g.call_function(_pair, (x,))
    first = g.call_function(operator.getitem, (call, 0))
    inner = g.call_function(operator.getitem, (call, 1))
    g.call_function(operator.getitem, (call, 1))  # unused: not bound
    a = g.call_function(operator.getitem, (inner, 0))
    b = g.call_function(operator.getitem, (inner, 1))
    s = g.call_function(aten.add.Tensor, (first, a), {"alpha": 2})
    g.call_function(aten.sum.dim_IntList, (s, [0], True))  # result unused: a bare call
    g.output((s, b, float("inf")))
    return g


_OPS = [aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.maximum.default]


@st.composite
def random_graphs(draw: st.DrawFn) -> tuple[fx.Graph, int]:
    """A random graph of binary ops and tuple-valued calls whose items are taken in any order."""
    g = Graph()
    n_inputs = draw(st.integers(1, 3))
    values = [g.placeholder(f"x{i}") for i in range(n_inputs)]
    for _ in range(draw(st.integers(1, 12))):
        if draw(st.booleans()):
            op = draw(st.sampled_from(_OPS))
            values.append(g.call_function(op, (draw(st.sampled_from(values)), draw(st.sampled_from(values)))))
        else:
            call = g.call_function(_pair, (draw(st.sampled_from(values)),))
            for k in draw(st.lists(st.integers(0, 1), max_size=3)):
                item = g.call_function(operator.getitem, (call, k))
                if k == 1:  # a tuple inside the tuple
                    item = g.call_function(operator.getitem, (item, draw(st.integers(0, 1))))
                values.append(item)
    outs = draw(st.lists(st.sampled_from(values), min_size=1, max_size=4))
    g.output(tuple(outs))
    return g, n_inputs
