"""The effect registry: register_effect / effect_of / handle.remove, and that capture
obeys it (an op is threaded by tokens exactly when the registry says it is effectful)."""

from __future__ import annotations

import pytest
import torch

import effectfx as efx
from effectfx import ops

LOG: list[str] = []


def _define(name: str):
    @torch.library.custom_op(f"efxtcap::{name}", mutates_args=())
    def op(label: str) -> None:
        LOG.append(f"{name}:{label}")

    op.register_fake(lambda label: None)
    return op


reg_overload = _define("reg_overload")
reg_packet = _define("reg_packet")
reg_customop = _define("reg_customop")
reg_string = _define("reg_string")
reg_string_overload = _define("reg_string_overload")
reg_toggle = _define("reg_toggle")
reg_rekey = _define("reg_rekey")


# a pure op (it returns a tensor): effect_of says None until it is registered
@torch.library.custom_op("efxtcap::reg_never", mutates_args=())
def reg_never(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


reg_never.register_fake(lambda x: torch.empty_like(x))


@pytest.fixture
def handles():
    hs: list = []
    yield hs
    for h in hs:
        h.remove()


def test_register_opoverload(handles):
    op = torch.ops.efxtcap.reg_overload.default
    assert efx.effect_of(op) == "ordered"  # returns nothing, mutates nothing: an effect until registered
    handles.append(efx.register_effect(op, key="memory"))
    assert efx.effect_of(op) == "memory"
    assert efx.effect_of(torch.ops.efxtcap.reg_overload) == "memory"
    assert efx.effect_of("efxtcap::reg_overload") == "memory"


def test_register_packet_covers_its_overloads(handles):
    handles.append(efx.register_effect(torch.ops.efxtcap.reg_packet, key="stdout"))
    assert efx.effect_of(torch.ops.efxtcap.reg_packet.default) == "stdout"


def test_register_customopdef(handles):
    handles.append(efx.register_effect(reg_customop, key="collective:tp"))
    assert efx.effect_of(torch.ops.efxtcap.reg_customop.default) == "collective:tp"
    assert efx.effect_of(reg_customop) == "collective:tp"


def test_register_string(handles):
    handles.append(efx.register_effect("efxtcap::reg_string"))
    assert efx.effect_of(torch.ops.efxtcap.reg_string.default) == "ordered"  # default key
    handles.append(efx.register_effect("efxtcap::reg_string_overload.default", key="memory"))
    assert efx.effect_of(torch.ops.efxtcap.reg_string_overload.default) == "memory"


def test_handle_remove_undoes_and_is_idempotent():
    op = torch.ops.efxtcap.reg_toggle.default
    h = efx.register_effect(op, key="memory")
    assert efx.effect_of(op) == "memory"
    h.remove()
    assert efx.effect_of(op) == "ordered"  # back to the rule for ops that return nothing
    h.remove()
    assert efx.effect_of(op) == "ordered"


def test_handle_remove_restores_previous_key():
    op = torch.ops.efxtcap.reg_rekey.default
    first = efx.register_effect(op, key="memory")
    second = efx.register_effect(op, key="stdout")
    assert efx.effect_of(op) == "stdout"
    second.remove()
    assert efx.effect_of(op) == "memory"
    first.remove()
    assert efx.effect_of(op) == "ordered"


def test_torch_ordered_ops_are_effectful_on_ordered():
    assert efx.effect_of(torch.ops.aten._print.default) == "ordered"
    assert efx.effect_of(torch.ops.aten._print) == "ordered"
    assert efx.effect_of("aten::_print") == "ordered"


@pytest.mark.parametrize("op", [torch.ops.aten.add.Tensor, torch.ops.aten.add, "aten::mul",
                                torch.ops.efxtcap.reg_never.default, len, None, 3])
def test_pure_things_have_no_effect(op):
    assert efx.effect_of(op) is None


@pytest.mark.parametrize("key", ["", "has space", 3, None, "bad/slash"])
def test_bad_keys_are_rejected(key):
    with pytest.raises(efx.RegistryError) as info:
        efx.register_effect(torch.ops.efxtcap.reg_never.default, key=key)
    assert isinstance(info.value, efx.EffectfxError)
    assert efx.effect_of(torch.ops.efxtcap.reg_never.default) is None


@pytest.mark.parametrize("op", ["efxtcap::no_such_op", "nonamespace", 42, object()])
def test_bad_ops_are_rejected(op):
    with pytest.raises(efx.RegistryError):
        efx.register_effect(op)


def test_key_names_are_accepted():
    handles = [efx.register_effect(torch.ops.efxtcap.reg_never.default, key=k)
               for k in ("ordered", "memory", "collective:tp", "a.b-c_1")]
    assert efx.effect_of(torch.ops.efxtcap.reg_never.default) == "a.b-c_1"
    for h in reversed(handles):
        h.remove()
    assert efx.effect_of(torch.ops.efxtcap.reg_never.default) is None


def _fn(x):
    torch.ops.efxtcap.reg_toggle("a")
    return x + 1


def _with_effects_targets(prog):
    return [n.args[1] for n in prog.graph_module.graph.nodes if n.target is ops.with_effects]


def test_capture_follows_the_registry():
    x = torch.randn(2)
    LOG.clear()
    # not registered: an op that returns nothing exists for its side effect, kept on "ordered"
    prog = efx.capture(_fn, x)
    assert _with_effects_targets(prog) == [torch.ops.efxtcap.reg_toggle.default]
    assert prog.token_keys == ("ordered",)

    h = efx.register_effect(torch.ops.efxtcap.reg_toggle.default, key="memory")
    try:
        prog = efx.capture(_fn, x)
        assert _with_effects_targets(prog) == [torch.ops.efxtcap.reg_toggle.default]
        assert prog.token_keys == ("memory",)
        assert LOG == []  # capture never runs the effect
        prog(x)
        assert LOG == ["reg_toggle:a"]
    finally:
        h.remove()
    prog = efx.capture(_fn, x)
    assert prog.token_keys == ("ordered",)


def test_rekeyed_op_uses_the_new_token():
    x = torch.randn(2)

    def f(x):
        torch.ops.efxtcap.reg_rekey("r")
        return x * 2

    h = efx.register_effect(torch.ops.efxtcap.reg_rekey.default, key="memory")
    try:
        assert efx.capture(f, x).token_keys == ("memory",)
        h2 = efx.register_effect(torch.ops.efxtcap.reg_rekey.default, key="io")
        assert efx.capture(f, x).token_keys == ("io",)
        h2.remove()
        assert efx.capture(f, x).token_keys == ("memory",)
    finally:
        h.remove()


def test_print_can_be_rekeyed_and_restored():
    x = torch.randn(2)

    def f(x):
        torch.ops.aten._print("p")
        return x

    h = efx.register_effect(torch.ops.aten._print.default, key="stdout")
    try:
        assert efx.effect_of(torch.ops.aten._print.default) == "stdout"
        assert efx.capture(f, x).token_keys == ("stdout",)
    finally:
        h.remove()
    assert efx.effect_of(torch.ops.aten._print.default) == "ordered"
    assert efx.capture(f, x).token_keys == ("ordered",)
