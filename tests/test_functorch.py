"""torch.func transforms around effectfx: eager's outputs and effect log, or a clear refusal.

Three places a transform can meet effectfx: (a) around a compiled function, ``vmap(efx.compile(f))``;
(b) around a captured Program, ``grad(efx.capture(f, x))``; (c) around code calling an ``@efx.region``
function, inside a capture (``efx.capture(lambda x: vmap(block)(x), x)``) or in eager code.  Each case
below either matches eager (outputs, effect log) or is refused with ``UnsupportedOperatorError`` naming
the transform and the line of this file marked ``# <- name``.  Control cases, which already worked before
these checks existed, say so.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, functionalize, grad, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils._pytree import tree_flatten

import effectfx as efx
import effectfx.testing  # noqa: F401  (registers the efxtest:: ops)
from effectfx.testing import check_against_eager, recording

_SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> str:
    """``test_functorch.py:<line>`` of the line ending in ``# <- marker``."""
    (lineno,) = [i + 1 for i, line in enumerate(_SOURCE) if line.rstrip().endswith(f"# <- {marker}")]
    return f"{Path(__file__).name}:{lineno}"


def record(label: str) -> None:
    torch.ops.efxtest.record_memory(label)


@efx.region
def block(x: torch.Tensor) -> torch.Tensor:
    record("block")
    return x.sin() * 2


def scalar_block(x: torch.Tensor) -> torch.Tensor:
    return block(x).sum()  # <- block call


def scalar_plain(x: torch.Tensor) -> torch.Tensor:
    record("plain")
    return (x.sin() * 2).sum()


# how each test applies a transform to a scalar function ``f`` at ``x``
TRANSFORMS: dict[str, Callable[[Callable, torch.Tensor], Any]] = {
    "grad": lambda f, x: grad(f)(x),  # <- grad
    "vjp": lambda f, x: vjp(f, x)[1](torch.ones(())),  # <- vjp
    "jacrev": lambda f, x: jacrev(f)(x),  # <- jacrev
    "jvp": lambda f, x: jvp(f, (x,), (torch.ones_like(x),)),  # <- jvp
    "jacfwd": lambda f, x: jacfwd(f)(x),  # <- jacfwd
    "functionalize": lambda f, x: functionalize(f)(x),  # <- functionalize
}
X = torch.randn(3, generator=torch.Generator().manual_seed(0))
XS = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))


def assert_same(got: Any, expected: Any) -> None:
    """Plain tensors (no fake, no torch.func wrapper) with eager's values and requires_grad."""
    got_leaves, expected_leaves = tree_flatten(got)[0], tree_flatten(expected)[0]
    assert len(got_leaves) == len(expected_leaves)
    for g, e in zip(got_leaves, expected_leaves):
        assert type(g) is torch.Tensor, f"not a plain tensor: {type(g).__name__}"
        assert g.requires_grad == e.requires_grad
        torch.testing.assert_close(g.detach(), e.detach())


def assert_eager(run: Callable[[Callable], Any], fn: Callable, *systems: Callable,
                 wrt: tuple[torch.Tensor, ...] = ()) -> None:
    """``run(system)`` gives ``run(fn)``'s results, effect log and gradients (of ``wrt``, when the results
    require grad), for every system."""
    def once(f: Callable) -> tuple[Any, list, Any]:
        with recording() as log:
            out = run(f)
            diff = [o for o in tree_flatten(out)[0] if o.requires_grad]
            grads = torch.autograd.grad(diff, wrt, [torch.ones_like(o) for o in diff]) if diff and wrt else ()
        return out, log, grads

    expected = once(fn)
    for system in systems:
        got = once(system)
        assert_same(got[0], expected[0])
        assert got[1] == expected[1]
        assert_same(got[2], expected[2])


