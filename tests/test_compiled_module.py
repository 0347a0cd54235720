"""``efx.compile(model)`` is the model (``effectfx.drivers.compile.compiled_module``): the same parameters,
state_dict keys, attributes and hooks; methods such as ``generate`` call the compiled forward; a child
module; deepcopy and pickling."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import nn

import effectfx as efx
from effectfx.testing import hf
from effectfx.testing.effect_ops import recording

log_tensor = torch.ops.efxtest.log_tensor


class Inner(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.record_memory("inner")
        return torch.relu(self.lin(x))

    def twice(self, x: torch.Tensor) -> torch.Tensor:  # a method calling the module: compiled
        return self(self(x))


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = Inner()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_the_compiled_module_is_the_model() -> None:
    model = Inner()
    compiled = efx.compile(model)
    assert isinstance(compiled, Inner) and isinstance(compiled, torch.nn.Module)
    assert compiled.original is model and compiled._orig_mod is model
    assert list(compiled.state_dict()) == list(model.state_dict()) == ["lin.weight", "lin.bias"]
    assert all(a is b for a, b in zip(compiled.parameters(), model.parameters()))
    assert compiled.lin is model.lin and [n for n, _ in compiled.named_modules()] == ["", "lin"]
    compiled.eval()
    assert not model.training
    compiled.train()
    new = {k: torch.full_like(v, 0.5) for k, v in model.state_dict().items()}
    compiled.load_state_dict(new)
    torch.testing.assert_close(model.lin.weight, new["lin.weight"])
    x = torch.randn(2, 4)
    with recording() as log:
        torch.testing.assert_close(compiled.twice(x), model.twice(x))
    assert [e[1] for e in log] == ["inner"] * 4
    # its callable answers: the second call's input has a history and requires grad, a signature of its own
    assert compiled.stats.compiles == 2 and len(compiled.programs()) == 2
    assert "compiled signature" in repr(compiled)


def test_a_compiled_child_module_trains_as_eager() -> None:
    eager, model = Outer(), Outer()
    model.inner = efx.compile(model.inner)  # assignable as a child module, keys unchanged
    assert list(model.state_dict()) == list(eager.state_dict())
    x = torch.randn(3, 4)
    for _ in range(2):
        for m in (eager, model):
            m.zero_grad()
            with recording() as log:
                m(x).sum().backward()
            torch.optim.SGD(m.parameters(), lr=0.1).step()
        assert [e[1] for e in log] == ["inner"]
    for a, b in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)


def test_a_hook_on_the_compiled_module_runs_once() -> None:
    model = Inner()
    compiled = efx.compile(model)
    compiled.register_forward_hook(lambda m, args, out: log_tensor(out, "hook"))  # the model's hook too
    x = torch.randn(2, 4)
    for fn in (model, compiled, compiled):
        with recording() as log:
            fn(x)
        assert [e[1] for e in log] == ["inner", "hook"]


def test_deepcopy_and_pickling_compile_a_copy() -> None:
    model = Inner()
    compiled = efx.compile(model)
    x = torch.randn(2, 4)
    expected = model(x)
    clone = copy.deepcopy(compiled)
    assert clone.original is not model and isinstance(clone, Inner)
    assert clone.lin.weight is not model.lin.weight
    torch.testing.assert_close(clone(x), expected)
    buffer = io.BytesIO()
    torch.save(compiled, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, Inner) and loaded.compiled is not compiled.compiled
    torch.testing.assert_close(loaded(x), expected)


def test_generate_calls_the_compiled_forward() -> None:
    model = hf.build("gpt2")
    model.eval()
    compiled = efx.compile(model)
    ids = hf.batch("gpt2", torch.Generator().manual_seed(0))["input_ids"][:1, :4]
    kwargs = dict(max_new_tokens=3, do_sample=False, use_cache=False, attention_mask=torch.ones_like(ids),
                  pad_token_id=0)
    with recording() as eager_log:
        expected = model.generate(ids, **kwargs)
    with recording() as log:
        got = compiled.generate(ids, **kwargs)
    assert torch.equal(got, expected) and log == eager_log
    assert compiled.stats.calls == 3  # every step ran the compiled forward (one capture per length)


class _Flag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if self.on else x - 1


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(3, 3), _Flag(), nn.Dropout(0.5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("make", [lambda: nn.Sequential(nn.Linear(3, 3), _Flag(), nn.Dropout(0.5)), _Stack],
                         ids=["sequential", "modulelist"])
def test_children_reached_by_iteration_are_guarded(make: Any) -> None:
    """``nn.Sequential`` and a loop over a ``ModuleList`` reach their children through ``_modules``: what a
    child's forward reads (a flag, ``training`` after ``.eval()``) is guarded as a ``self.a`` read is."""
    torch.manual_seed(0)
    model = make()
    compiled = efx.compile(model)
    x = torch.ones(2, 3)
    flag = next(m for m in model.modules() if isinstance(m, _Flag))
    for step in ("train", "flag off", "eval", "flag on"):
        if step == "flag off":
            flag.on = False
        elif step == "eval":
            model.eval()
        elif step == "flag on":
            flag.on = True
        torch.manual_seed(1)
        got = compiled(x)
        torch.manual_seed(1)
        torch.testing.assert_close(got, model(x), msg=step)
    assert compiled.stats.compiles == 4
