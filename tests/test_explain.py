"""``efx.explain``: why each body was traced, effect keys per region, graph sizes, stage times, and the
same for every cached program of an ``efx.compile``d callable."""

from __future__ import annotations

import re

import torch

import effectfx as efx
from effectfx.explanation import Explanation, key_differences
from effectfx.testing import recording

# the efxtest:: ops (registered by effectfx.testing): record_memory ("memory"), log_tensor ("stdout"),
# scale (pure forward; its backward records on "memory")
_ops = torch.ops.efxtest


@efx.region
def inner(x):
    _ops.log_tensor(x, "inner")
    return x.sin()


@efx.region
def scaled(x, n):
    _ops.record_memory(f"scaled {n}")
    return inner(x) * n


@efx.region
def pure(x):
    return x.cos()


def two_values(x):
    return scaled(scaled(x, 2), 3) + pure(x) + pure(x)


def test_reason_names_the_differing_argument() -> None:
    e = efx.explain(two_values, torch.randn(3))
    assert isinstance(e, Explanation)
    bodies = [b for b in e.bodies if b.region == "scaled"]
    assert len(bodies) == 2
    first, second = bodies
    assert first.reason == "first body of region 'scaled'" and not first.new
    assert second.differences == ("argument 'n': 2 -> 3",)
    assert second.reason == f"argument 'n': 2 -> 3 (vs {first.identifier})"
    assert second.compared_with == first.identifier
    # regions found, bodies and calls
    assert set(e.regions) == {"scaled", "inner", "pure"}
    assert len(e.regions["inner"].bodies) == 1 and e.regions["inner"].calls == 2
    assert e.regions["pure"].calls == 2
    text = str(e)
    assert "scaled: 2 bodies, 2 calls" in text and "inner: 1 body, 2 calls" in text
    assert "regions: 3 regions, 4 bodies, 6 calls" in text and "(ies)" not in text and "(s)" not in text
    assert f"why: argument 'n': 2 -> 3 (vs {first.identifier})" in text
    assert "region 'scaled' got 2 bodies for 2 calls (differing: argument 'n')" in text


def test_reason_names_requires_grad_and_shape() -> None:
    def f(x, y, z):
        return inner(x) + inner(y) + inner(z).sum()

    e = efx.explain(f, torch.randn(3), torch.randn(3, requires_grad=True), torch.randn(4))
    bodies = e.regions["inner"].bodies
    assert [b.differences for b in bodies] == [
        (), ("x: requires_grad False -> True",), ("x: shape [3] -> [4]",)]
    # a training program: the body with a grad input has a backward subgraph, the others do not
    assert e.programs[0].training
    assert bodies[1].backward_nodes is not None and bodies[0].backward_nodes is None


def test_reason_names_module_state() -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.drop = torch.nn.Dropout(0.0)

        @efx.region
        def forward(self, x):
            return self.drop(self.lin(x)).relu()

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    net = Net()
    net.blocks[2].eval()
    with torch.no_grad():
        e = efx.explain(net, torch.randn(2, 4))
    bodies = e.regions["Block.forward"].bodies
    assert len(bodies) == 2 and bodies[0].calls == 2 and bodies[1].calls == 1
    # only what the body read: Dropout reads its training flag, Block and Linear never look at theirs
    assert set(bodies[1].differences) == {"self.drop.training: True -> False"}


def test_effect_keys_per_region() -> None:
    def f(x):
        return scaled(_ops.scale(pure(x), 2.0), 2)

    e = efx.explain(f, torch.randn(3, requires_grad=True))
    assert e.region_effects() == {"scaled": ("memory", "stdout"), "inner": ("stdout",), "pure": ()}
    assert e.regions["scaled"].forward_effects == ("memory", "stdout")
    assert e.regions["scaled"].backward_effects == ()
    assert "forward effects: memory, stdout; backward effects: -" in str(e)

    @efx.region
    def grad_effect(x):
        return _ops.scale(x, 3.0)

    e = efx.explain(lambda x: grad_effect(x), torch.randn(3, requires_grad=True))
    region = e.regions["grad_effect"]
    assert region.forward_effects == () and region.backward_effects == ("memory",)
    assert e.programs[0].token_keys == ()


