"""effectfx.graph.interpreter: a graph's first runs are interpreted, then its code runs; both compute the same
values, perform the same effects in the same order, and release values after their last use."""

from __future__ import annotations

import copy
import gc
import operator
import pickle
import textwrap
import weakref

import hypothesis.strategies as st
import torch
import torch.fx as fx
from hypothesis import given, settings

import effectfx as efx
from effectfx.graph.build import GraphModule, graph_module
from effectfx.graph.codegen import runtime_code
from effectfx.graph.interpreter import INTERPRETED_RUNS, steps_for
from effectfx.testing.effect_ops import recording
from effectfx.testing.graphs import random_graphs, sample_graph
from effectfx.testing.models import Stack

aten = torch.ops.aten


def _runs_code(gm: fx.GraphModule) -> bool:
    return type(gm).forward is not GraphModule._lazy_forward


def test_golden_steps() -> None:
    steps = steps_for(sample_graph(), direct=True)
    assert steps is not None
    assert steps.describe() == textwrap.dedent("""\
        getitem, getitem_1 = _pair(x)
        getitem_3 = getitem(getitem_1, 0)
        getitem_4 = getitem(getitem_1, 1)  # release getitem_1
        add_tensor = aten.add.Tensor(getitem, getitem_3, alpha=2)  # release getitem, getitem_3
        sum_dim_int_list = aten.sum.dim_IntList(add_tensor, [0], True)  # release sum_dim_int_list
        return (add_tensor, getitem_4, inf)""")


def test_first_runs_interpreted_then_code() -> None:
    gm = graph_module(torch.nn.Module(), sample_graph(), "Sample")
    x = torch.randn(3)
    expected = fx.GraphModule(torch.nn.Module(), sample_graph())(x)
    for run in range(INTERPRETED_RUNS + 2):
        assert _runs_code(gm) == (run > INTERPRETED_RUNS)  # generated on the run after the interpreted ones
        out = gm(x)
        assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1]) and out[2] == expected[2]
    assert _runs_code(gm)
    fresh = graph_module(torch.nn.Module(), sample_graph(), "Sample")
    fresh(x)
    assert not _runs_code(fresh)  # a graph run once never generated its code


def test_a_changed_graph_is_interpreted_anew() -> None:
    gm = graph_module(torch.nn.Module(), sample_graph(), "Sample")
    x = torch.randn(3)
    gm(x)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        neg = gm.graph.call_function(aten.neg.default, (out.args[0][0],))
    out.args = ((neg, *out.args[0][1:]),)
    gm.recompile()
    assert torch.equal(gm(x)[0], -fx.GraphModule(torch.nn.Module(), sample_graph())(x)[0])
    assert not _runs_code(gm)


def test_a_module_run_once_is_freed() -> None:
    gm = graph_module(torch.nn.Module(), sample_graph(), "Sample")
    gm(torch.randn(3))
    assert not _runs_code(gm)
    dead = weakref.ref(gm)
    del gm
    gc.collect()
    assert dead() is None  # nothing outside the module keeps its steps, or the module


def test_copies_and_pickles_of_an_interpreted_module() -> None:
    gm = graph_module(torch.nn.Module(), sample_graph(), "Sample")
    x = torch.randn(3)
    expected = gm(x)
    for other in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        got = other(x)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@given(random_graphs(), st.booleans())
@settings(max_examples=60, deadline=None)
def test_random_graphs_run_as_fx_computes_in_both_tiers(case: tuple[fx.Graph, int], direct: bool) -> None:
    """The steps and the lean code (effectfx.graph.codegen) each compute what FX's own code computes."""
    graph, n_inputs = case
    steps, code = steps_for(graph, direct), runtime_code(graph, direct)
    assert steps is not None and code is not None
    namespace = dict(code.globals)
    exec(compile(code.src, "<lean>", "exec"), namespace)  # noqa: S102
    inputs = [torch.randn(3) for _ in range(n_inputs)]
    expected = fx.GraphModule(torch.nn.Module(), graph)(*inputs)
    for got in (steps(torch.nn.Module(), tuple(inputs)), namespace["forward"](None, *inputs)):
        assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


_SEEN: list[weakref.ref] = []


def _keep(x: torch.Tensor) -> torch.Tensor:
    out = x + 1
    _SEEN.append(weakref.ref(out))
    return out


def _alive(x: torch.Tensor) -> bool:
    return _SEEN[-1]() is not None


def test_values_released_after_last_use() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    kept = g.call_function(_keep, (x,))
    doubled = g.call_function(aten.mul.Tensor, (kept, 2))  # the last use of ``kept``
    g.output((g.call_function(_alive, (doubled,)), doubled))
    steps = steps_for(g, direct=True)
    assert steps is not None
    alive, _ = steps(torch.nn.Module(), (torch.randn(2),))
    assert alive is False  # released before the next node ran, as the generated code does


def test_graphs_with_modules_or_node_lists_run_their_code() -> None:
    root = torch.nn.Module()
    root.lin = torch.nn.Linear(2, 2)
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_module("lin", (x,)))
    assert steps_for(g, direct=False) is None
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(aten.cat.default, ([x, x],)))  # a list built from nodes on every run
    assert steps_for(g, direct=False) is None
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(aten.view.default, (x, [2, 2])))  # a constant list an operator only reads
    assert steps_for(g, direct=True) is not None


def test_compiled_stack_is_eager_equal_in_every_tier() -> None:
    torch.manual_seed(0)
    model = Stack(n=3, width=4, done=True)
    compiled = efx.compile(model)
    x = torch.randn(2, 4, requires_grad=True)
    with recording() as eager_log:
        expected = model(x)
        expected.sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    for _ in range(INTERPRETED_RUNS + 2):  # interpreted runs, then the runs of the generated code
        model.zero_grad()
        with recording() as log:
            out = compiled(x)
            out.sum().backward()
        assert log == eager_log
        assert torch.equal(out, expected)
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), eager_grads))
    program = compiled.programs()[0]
    assert _runs_code(program.forward.graph_module) and _runs_code(program.backward.graph_module)


def test_constants_equal_as_python_values_stay_apart() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(tuple(g.call_function(aten.mul.Tensor, (x, c)) for c in (0.0, -0.0, 1, True, 1.0)))
    steps = steps_for(g, direct=True)
    assert steps is not None
    x = torch.tensor([-1.0, 2.0])
    expected = fx.GraphModule(torch.nn.Module(), g)(x)
    got = steps(torch.nn.Module(), (x,))
    assert all(torch.equal(a, b) and a.dtype == b.dtype and str(a) == str(b) for a, b in zip(got, expected))


def test_getitem_of_a_tuple_output() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    pair = g.call_function(torch.ops.aten.var_mean.correction, (x,), {"correction": 0})
    g.output((g.call_function(operator.getitem, (pair, 1)),))
    steps = steps_for(g, direct=True)
    assert steps is not None
    x = torch.randn(4)
    assert torch.equal(steps(torch.nn.Module(), (x,))[0], fx.GraphModule(torch.nn.Module(), g)(x)[0])
