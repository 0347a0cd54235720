"""Rebinding what a compiled program ran is seen (Note [Region identity]): an instance ``forward`` assigned
or deleted (``effectfx.guards.hooks``), a global or closure cell a hook's code names rebound (``hooks``), a
module's parameters or submodules reordered (``guards.kinds.Keys``), a profiler entered
(``guards.identity.ambient``).  Each is three calls against eager, rebinding before the second and undoing
it before the third: outputs and effect logs equal eager's, one new capture that ``efx.explain`` names,
and the third call served by the first program."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.profiler import profile

import effectfx as efx
from effectfx.testing.effect_ops import recording

log_tensor = torch.ops.efxtest.log_tensor
record = torch.ops.efxtest.record_memory


class Block(torch.nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.name = name

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record(self.name)
        return torch.relu(self.lin(x))


class Stack(torch.nn.Module):
    def __init__(self, n: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block(f"block{i}") for i in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def doubled(self: Block, x: torch.Tensor) -> torch.Tensor:
    record("doubled")
    return type(self).forward(self, x) * 2


def negated(self: Block, x: torch.Tensor) -> torch.Tensor:
    record("negated")
    return -type(self).forward(self, x)


def _set_forward(module: torch.nn.Module, fn: Callable[..., Any]) -> None:
    module.forward = types.MethodType(fn, module)


def three_calls(compiled: Any, eager: Callable[..., Any], rebind: Callable[[], None],
                undo: Callable[[], None], x: torch.Tensor | None = None, during: Any = None) -> str:
    """Three calls of ``compiled`` and ``eager``, ``rebind()`` before the second, ``undo()`` before the
    third (``during``: a context the second call runs in); returns why ``efx.explain`` says the second
    program was captured."""
    x = torch.randn(2, 4, requires_grad=True) if x is None else x
    for step in range(3):
        if step == 1:
            rebind()
        if step == 2:
            undo()
        with during if step == 1 and during is not None else _nothing():
            results = []
            for fn in (eager, compiled):
                x.grad = None
                with recording() as log:
                    out = fn(x)
                    out.sum().backward()
                results.append((out.detach(), x.grad, log))
        (want, want_grad, want_log), (got, got_grad, got_log) = results
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_grad, want_grad)
        assert got_log == want_log, step
        assert compiled.stats.compiles == (1 if step == 0 else 2), step
    whys = [line.split("why: ", 1)[1] for line in str(efx.explain(compiled)).splitlines()
            if line.lstrip().startswith("compiled in")]
    assert len(whys) == 2 and whys[0] == "first call", whys
    return whys[1]


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- an instance forward -------------------------------------------------------------------------------------
def test_an_instance_forward_assigned_after_the_first_call_then_deleted() -> None:
    model = Stack()
    block = model.blocks[1]
    why = three_calls(efx.compile(model), model, lambda: _set_forward(block, doubled),
                      lambda: delattr(block, "forward"))
    assert why.startswith("Stack.blocks.1 hooks: 0 hooks -> 0 hooks, an instance forward")


def test_an_instance_forward_assigned_before_compile_then_rebound() -> None:
    """Bound anew to the same function (another method object), the first program serves it again."""
    model = Stack()
    block = model.blocks[1]
    block.forward = types.MethodType(doubled, block)
    why = three_calls(efx.compile(model), model, lambda: _set_forward(block, negated),
                      lambda: _set_forward(block, doubled))
    assert why.startswith("Stack.blocks.1 hooks: 0 hooks, an instance forward -> 0 hooks, an instance "
                          "forward (another instance forward)")


def test_an_instance_forward_of_a_module_a_function_closes_over() -> None:
    model = Stack()
    block = model.blocks[0]

    def fn(x: torch.Tensor) -> torch.Tensor:
        return model(x) * 3

    why = three_calls(efx.compile(fn), fn, lambda: _set_forward(block, negated),
                      lambda: delattr(block, "forward"))
    assert "an instance forward" in why


def test_the_compiled_module_s_own_instance_forward_runs_as_eager() -> None:
    """``efx.compile(model)`` shares the model's ``__dict__``: an instance ``forward`` there (assigned before
    or after compiling) is what the compiled module's call runs, eagerly (docs/SUPPORT.md)."""
    for before in (True, False):
        model = Stack()
        if before:
            _set_forward(model.blocks[0], doubled)
            model.forward = types.MethodType(lambda self, x: Stack.forward(self, x) * 2, model)
        compiled, x = efx.compile(model), torch.randn(2, 4)
        compiled(x)
        model.forward = types.MethodType(lambda self, x: Stack.forward(self, x) - 1, model)
        with recording() as want:
            expected = model(x)
        with recording() as got:
            torch.testing.assert_close(compiled(x), expected)
        assert got == want