def test_graph_sizes_and_stages() -> None:
    x = torch.randn(3)
    e = efx.explain(two_values, x)
    prog = efx.capture(two_values, x)
    report = e.programs[0]
    sizes = {g.graph: g for g in report.graphs}
    assert sizes["root"].nodes == len(prog.graph_module.graph.nodes)
    for attr, gm in prog.subgraphs().items():
        assert sizes[attr].nodes == len(gm.graph.nodes)
    scaled_graph = next(g for g in report.graphs if g.graph.startswith("scaled"))
    assert scaled_graph.effects == 1 and scaled_graph.region_calls == 1
    assert sizes["root"].region_calls == 4
    assert [s.name for s in report.stages] == ["capture", "thread_tokens"]
    assert all(s.seconds >= 0 for s in report.stages)
    text = str(e)
    assert "time per stage:" in text and "thread_tokens" in text and "graphs:" in text
    # columns line up: every row of a table has its numbers ending in the same column
    lines = text.splitlines()
    stages = lines[lines.index("  time per stage:") + 1:]
    stages = stages[:next(i for i, line in enumerate(stages) if line.lstrip().startswith("total")) + 1]
    assert len(stages) == 3 and len({len(line) for line in stages}) == 1 and stages[-1].endswith(" ms")
    graphs = lines[lines.index("  graphs:") + 1:lines.index("  time per stage:")]
    assert graphs[0].split() == ["graph", "nodes", "ops", "effects", "region", "calls", "region"]
    ends = {line.index(" ms") if " ms" in line else None for line in graphs}
    assert ends == {None}
    column = graphs[0].index("effects") + len("effects")  # right-aligned under their header
    assert all(line[column - 1].isdigit() for line in graphs[1:])


def test_explain_does_not_run_effects() -> None:
    with recording() as log:
        efx.explain(two_values, torch.randn(3))
    assert log == []


def test_explain_a_program() -> None:
    prog = efx.capture(two_values, torch.randn(3))
    e = efx.explain(prog)
    assert [b.differences for b in e.bodies if b.region == "scaled"][1] == ("argument 'n': 2 -> 3",)


def test_explain_compiled_callable() -> None:
    def f(x, n):
        return scaled(x, n) + scaled(x, n + 1)

    cf = efx.compile(f)
    with recording() as log:
        cf(torch.randn(3), 1)
        cf(torch.randn(3), 1)
        cf(torch.randn(5), 1)
        cf(torch.randn(5, requires_grad=True), 1)
    assert len(log) == 16  # 4 calls x 2 regions x (record_memory + log_tensor)
    e = efx.explain(cf)
    assert e.compiled and e.compiles == 3 and e.calls == 4
    assert len(e.programs) == 3
    first, second, third = e.programs
    assert first.why == "first call"
    # a call that differs only in sizes captures them symbolic (Note [Symbolic shapes])
    assert second.why == ("x: shape [3] -> [5] (vs signature 1); symbolic sizes (automatic dynamic: sizes "
                          "changed)")
    assert len(second.symbolic) == 1 and re.fullmatch(r"x float32\[s\d+\]", second.symbolic[0])
    assert "2 <= x.size()[0]" in second.shape_guards
    assert first.symbolic == () and first.shape_guards == ()
    assert third.why == "x: requires_grad False -> True (vs signature 2)"
    assert third.training and not first.training
    # inside each program, bodies are explained as for a capture
    assert [b.differences for b in first.regions[0].bodies] == [(), ("argument 'n': 1 -> 2",)]
    text = str(e)
    assert "efx.compile(f)" in text and "3 compiled signatures, 4 calls so far" in text
    assert "why: x: shape [3] -> [5] (vs signature 1)" in text

    # with arguments: compiles that signature (runs nothing), then explains every cached program
    with recording() as log:
        e = efx.explain(cf, torch.randn(3), 7)
    assert log == []
    assert len(e.programs) == 4
    assert e.programs[-1].why == "argument 'n': 1 -> 7 (vs signature 1)"


class Wrapper(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.0)
        self.unused_flag = True  # never read by forward: flipping it must not recompile

    def forward(self, x):
        return self.drop(self.lin(x))