def refused(thunk: Callable[[], Any], *words: str, line: str) -> str:
    """``thunk()`` raises UnsupportedOperatorError naming ``words`` and ``line``, before any effect."""
    with recording() as log, pytest.raises(efx.UnsupportedOperatorError) as raised:
        thunk()
    text = str(raised.value)
    for word in (*words, line):
        assert word in text, f"message does not name {word!r}:\n{text}"
    assert log == []
    return text


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record("Block")
        return self.lin(x).tanh()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def new_params(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() + 1 for k, v in m.named_parameters()}


# -- (a) a compiled function under a transform -----------------------------------------------------------
@pytest.mark.parametrize("fn", [scalar_block, scalar_plain])
def test_vmap_of_compiled_matches_eager(fn: Callable) -> None:
    # control: already worked (the program's aten ops run batched)
    assert_eager(lambda f: vmap(f)(XS), fn, efx.compile(fn), efx.compile(fn))


def test_vmap_of_compiled_module_under_no_grad_matches_eager() -> None:
    # control: already worked
    m = model()
    with torch.no_grad():
        assert_eager(lambda f: vmap(f)(XS), m, efx.compile(m))


def test_vmap_of_compiled_function_updating_its_argument_matches_eager() -> None:
    # was: NotImplementedError "Cannot access storage of BatchedTensorImpl"
    def bump(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return block(x)

    eager_x, compiled_x = XS.clone(), XS.clone()
    assert_eager(lambda f: vmap(f)(eager_x if f is bump else compiled_x), bump, efx.compile(bump))
    torch.testing.assert_close(compiled_x, eager_x)


def test_vmap_of_compiled_module_that_requires_grad_is_refused() -> None:
    # was: RuntimeError "autograd.Function ... must override the setup_context staticmethod"
    cm = efx.compile(model())
    refused(lambda: vmap(cm)(XS), "torch.func.vmap", "Sequential", "torch.no_grad()",  # <- vmap module
            line=line_of("vmap module"))
    assert cm.stats.compiles == 0 and not cm.cache
    with torch.no_grad():
        vmap(cm)(XS)  # the next good call works


def test_vmap_of_compiled_with_an_argument_that_requires_grad_is_refused() -> None:
    # was: a silently wrong result, which did not require grad where eager's does
    cf = efx.compile(lambda x: block(x) * 3)
    xs = XS.clone().requires_grad_()
    refused(lambda: vmap(cf)(xs), "torch.func.vmap", "requires grad", line=line_of("vmap rg"))  # <- vmap rg


_W = torch.randn(3, 3, requires_grad=True)
_LIN = nn.Linear(3, 3)


@efx.region
def reads_a_global_module(x: torch.Tensor) -> torch.Tensor:
    return _LIN(x)


@pytest.mark.parametrize("fn", [lambda x: x @ _W, lambda x: reads_a_global_module(x)],
                         ids=["closure parameter", "region reading a global module"])
def test_vmap_of_compiled_reading_tensors_that_require_grad_is_refused(fn: Callable) -> None:
    # was: RuntimeError "autograd.Function ... must override the setup_context staticmethod"
    cf = efx.compile(fn)
    refused(lambda: vmap(cf)(XS),  # <- vmap lifted
            "torch.func.vmap", "torch.no_grad()", line=line_of("vmap lifted"))
    assert cf.stats.compiles == 0 and not cf.cache


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("fn", [scalar_block, scalar_plain])
def test_other_transforms_of_compiled_are_refused(transform: str, fn: Callable) -> None:
    # was: KeyError 'lifted_3' (grad, vjp, jacrev); a FakeTensor returned as the result (jvp, jacfwd,
    # functionalize)
    cf = efx.compile(fn)
    refused(lambda: TRANSFORMS[transform](cf, X), f"torch.func.{transform}", "'scalar_", "efx.compile'd",
            line=line_of(transform))
    assert cf.stats.compiles == 0 and not cf.cache
    assert_eager(lambda f: f(X), fn, cf)  # outside the transform it works


def test_compiled_call_inside_grad_is_refused() -> None:
    # was: CaptureError "read a tensor it neither computed nor received" (nothing it reads is wrapped)
    cf = efx.compile(lambda v: block(v) * 2)
    w = torch.randn(3)
    refused(lambda: grad(lambda x: (cf(w) * x).sum())(X), "torch.func.grad",  # <- inside grad
            line=line_of("inside grad"))


def test_torch_func_inside_the_compiled_function_matches_eager() -> None:
    # control: already worked (what the refusals advise, for code without regions)
    check_against_eager(lambda x: grad(scalar_plain)(x) + vmap(torch.sin)(x), X)


def test_functional_call_of_compiled_module_matches_eager() -> None:
    # was: the call after a functional_call ran with the swapped-in parameters (efx.compile(model) is a
    # module since before, AttributeError "'CompiledCallable' object has no attribute ...")
    m = model()
    cm = efx.compile(m)
    params = new_params(m)
    grads = {k: v.clone().requires_grad_() for k, v in params.items()}
    for p in (params, grads, params):
        assert_eager(lambda mod, p=p: functional_call(mod, p, (X,)), m, cm, wrt=tuple(p.values()))
        assert_eager(lambda mod: mod(X), m, cm, wrt=tuple(m.parameters()))  # its own parameters again


def test_grad_of_functional_call_of_compiled_module_is_refused() -> None:
    # was: CaptureError "FakeTensorDeviceMismatchError" in region 'Block.forward' (a capture under grad)
    m = model()
    cm = efx.compile(m)
    params = new_params(m)
    refused(lambda: grad(lambda p: functional_call(cm, p, (X,)).sum())(params),  # <- grad fc compiled
            "torch.func.grad", "'Sequential'", line=line_of("grad fc compiled"))


def test_vmap_of_functional_call_of_compiled_module_is_refused() -> None:
    # was: a FakeTensor returned as the result (model ensembling through the compiled module)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    cm = efx.compile(m)
    stacked = {k: torch.stack([v, v + 1]) for k, v in new_params(m).items()}
    with torch.no_grad():
        refused(lambda: vmap(lambda p, x: functional_call(cm, p, (x,)))(stacked, XS),  # <- ensemble
                "torch.func.vmap", "functional_call", line=line_of("ensemble"))


# -- (b) a captured Program under a transform ------------------------------------------------------------
def test_vmap_and_jvp_of_a_captured_program_match_eager() -> None:
    # control: already worked (an inference program's aten ops run batched / with forward AD)
    assert_eager(lambda f: vmap(f)(XS), scalar_block, efx.capture(scalar_block, X))
    assert_eager(lambda f: jvp(f, (X,), (torch.ones(3),)), scalar_block, efx.capture(scalar_block, X))


# was: an inference Program under torch.func.grad gave zero gradients, silently
@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev"])
def test_reverse_transforms_of_a_captured_program_are_refused(transform: str) -> None:
    prog = efx.capture(scalar_block, X)
    refused(lambda: TRANSFORMS[transform](prog, X), f"torch.func.{transform}", line=line_of(transform))


# -- (c) code calling a region, inside a capture ---------------------------------------------------------
def _captures(outer: Callable) -> list[Callable[[], Any]]:
    return [lambda: efx.capture(outer, X), lambda: efx.compile(outer)(X)]


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_region_under_a_transform_inside_a_capture_is_refused(transform: str) -> None:
    # was: KeyError 'lifted_3' (grad, vjp, jacrev); CaptureError "read a tensor it neither computed nor
    # received" (jvp, jacfwd, functionalize)
    for thunk in _captures(lambda x: TRANSFORMS[transform](scalar_block, x)):
        refused(thunk, f"torch.func.{transform}", "region 'block'", "__wrapped__", line=line_of("block call"))


def test_vmap_of_a_region_inside_a_capture_is_refused() -> None:
    # was: RuntimeError "Either your tensor may have escaped from inside a function being vmapped"
    for thunk in _captures(lambda x: vmap(block)(x.expand(2, 3))):  # <- vmap region
        refused(thunk, "torch.func.vmap", "region 'block'", "BatchedTensor", line=line_of("vmap region"))


def test_region_with_plain_arguments_under_vmap_inside_a_capture_matches_eager() -> None:
    # control: already worked -- the region's arguments are not batched, and nothing requires grad
    w = torch.randn(3)
    check_against_eager(lambda x: vmap(lambda xi: xi * block(w))(x), XS)


def test_region_with_an_argument_that_requires_grad_under_vmap_inside_a_capture_is_refused() -> None:
    # was: RuntimeError "autograd.Function ... must override the setup_context staticmethod"
    w = torch.randn(3, requires_grad=True)
    refused(lambda: efx.capture(lambda x: vmap(lambda xi: xi * block(w))(x), XS),  # <- vmap rg region
            "torch.func.vmap", "requires grad", "torch.no_grad()", line=line_of("vmap rg region"))


def test_transforms_inside_a_region_match_eager() -> None:
    # control: already worked -- what the refusals advise
    @efx.region
    def batched(x: torch.Tensor) -> torch.Tensor:
        record("batched")
        return vmap(torch.sin)(x) + grad(lambda v: v.sin().sum())(x)

    check_against_eager(lambda x: batched(x) + batched(x * 2), XS)
    check_against_eager(lambda x: batched(x) + batched(x * 2), XS.clone().requires_grad_())


def test_functional_call_of_a_module_with_regions_inside_a_capture_is_refused() -> None:
    # was: a silently wrong result -- the second layer ran with the first layer's parameters
    m = model()
    params = new_params(m)

    def swapped(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(m, p, (x,))  # <- fc region

    for thunk in [lambda: efx.capture(swapped, params, X), lambda: efx.compile(swapped)(params, X)]:
        refused(thunk, "functional_call", "region 'Block.forward'", "lin.weight", line=line_of("fc region"))


def test_grad_of_functional_call_inside_a_capture_is_refused() -> None:
    # was: CaptureError "FakeTensorDeviceMismatchError" in region 'Block.forward'
    m = model()
    params = new_params(m)

    def loss_grad(p: dict, x: torch.Tensor) -> dict:
        return grad(lambda q: functional_call(m, q, (x,)).sum())(p)  # <- grad fc

    refused(lambda: efx.capture(loss_grad, params, X), "torch.func.grad", "region 'Block.forward'",
            line=line_of("grad fc"))


def test_functional_call_of_a_module_without_regions_inside_a_capture_matches_eager() -> None:
    # control: already worked
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    check_against_eager(lambda p, x: functional_call(m, p, (x,)), new_params(m), X)


# -- (c) code calling a region, in eager: a plain call -------------------------------------------------
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transforms_of_a_region_in_eager_are_eager(transform: str) -> None:
    # control: already worked -- outside a capture a region is its function
    def undecorated(x: torch.Tensor) -> torch.Tensor:
        return block.__wrapped__(x).sum()

    assert_eager(lambda f: TRANSFORMS[transform](f, X), undecorated, scalar_block)


def test_vmap_and_functional_call_of_regions_in_eager_are_eager() -> None:
    # control: already worked (model ensembling: vmap over stacked parameters)
    m = model()
    plain = nn.Sequential(*[type("Plain", (nn.Module,), {"forward": Block.forward.__wrapped__})() for _ in m])
    for sub, b in zip(plain, m):
        sub.lin = b.lin
    assert_eager(lambda f: vmap(f)(XS), block.__wrapped__, block)
    stacked = {k: torch.stack([v, v + 1]) for k, v in new_params(m).items()}
    assert_eager(lambda mod: vmap(lambda p, x: functional_call(mod, p, (x,)))(stacked, XS), plain, m)


def test_jvp_inside_captured_code_with_python_constants() -> None:
    """Was a raw RuntimeError ('invalid python storage') from the constant-folding of ``* 2`` under jvp."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return jvp(lambda v: v.sin() * 2, (x,), (x,))[1]

    x = torch.randn(3)
    torch.testing.assert_close(efx.capture(f, x)(x), f(x))
    torch.testing.assert_close(efx.compile(f)(x), f(x))