def _same_forward(model: Stack, forwards: list[Callable[..., Any]]) -> int:
    for block, forward in zip(model.blocks, forwards):
        block.lin.forward = types.MethodType(forward, block.lin)
    compiled, x = efx.compile(model), torch.randn(2, 4, requires_grad=True)
    with recording() as want:
        model(x)
    with recording() as got:
        out = compiled(x)
    torch.testing.assert_close(out, model(x))
    assert got == want
    (prog,) = compiled.programs()
    return len(prog.forward.bodies)


def _lin_plus_one(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, self.weight, self.bias) + 1


def _lin_minus_one(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, self.weight, self.bias) - 1


def test_layers_share_a_body_only_with_the_same_instance_forward() -> None:
    """A body's key holds its module's submodules' instance forwards: a method of the same function bound
    to each layer's own submodule is one body; another function is another body."""
    assert _same_forward(Stack(), [_lin_plus_one] * 3) == 1
    assert _same_forward(Stack(), [_lin_plus_one, _lin_minus_one, _lin_plus_one]) == 2
    model = Stack()
    for block in model.blocks[1:]:
        block.lin.forward = types.MethodType(_lin_plus_one, block.lin)
    text = str(efx.explain(efx.compile(model), torch.randn(2, 4)))
    assert "self.lin: instance forward none -> method _lin_plus_one" in text


# -- what a hook's code names --------------------------------------------------------------------------------
def _plus_one(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
    return out + 1


def _times_three(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
    log_tensor(out, "times")
    return out * 3


HOOK = _plus_one


def test_a_global_a_hook_calls_rebound() -> None:
    global HOOK
    model = Stack()
    model.blocks[2].lin.register_forward_hook(lambda m, a, o: HOOK(m, a, o))

    def rebind(fn: Callable[..., Any]) -> Callable[[], None]:
        def set_hook() -> None:
            global HOOK
            HOOK = fn
        return set_hook

    try:
        why = three_calls(efx.compile(model), model, rebind(_times_three), rebind(_plus_one))
    finally:
        HOOK = _plus_one
    assert why.startswith("Stack.blocks.2.lin hooks: 1 hook -> 1 hook (HOOK rebound)")


def test_a_closure_cell_a_hook_calls_rebound() -> None:
    model = Stack()
    hook = _plus_one

    def set_hook(fn: Callable[..., Any]) -> Callable[[], None]:
        def set_() -> None:
            nonlocal hook
            hook = fn
        return set_

    model.blocks[0].register_forward_hook(lambda m, a, o: hook(m, a, o))
    why = three_calls(efx.compile(model), model, set_hook(_times_three), set_hook(_plus_one))
    assert why.startswith("Stack.blocks.0 hooks: 1 hook -> 1 hook (a closed-over value rebound)")


# -- order of parameters and submodules ----------------------------------------------------------------------
class Weighted(torch.nn.Module):
    """Its forward pairs parameters by their order: ``parameters()`` yields them in ``_parameters``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.full((4,), 2.0))
        self.b = torch.nn.Parameter(torch.full((4,), -1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.parameters()
        log_tensor(first, "first")
        return x * first + second


def _move_to_end(table: dict, key: str) -> Callable[[], None]:
    return lambda: table.update({key: table.pop(key)})


def test_parameters_reordered() -> None:
    model = Weighted()
    why = three_calls(efx.compile(model), model, _move_to_end(model._parameters, "a"),
                      _move_to_end(model._parameters, "b"))
    assert why.startswith("Weighted._parameters: keys ('a', 'b') -> keys ('b', 'a')")


def test_layers_reordered() -> None:
    """Iterating a ModuleList reads its ``_modules``: eager runs the layers in their new order."""
    model = Stack()
    table = model.blocks._modules
    why = three_calls(efx.compile(model), model, _move_to_end(table, "0"),
                      lambda: [table.update({k: table.pop(k)}) for k in ("0", "1", "2")])
    assert why.startswith("Stack.blocks._modules: keys ('0', '1', '2') -> keys ('1', '2', '0')")


# -- the profiler --------------------------------------------------------------------------------------------
def profiled(x: torch.Tensor) -> torch.Tensor:
    if torch.autograd._profiler_enabled():
        record("profiling")
        return x * 2
    return x + 1


@pytest.mark.filterwarnings("ignore")
def test_a_profiler_entered() -> None:
    """Whether a profiler is on is ambient state, as grad mode is: part of the key."""
    why = three_calls(efx.compile(profiled), profiled, lambda: None, lambda: None,
                      during=profile(activities=[torch.profiler.ProfilerActivity.CPU]))
    assert why == "profiler: off -> on (vs signature 1)"