def test_explain_compiled_module_grad_mode() -> None:
    net = Wrapper()
    cnet = efx.compile(net)
    cnet(torch.randn(2, 4))
    with torch.no_grad():
        cnet(torch.randn(2, 4))
    net.eval()
    with torch.no_grad():
        cnet(torch.randn(2, 4))
    e = efx.explain(cnet)
    whys = [p.why for p in e.programs]
    assert whys[1] == "grad mode: enabled -> disabled (vs signature 1)"
    # a guard failed: only Dropout reads its training flag
    assert whys[2] == ("Wrapper.drop.training: True -> False "
                       "(vs signature 2: a value its capture read changed)")
    net.unused_flag = False
    with torch.no_grad():
        cnet(torch.randn(2, 4))
    assert cnet.stats.compiles == 3
    assert "no regions" not in str(e) and "(none: mark a repeated function" in str(e)


def test_key_differences_direct() -> None:
    labels = ("ambient", "argument structure", "x", "flag")
    spec = object()
    on, off = (True, None, None), (False, None, None)
    assert key_differences((on, spec, (bool, True)), (off, spec, (bool, True)), labels[:3],
                           labels[:3]) == ["grad mode: enabled -> disabled"]
    three = ("ambient", "argument structure", "x")
    assert key_differences((on, spec, (True, None, None)), (on, spec, (True, torch.bfloat16, None)),
                           three, three) == [
        "argument 'x': (True, None, None) -> (True, torch.bfloat16, None)"]
    assert key_differences((on, spec), ((True, torch.bfloat16, None), spec), labels[:2], labels[:2]) == [
        "autocast cpu: off -> bfloat16"]
    assert key_differences((on, spec, 1, (int, 1)), (on, spec, 1, (float, 1.0)), labels, labels) == [
        "argument 'flag': 1 -> 1.0 (float)"]
    assert key_differences((on, spec, 1), (on, spec, 1, 2), labels[:3], labels) == [
        "argument structure: (x) -> (x, flag)"]


def test_sequential_module_explained() -> None:
    # was a bug (fixed in 453860e): parameters named '0.weight' became placeholders '0_weight'
    net = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    cnet = efx.compile(net)
    torch.testing.assert_close(cnet(x), net(x))
    e = efx.explain(cnet)
    assert e.compiles == 1 and e.programs[0].why == "first call" and e.programs[0].training


def test_plurals() -> None:
    from effectfx.explanation.report import count

    assert [count(1, "body"), count(2, "body"), count(0, "call"), count(1, "compiled signature")] == [
        "1 body", "2 bodies", "0 calls", "1 compiled signature"]


class Named(torch.nn.Module):
    def __init__(self, i: int, shout: bool) -> None:
        super().__init__()
        self.name, self.idx, self.shout = f"layer{i}", i, shout
        self.lin = torch.nn.Linear(3, 3)

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shout:  # uses the label's value: one body per name
            _ops.record_memory(self.name.upper())
        else:  # passes it on untouched: an operand, one body for all
            _ops.record_memory(self.name)
        return self.lin(x)


class Indexed(Named):
    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * (self.idx + 1)


def _stack(cls: type, shout: bool = False) -> torch.nn.Module:
    return torch.nn.Sequential(*[cls(i, shout) for i in range(3)]).requires_grad_(False)


def test_hint_when_bodies_differ_by_a_label() -> None:
    """A string used by value splits bodies; explain says that strings only passed to effectful ops are
    operands, and points to the note."""
    x = torch.randn(3)
    assert len(efx.explain(_stack(Named), x).regions["Named.forward"].bodies) == 1
    e = efx.explain(_stack(Named, shout=True), x)
    region = e.regions["Named.forward"]
    assert len(region.bodies) == 3
    assert region.bodies[1].read_types == ("str",)
    note = next(n for n in e.notes if "Named.forward" in n)
    assert "(differing: self.name)" in note
    assert "A string it only passes to effectful ops becomes an operand" in note
    assert "Note [Region identity] in effectfx/notes.py" in note


def test_hint_when_bodies_differ_by_an_attribute() -> None:
    e = efx.explain(_stack(Indexed), torch.randn(3))
    region = e.regions["Indexed.forward"]
    assert len(region.bodies) == 3 and region.bodies[2].read_types == ("int",)
    note = next(n for n in e.notes if "Indexed.forward" in n)
    assert "numbers and bools always specialize a body" in note and "Note [Region identity]" in note
