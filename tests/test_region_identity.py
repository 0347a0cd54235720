# ruff: noqa: E501  (golden graph text has long lines)
"""Region identity: bodies keyed on what their trace read, labels as operands, ambient state.

Every scenario is checked against eager (outputs, gradients, effect log, through every form and
efx.compile) and by the number of bodies it makes; the label convention has a golden graph.
"""

from __future__ import annotations

import functools
import textwrap
import types

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx.testing import check_against_eager, recording

R = torch.ops.efxtest


def bodies_of(prog) -> int:
    p = prog.forward if isinstance(prog, efx.TrainingProgram) else prog
    return len(p.regions)


class Named(nn.Module):
    """A layer that logs its name: the seed's ``record_memory(prefix, module_name)``."""

    def __init__(self, name: str, width: int = 4) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.name = name
        self.layer_idx = int(name[-1])  # never read by forward: must not split bodies

    @efx.region
    def forward(self, x):
        R.record_memory(self.name)
        return torch.relu(self.lin(x))


class Branchy(Named):
    """Uses its name in Python control flow: the name must specialize the body."""

    @efx.region
    def forward(self, x):
        R.record_memory(self.name)
        if self.name == "layer0":
            x = x * 2
        return torch.relu(self.lin(x))


class Formatted(Named):
    """Builds another string from its name with str.join (read in C, no method of the name runs)."""

    @efx.region
    def forward(self, x):
        R.record_memory("/".join(["model", self.name]))
        return torch.relu(self.lin(x))


def stack(cls, n: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[cls(f"layer{i}") for i in range(n)])


# -- labels as operands --------------------------------------------------------------------------------
def test_label_is_an_operand_one_body_for_every_layer() -> None:
    model = stack(Named)
    x = torch.randn(2, 4, requires_grad=True)
    check_against_eager(model, x)
    prog = efx.capture(model, x)
    assert bodies_of(prog) == 1
    assert efx.explain(model, x).regions["Named.forward"].calls == 4


def test_label_operand_golden() -> None:
    model = stack(Named, 2)
    with torch.no_grad():
        prog = efx.capture(model, torch.randn(2, 4))
    assert prog.code() == textwrap.dedent("""\
        def forward(self, token, input, p_0_lin_weight, p_0_lin_bias, p_1_lin_weight, p_1_lin_bias):
            input_1 = input
            named_forward_subgraph0 = self.Named_forward_subgraph0
            invoke_subgraph = effectfx.ops.invoke_subgraph(named_forward_subgraph0, 'subgraph_0', token, input_1, 'layer0', p_0_lin_weight, p_0_lin_bias)
            getitem = invoke_subgraph[0]
            getitem_1 = invoke_subgraph[1]
            invoke_subgraph_1 = effectfx.ops.invoke_subgraph(named_forward_subgraph0, 'subgraph_0', getitem, getitem_1, 'layer1', p_1_lin_weight, p_1_lin_bias)
            getitem_2 = invoke_subgraph_1[0]
            getitem_3 = invoke_subgraph_1[1]
            return (getitem_2, getitem_3)

        # Named_forward_subgraph0: 'subgraph_0'
        def Named_forward_subgraph0(self, token, x, name, lin_weight, lin_bias):
            with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.record_memory.default, name)
            getitem = with_effects[0]
            t = torch.ops.aten.t.default(lin_weight)
            addmm = torch.ops.aten.addmm.default(lin_bias, x, t)
            relu = torch.ops.aten.relu.default(addmm)
            return (getitem, relu)""")


def test_label_in_control_flow_specializes() -> None:
    model = stack(Branchy)
    x = torch.randn(2, 4, requires_grad=True)
    check_against_eager(model, x)  # layer0 doubles its input, the others do not
    e = efx.explain(model, x)
    bodies = e.regions["Branchy.forward"].bodies
    assert len(bodies) == 4
    assert bodies[1].reason == "self.name: 'layer0' -> 'layer1' (vs subgraph_0)"


def test_label_read_by_c_code_specializes() -> None:
    model = stack(Formatted)
    x = torch.randn(2, 4)
    check_against_eager(model, x)
    assert bodies_of(efx.capture(model, x)) == 4


