"""effectfx.graph.codegen: the code graphs run computes what FX's code computes, and releases values as
it does."""

from __future__ import annotations

import operator
import textwrap

import hypothesis.strategies as st
import torch
import torch.fx as fx
from hypothesis import given, settings

from effectfx.graph.build import Graph, graph_module
from effectfx.graph.codegen import runtime_code
from effectfx.testing.graphs import sample_graph

aten = torch.ops.aten


def test_golden_lean_code() -> None:
    code = runtime_code(sample_graph(), direct=True)
    assert code is not None
    assert code.src.strip() == textwrap.dedent("""\
        def forward(self, x):
            getitem, getitem_1 = _g1_items(_g0__pair(x))
            getitem_3 = getitem_1[0]
            getitem_4 = getitem_1[1]; getitem_1 = None
            add_tensor = _g2_op_add(getitem, getitem_3, alpha=2); getitem = getitem_3 = None
            _g3_op_sum(add_tensor, [0], True)
            return (add_tensor, getitem_4, _g4_float)""")
    assert code.globals["_g2_op_add"] is aten.add.Tensor._op  # direct: the operator's C++ entry point


def test_lean_and_fx_code_agree() -> None:
    graph = sample_graph()
    gm = graph_module(torch.nn.Module(), graph, "Sample")
    x = torch.randn(3)
    lean = gm(x)
    assert "_g0__pair" in gm.code  # the module runs the lean code ...
    fx_gm = fx.GraphModule(torch.nn.Module(), graph)  # ... and FX's code computes the same
    expected = fx_gm(x)
    assert all(torch.equal(a, b) for a, b in zip(lean[:2], expected[:2])) and lean[2] == expected[2]


def test_graphs_it_cannot_write_go_to_fx() -> None:
    root = torch.nn.Module()
    root.lin = torch.nn.Linear(2, 2)
    g = Graph()
    x = g.placeholder("x")
    g.output(g.call_module("lin", (x,)))
    assert runtime_code(g, direct=False) is None
    gm = graph_module(root, g, "WithModule")
    assert "self.lin(x)" in gm.code
    x = torch.randn(1, 2)
    assert torch.equal(gm(x), root.lin(x))


def test_slices_constants_and_a_parameter_named_self() -> None:
    g = Graph()
    x = g.placeholder("x")
    part = g.call_function(operator.getitem, (x, slice(1, None, None)))
    scaled = g.call_function(aten.mul.Tensor, (part, float("-inf")))
    g.output((scaled, torch.float32))
    gm = graph_module(torch.nn.Module(), g, "Sliced")
    x = torch.tensor([1.0, 2.0, 3.0])
    out, dtype = gm(x)
    assert torch.equal(out, x[1:] * float("-inf")) and dtype is torch.float32
    assert "_float" in gm.code and " slice(" not in gm.code and "[slice(" not in gm.code  # bound as globals

    g = Graph()
    me = g.placeholder("self")  # the generated method's own first parameter: left to FX's generator
    g.output(g.call_function(aten.neg.default, (me,)))
    assert runtime_code(g, direct=False) is None


_CANDIDATES = ["relu", "getitem", "getitem_1", "getitem_5", "x", "x1", "sum", "list", "class", "None", "a_b",
               "a_b_2", "_2", "2x", "bad name", "Ab", "__spec__", "self", "relu_1"]


@given(st.lists(st.sampled_from(_CANDIDATES), max_size=40))
@settings(max_examples=100, deadline=None)
def test_node_names_are_fx_names(candidates: list[str]) -> None:
    """effectfx's graphs name nodes through a faster namespace: every name is the one FX would give."""
    ours, theirs = Graph(), fx.Graph()
    for candidate in candidates:
        assert (ours._graph_namespace.create_name(candidate, None)
                == theirs._graph_namespace.create_name(candidate, None))
