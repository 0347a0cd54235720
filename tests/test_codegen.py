"""effectfx.codegen: the code graphs run computes what FX's code computes, and releases values as it does."""

from __future__ import annotations

import operator
import textwrap

import hypothesis.strategies as st
import torch
import torch.fx as fx
from hypothesis import given, settings

from effectfx.codegen import runtime_code
from effectfx.graphs import Graph, graph_module

aten = torch.ops.aten


def _pair(x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    return x + 1, (x * 2, x - 3)


def _sample_graph() -> fx.Graph:
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


def test_golden_lean_code() -> None:
    code = runtime_code(_sample_graph(), direct=True)
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
    graph = _sample_graph()
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


_OPS = [aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.maximum.default]


@st.composite
def _graphs(draw: st.DrawFn) -> tuple[fx.Graph, int]:
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


@given(_graphs(), st.booleans())
@settings(max_examples=60, deadline=None)
def test_random_graphs_compute_what_fx_computes(case: tuple[fx.Graph, int], direct: bool) -> None:
    graph, n_inputs = case
    code = runtime_code(graph, direct)
    assert code is not None
    namespace = dict(code.globals)
    exec(compile(code.src, "<lean>", "exec"), namespace)  # noqa: S102
    inputs = [torch.randn(3) for _ in range(n_inputs)]
    expected = fx.GraphModule(torch.nn.Module(), graph)(*inputs)
    got = namespace["forward"](None, *inputs)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


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