@pytest.mark.parametrize("use", [
    lambda name, x: x * len(name),                # a length
    lambda name, x: x + {"layer0": 1.0}.get(name, 0.0),  # a dict lookup (hash)
    lambda name, x: x * 2 if name.startswith("layer0") else x,  # a method
    lambda name, x: x * 2 if f"{name}" == "layer0" else x,  # formatting
    lambda name, x: x * 2 if name[-1] == "0" else x,  # indexing
    lambda name, x: x * 2 if ("p" + name) == "player0" else x,  # concatenation (reflected)
])
def test_every_other_use_of_a_label_specializes(use) -> None:
    class User(Named):
        @efx.region
        def forward(self, x):
            R.record_memory(self.name)
            return use(self.name, torch.relu(self.lin(x)))

    model = stack(User)
    check_against_eager(model, torch.randn(2, 4, requires_grad=True))


def test_string_argument_is_a_label() -> None:
    @efx.region
    def tagged(x, tag):
        R.record_stdout(tag)
        return x * 2

    def f(x):
        for tag in ("a", "b", "c"):
            x = tagged(x, tag)
        return x

    x = torch.randn(3, requires_grad=True)
    check_against_eager(f, x)
    assert bodies_of(efx.capture(f, x)) == 1


def test_label_passed_through_nested_regions() -> None:
    class Inner(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name
            self.lin = nn.Linear(4, 4)

        @efx.region
        def forward(self, x):
            R.record_memory(self.name)
            return self.lin(x)

    class Outer(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.inner = Inner(f"inner{i}")
            self.name = f"outer{i}"

        @efx.region
        def forward(self, x):
            R.record_stdout(self.name)
            return torch.relu(self.inner(x))

    torch.manual_seed(0)
    model = nn.Sequential(*[Outer(i) for i in range(3)])
    x = torch.randn(2, 4, requires_grad=True)
    check_against_eager(model, x)
    assert bodies_of(efx.capture(model, x)) == 2  # one Outer body, one Inner body


def test_label_returned_by_body_specializes() -> None:
    class Returns(Named):
        @efx.region
        def forward(self, x):
            R.record_memory(self.name)
            return torch.relu(self.lin(x)), self.name

    model = stack(Returns, 3)

    def f(x):
        names = []
        for layer in model:
            x, name = layer(x)
            names.append(name)
        return x, names

    check_against_eager(f, torch.randn(2, 4))


# -- keyed on reads ----------------------------------------------------------------------------------------
class Config:
    def __init__(self) -> None:
        self.use_gate = True
        self.scale = 2.0
        self.unused = "never read"


class Gated(nn.Module):
    def __init__(self, config: Config, i: int) -> None:
        super().__init__()
        self.config = config
        self.lin = nn.Linear(4, 4)
        self.layer_idx = i

    @efx.region
    def forward(self, x):
        h = self.lin(x)
        if self.config.use_gate:
            R.record_stdout("gate")
            h = h * torch.sigmoid(h)
        return h * self.config.scale


def gated_model(config: Config, n: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Gated(config, i) for i in range(n)])


def test_unread_attributes_do_not_split_bodies() -> None:
    config = Config()
    model = gated_model(config)
    for i, layer in enumerate(model):
        layer.unread = f"differs per layer {i}"
    x = torch.randn(2, 4, requires_grad=True)
    check_against_eager(model, x)
    assert bodies_of(efx.capture(model, x)) == 1


def test_read_attribute_that_differs_splits_bodies() -> None:
    model = gated_model(Config())
    model[1].config = Config()
    model[1].config.scale = 3.0
    x = torch.randn(2, 4, requires_grad=True)
    check_against_eager(model, x)
    e = efx.explain(model, x)
    bodies = e.regions["Gated.forward"].bodies
    assert len(bodies) == 2
    assert bodies[1].reason == "self.config.scale: 2.0 -> 3.0 (vs subgraph_0)"


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_flipping_a_config_value_between_compiled_calls(backend) -> None:
    if backend == "inductor":
        pytest.importorskip("torch._inductor")
    config = Config()
    model = gated_model(config)
    compiled = efx.compile(model, backend=backend)
    x = torch.randn(2, 4)
    for use_gate, scale in ((True, 2.0), (False, 2.0), (True, 0.5), (True, 2.0)):
        config.use_gate, config.scale = use_gate, scale
        with recording() as want_log:
            want = model(x)
        with recording() as got_log:
            got = compiled(x)
        torch.testing.assert_close(got, want)
        assert got_log == want_log
    assert compiled.stats.compiles == 3  # the last call reuses the first program
    whys = [p.why for p in efx.explain(compiled).programs]
    assert "Sequential.0.config.use_gate: True -> False" in whys[1]


def test_global_read_by_region_is_guarded() -> None:
    scope: dict = {"LOUD": True, "torch": torch, "R": R}
    exec(textwrap.dedent("""
        def body(x):
            if LOUD:
                R.record_stdout("loud")
            return x + 1
    """), scope)
    region = efx.region(scope["body"])
    compiled = efx.compile(lambda x: region(x))
    x = torch.randn(3)
    for loud in (True, False, True):
        scope["LOUD"] = loud
        with recording() as log:
            compiled(x)
        assert log == [("record_stdout", "loud")] * loud
    assert compiled.stats.compiles == 2


def test_bound_method_region_shares_one_body() -> None:
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    for layer in layers:
        layer.forward = efx.region(layer.forward)

    def f(x):
        for layer in layers:
            x = torch.relu(layer(x))
        return x

    x = torch.randn(2, 4, requires_grad=True)
    check_against_eager(f, x)  # each layer lifts its own weights
    assert bodies_of(efx.capture(f, x)) == 1


def test_watched_objects_get_their_class_back() -> None:
    config = Config()
    model = gated_model(config)
    efx.capture(model, torch.randn(2, 4))
    assert type(config) is Config and type(model[0]) is Gated and type(model[0].lin) is nn.Linear


# -- ambient state ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_autocast_is_part_of_the_signature(backend) -> None:
    lin = nn.Linear(4, 4)
    compiled = efx.compile(lin, backend=backend)
    x = torch.randn(2, 4)
    assert compiled(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x), lin(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    assert compiled(x).dtype == torch.float32
    assert compiled.stats.compiles == 2
    assert efx.explain(compiled).programs[1].why == "autocast cpu: off -> bfloat16 (vs signature 1)"


def test_autocast_is_part_of_region_keys() -> None:
    @efx.region
    def proj(w, x):
        return x @ w

    def f(w, x):
        a = proj(w, x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = proj(w, x)
        return a, b

    w, x = torch.randn(4, 4), torch.randn(2, 4)
    prog = efx.capture(f, w, x)
    assert bodies_of(prog) == 2
    got, want = prog(w, x), f(w, x)
    assert [t.dtype for t in got] == [t.dtype for t in want] == [torch.float32, torch.bfloat16]
    torch.testing.assert_close(got, want)


def test_grad_mode_is_part_of_region_keys() -> None:
    model = stack(Named, 2)
    x = torch.randn(2, 4)

    def f(x):
        y = model(x)
        with torch.no_grad():
            z = model(x)
        return y, z

    check_against_eager(f, x)
    # with grad: layer 0's input needs no grad and shares layer 1's body (promotion); under no_grad, where
    # nothing requires grad, another
    assert bodies_of(efx.capture(f, x)) == 2


def test_unwatchable_object_is_guarded_by_its_state() -> None:
    # a SimpleNamespace's class cannot be swapped to watch its reads: its whole state is guarded
    ns = types.SimpleNamespace(flag=True)

    @efx.region
    def body(x):
        return x * 2 if ns.flag else x

    compiled = efx.compile(lambda x: body(x))
    x = torch.randn(3)
    assert torch.equal(compiled(x), x * 2)
    ns.flag = False
    assert torch.equal(compiled(x), x)


class _NamespaceConfigured(nn.Module):
    def __init__(self, gain: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cfg = types.SimpleNamespace(gain=gain)

    @efx.region
    def forward(self, x):
        return self.lin(x) * self.cfg.gain


def test_equal_namespace_configs_share_a_body() -> None:
    """A SimpleNamespace per layer (unwatchable: guarded by its whole state) is compared by value: equal
    ones share a body, a different one gets its own and explain shows both values."""
    torch.manual_seed(0)
    model = nn.Sequential(_NamespaceConfigured(1.0), _NamespaceConfigured(1.0), _NamespaceConfigured(0.5))
    x = torch.randn(2, 4, requires_grad=True)
    check_against_eager(model, x)
    explained = efx.explain(model, x).regions["_NamespaceConfigured.forward"]
    assert [b.calls for b in explained.bodies] == [2, 1]
    assert "1.0" in explained.bodies[1].reason and "0.5" in explained.bodies[1].reason


def test_region_method_called_twice_on_one_module_shares_its_body() -> None:
    # the module is watched (its class swapped) after the first call; the key holds its own class
    lin = nn.Linear(4, 4)
    layer = Named("layer0")
    layer.lin = lin
    prog = efx.capture(lambda x: layer(x) + layer(x), torch.randn(2, 4))
    assert bodies_of(prog) == 1


def test_region_appending_to_a_list_argument_updates_the_caller_s_list() -> None:
    """Once refused; now the caller's list is written back (Note [Mutations], containers)."""
    @efx.region
    def collect(x, out):
        out.append(x * 2)
        return x + 1

    def f(x):
        out = [x]
        y = collect(x, out)
        return y + out[-1], len(out)

    check_against_eager(f, torch.randn(3, requires_grad=True))


def test_region_putting_a_module_into_a_list_argument_is_refused() -> None:
    @efx.region
    def collect(x, out):
        out.append(torch.nn.Identity())
        return x + 1

    def f(x):
        out = []
        return collect(x, out) + len(out)

    with pytest.raises(efx.UnsupportedMutationError, match="region 'collect'.*changes argument 1"):
        efx.capture(f, torch.randn(3))


def test_renamed_layer_under_compile_logs_its_new_name() -> None:
    model = stack(Named, 2)
    compiled = efx.compile(model)
    x = torch.randn(2, 4)
    for name in ("layer1", "renamed"):
        model[1].name = name
        with recording() as want:
            model(x)
        with recording() as got:
            compiled(x)
        assert got == want


def test_the_flat_call_spec_is_pytree_s() -> None:
    """A call site flattens its arguments without pytree when they are all leaves: same leaves, same spec."""
    from torch.utils._pytree import tree_flatten

    from effectfx.capture.arguments import flatten_call

    module, x = torch.nn.Linear(2, 2), torch.randn(2)
    for args, kwargs in [((module, x), {}), ((x,), {}), ((x, 3, "name", None, 1.5), {}), ((), {}),
                         ((x, [x, x]), {}), ((x,), {"y": x}), (((x, x),), {})]:
        leaves, spec = flatten_call(args, kwargs)
        expected_leaves, expected_spec = tree_flatten((args, kwargs))
        assert spec == expected_spec and len(leaves) == len(expected_leaves)
        assert all(a is b for a, b in zip(leaves, expected_leaves))


class _PartialActivation(nn.Module):
    """An activation held as ``functools.partial`` (transformers' GELUTanh: Gemma, Starcoder2)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = functools.partial(torch.nn.functional.gelu, approximate=approximate)

    @efx.region
    def forward(self, x):
        return self.act(self.lin(x))


def test_equal_partials_share_a_body_and_different_ones_do_not() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_PartialActivation(), _PartialActivation(), _PartialActivation("none"))
    x = torch.randn(2, 4, requires_grad=True)
    check_against_eager(model, x)
    explained = efx.explain(model, x).regions["_PartialActivation.forward"]
    assert [b.calls for b in explained.bodies] == [2, 1]
    assert "self.act: partial(gelu, approximate='tanh') -> partial(gelu, approximate='none')" in explained.bodies[1].reason


class _LeafAware(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @efx.region
    def forward(self, x):
        return self.lin(x) * (2.0 if x.is_leaf else 3.0)


def test_a_body_reading_is_leaf_is_keyed_by_it() -> None:
    """Whether an argument has a history is part of a body's identity once its code looks (the key holds
    requires_grad only): the first layer gets the leaf input, the second a computed one."""
    torch.manual_seed(0)
    model = nn.Sequential(_LeafAware(), _LeafAware())
    x = torch.randn(2, 4, requires_grad=True)
    check_against_eager(model, x)
    explained = efx.explain(model, x).regions["_LeafAware.forward"]
    assert len(explained.bodies) == 2 and "x.is_leaf: True -> False" in explained.bodies[1].reason
