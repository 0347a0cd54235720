"""Making the tracer's fake tensors: cheaply (``fake_maker``), with symbolic sizes (``symbolic_context``),
and through fake implementations that keep sizes symbolic where torch's own specialize (Note [Symbolic
shapes]).

A few aten ops have a C++ composite kernel that FakeTensorMode runs as their fake; it reads the sizes as
ints, which pins each symbol to the example's value (a guard): every new length would capture anew.  For
those, the tracer computes the result's metadata itself -- the op stays one aten node in the graph, and
runs its real kernel at run time.  Any other op that pins a symbol is named by ``efx.explain``
(``Tracer.specialized``), so a missing entry here shows up as a reason, never as a wrong answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConfig, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

from ..graph.symbols import expr_of

aten = torch.ops.aten


def fake_maker(mode: FakeTensorMode, device: torch.device) -> Callable[[torch.Tensor, bool], torch.Tensor]:
    """A constructor of fakes on ``device``: what ``FakeTensor(mode, storage, device)`` builds, at a third of
    its cost (a capture makes a fake per op output and per region call site result).  The attribute
    state is copied from a fake made by FakeTensor's own constructor, so it is whatever torch sets."""
    template = FakeTensor(mode, torch.empty(0, device="meta"), device)
    if FakeTensorConfig.debug:  # the debug state is per tensor (a traceback): take the slow path
        return lambda storage, grad: FakeTensor(mode, storage, device).requires_grad_(grad)
    state, backend_device = dict(template.__dict__), template.fake_device
    guard = (torch._C._set_warn_deprecated_on_mutable_data_ptr if mode._allow_unsafe_data_ptr_access
             else torch._C._set_throw_on_mutable_data_ptr)

    def make(storage: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        t = torch.Tensor._make_subclass(FakeTensor, storage, requires_grad, dispatch_device=True,
                                        device_for_backend_keys=backend_device)
        guard(t)
        t.__dict__.update(state)
        return t

    return make


def symbolic_context(value: torch.Tensor, dynamic: frozenset[int], name: str) -> tuple[Any, Any]:
    """How ``FakeTensorMode.from_tensor`` makes the fake of an argument whose sizes ``dynamic`` names
    symbols, and its source (the name its guards use)."""
    from torch._dynamo.source import LocalSource  # (torch._dynamo takes 1.4 s to import: only here)

    context = StatelessSymbolicContext(dynamic_sizes=[
        DimDynamic.DYNAMIC if d in dynamic else DimDynamic.STATIC for d in range(value.dim())])
    return context, LocalSource(name)


def _constant_pad_nd(x: torch.Tensor, pad: list[Any], value: Any = 0) -> torch.Tensor:
    shape = list(x.shape)
    for k in range(len(pad) // 2):  # pairs from the last dimension backwards, as F.pad takes them
        shape[-1 - k] = shape[-1 - k] + pad[2 * k] + pad[2 * k + 1]
    memory_format = torch._prims_common.suggest_memory_format(x)
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=memory_format)


def _contiguous(t: torch.Tensor) -> bool:
    """Contiguous by the expressions of its strides (asking the symbols would guard)."""
    expected: Any = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        size = expr_of(size)
        if size != 1 and expr_of(stride) != expected:
            return False
        expected = expected * size
    return True


_FLOATS = (torch.float32, torch.float64)  # where CPU's mean and rstd keep the input's dtype


def _plain(t: Any) -> bool:
    return t is None or (t.dtype in _FLOATS and _contiguous(t))


def _native_layer_norm(x: torch.Tensor, normalized_shape: list[Any], weight: Any, bias: Any,
                       eps: float) -> Any:
    """torch's reference decomposes into some twenty ops per call, each slow on symbolic sizes; its results
    are the input's layout (contiguous here) and keep-dim statistics."""
    if not (x.device.type == "cpu" and all(map(_plain, (x, weight, bias)))):
        return NotImplemented
    axis = x.dim() - len(normalized_shape)
    stats = [*x.shape[:axis], *([1] * len(normalized_shape))]
    return tuple(torch.empty(shape, dtype=x.dtype, device=x.device) for shape in (x.shape, stats, stats))


def _native_layer_norm_backward(grad: torch.Tensor, x: torch.Tensor, normalized_shape: list[Any], mean: Any,
                                rstd: Any, weight: Any, bias: Any, output_mask: list[bool]) -> Any:
    if not (x.device.type == "cpu" and all(map(_plain, (grad, x, weight, bias)))):
        return NotImplemented
    like = [x, weight, bias]
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) if t is not None and m else None
                 for t, m in zip(like, output_mask))


def _product(sizes: Any) -> Any:
    out: Any = 1
    for d in sizes:
        out = out * d
    return out


def _view(x: torch.Tensor, size: list[Any]) -> Any:
    """A view of a contiguous tensor whose sizes multiply to its own (as expressions: no guard): torch's
    reference runs its general reshape algorithm, some thirty size comparisons on symbols."""
    size = list(size)
    holes = [i for i, d in enumerate(size) if type(d) is int and d == -1]
    if len(holes) > 1 or not _contiguous(x):
        return NotImplemented
    numel = _product(x.shape)
    if holes:
        known = _product(d for i, d in enumerate(size) if i != holes[0])
        if expr_of(known) == 0:
            return NotImplemented
        size[holes[0]] = numel // known
    if expr_of(_product(size)) != expr_of(numel):
        return NotImplemented  # (torch's own decides, and may guard)
    strides, step = [], 1
    for d in reversed(size):
        strides.insert(0, step)
        step = step * d
    return x.as_strided(size, strides, x.storage_offset())


def _elementwise(a: Any, b: Any, true_division: bool = False, **kwargs: Any) -> Any:
    """``a op b`` where ``a`` is contiguous and ``b`` a number or a tensor that broadcasts to ``a``'s shape
    (each of its sizes ``a``'s, by expression, or 1) and is contiguous: ``a``'s layout, the promoted dtype.
    torch's own compares every pair of sizes through the ShapeEnv."""
    if not isinstance(a, torch.Tensor) or kwargs.keys() - {"alpha"} or not _contiguous(a):
        return NotImplemented
    if isinstance(b, torch.Tensor):
        if b.dim() > a.dim() or b.device != a.device or not _contiguous(b):
            return NotImplemented
        for mine, theirs in zip(reversed(a.shape), reversed(b.shape)):
            if not (type(theirs) is int and theirs == 1) and expr_of(mine) != expr_of(theirs):
                return NotImplemented
    elif not isinstance(b, (int, float, bool)):
        return NotImplemented
    dtype = torch.result_type(a, b)
    if true_division and not (dtype.is_floating_point or dtype.is_complex):  # 7 / 2 is 3.5
        dtype = torch.get_default_dtype()
    return torch.empty_strided(a.shape, a.stride(), dtype=dtype, device=a.device)


SYMBOLIC_FAKES: dict[Any, Callable[..., Any]] = {
    **dict.fromkeys((aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor), _elementwise),
    aten.div.Tensor: lambda a, b, **kwargs: _elementwise(a, b, True, **kwargs),
    aten.view.default: _view,
    aten.constant_pad_nd.default: _constant_pad_nd,
    aten.native_layer_norm.default: _native_layer_norm,
    aten.native_layer_norm_backward.default: _native_layer_norm_backward,
}
