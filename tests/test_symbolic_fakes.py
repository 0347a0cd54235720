"""effectfx's fake implementations for symbolic sizes (``effectfx.capture.fakes``, Note [Symbolic shapes])
give exactly the metadata torch's own give -- sizes, strides and dtypes by expression -- without the guards
or the cost of torch's, on generated inputs."""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from effectfx.capture.fakes import SYMBOLIC_FAKES
from effectfx.capture.tracer import Tracer
from effectfx.graph.symbols import dims, hint

aten = torch.ops.aten


def _meta(value: object) -> object:
    if isinstance(value, (tuple, list)):
        return tuple(_meta(v) for v in value)
    if value is None:
        return None
    return dims(value.shape), dims(value.stride()), value.dtype


def _both(op: object, make: object) -> tuple[object, object, int, int]:
    """``op`` through effectfx's fake and torch's, each on fresh symbolic inputs: results and guards added."""
    results = []
    for fake in (SYMBOLIC_FAKES[op], op):
        tracer = Tracer(lambda *a: None, symbolic=True)
        args = make(tracer)
        before = len(tracer.shape_env.guards)
        with tracer.fake_mode:
            out = fake(*args)
        results.append((_meta(out), len(tracer.shape_env.guards) - before))
    (mine, mine_guards), (torch_s, torch_guards) = results
    return mine, torch_s, mine_guards, torch_guards


shapes = st.lists(st.integers(2, 6), min_size=2, max_size=4)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(shape=shapes, normalized=st.integers(1, 2), affine=st.booleans(), dynamic=st.sets(st.integers(0, 3)),
       mask=st.tuples(st.booleans(), st.booleans(), st.booleans()), double=st.booleans())
def test_layer_norm_fakes_match_torch(shape: list[int], normalized: int, affine: bool, dynamic: set[int],
                                      mask: tuple[bool, bool, bool], double: bool) -> None:
    normalized = min(normalized, len(shape) - 1)
    dtype = torch.float64 if double else torch.float32
    norm_shape = shape[-normalized:]

    def inputs(tracer: Tracer) -> list:
        dims_ = frozenset(d for d in dynamic if d < len(shape) - normalized)  # the statistics' sizes
        x = tracer.symbolic_fake(torch.randn(shape, dtype=dtype), dims_, "x")
        with tracer.fake_mode:
            w = torch.empty(norm_shape, dtype=dtype) if affine else None
            b = torch.empty(norm_shape, dtype=dtype) if affine else None
        return [x, w, b]

    def forward(tracer: Tracer) -> list:
        x, w, b = inputs(tracer)
        return [x, x.shape[len(shape) - normalized:], w, b, 1e-5]

    mine, theirs, mine_guards, _ = _both(aten.native_layer_norm.default, forward)
    assert mine == theirs and mine_guards == 0

    def backward(tracer: Tracer) -> list:
        x, w, b = inputs(tracer)
        with tracer.fake_mode:
            stats = torch.empty([*x.shape[:len(shape) - normalized], *[1] * normalized], dtype=dtype)
            grad = torch.empty(x.shape, dtype=dtype)
        return [grad, x, x.shape[len(shape) - normalized:], stats, stats, w, b, list(mask)]

    mine, theirs, mine_guards, _ = _both(aten.native_layer_norm_backward.default, backward)
    assert mine == theirs and mine_guards == 0


@settings(max_examples=15, deadline=None, derandomize=True)
@given(shape=shapes, pads=st.lists(st.integers(0, 3), min_size=2, max_size=4),
       dynamic=st.sets(st.integers(0, 3)))
def test_constant_pad_fake_is_eager_s_layout_and_pins_no_size(shape: list[int], pads: list[int],
                                                              dynamic: set[int]) -> None:
    """torch's own fake pins every size it reads (its C++ kernel reads them as ints): compare with eager."""
    pads = pads[: 2 * len(shape)] if len(pads) % 2 == 0 else pads[:-1]
    real = torch.randn(shape)
    tracer = Tracer(lambda *a: None, symbolic=True)
    x = tracer.symbolic_fake(real, frozenset(d for d in dynamic if d < len(shape)), "x")
    with tracer.fake_mode:
        out = SYMBOLIC_FAKES[aten.constant_pad_nd.default](x, pads, 0.0)
    assert tracer.shape_env.guards == [] and tracer.shape_env.replacements == {}
    expected = torch.constant_pad_nd(real, pads, 0.0)
    assert tuple(map(hint, out.shape)) == expected.shape
    assert tuple(map(hint, out.stride())) == expected.stride()
    assert out.dtype == expected.dtype


@settings(max_examples=25, deadline=None, derandomize=True)
@given(shape=shapes, dynamic=st.sets(st.integers(0, 3)), split=st.integers(0, 3), hole=st.booleans())
def test_view_fake_matches_torch(shape: list[int], dynamic: set[int], split: int, hole: bool) -> None:
    """A view of a contiguous tensor: flatten two neighbouring sizes, or split one off as (2, -1)."""

    def make(tracer: Tracer) -> list:
        x = tracer.symbolic_fake(torch.randn(shape), frozenset(d for d in dynamic if d < len(shape)), "x")
        sizes = list(x.shape)
        k = split % len(sizes)
        if k + 1 < len(sizes):  # merge sizes k and k + 1
            sizes[k:k + 2] = [-1 if hole else sizes[k] * sizes[k + 1]]
        else:
            sizes.append(1)
        return [x, sizes]

    mine, theirs, mine_guards, _ = _both(aten.view.default, make)
    assert mine == theirs and mine_guards == 0


@settings(max_examples=40, deadline=None, derandomize=True)
@given(shape=shapes, dynamic=st.sets(st.integers(0, 3)), other=st.sampled_from(["same", "trailing", "ones",
                                                                                  "number", "int", "scalar"]),
       op=st.sampled_from([aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor]),
       integral=st.booleans())
def test_elementwise_fake_matches_torch(shape: list[int], dynamic: set[int], other: str, op: object,
                                        integral: bool) -> None:
    dtype = torch.int64 if integral else torch.float32

    def make(tracer: Tracer) -> list:
        dims_ = frozenset(d for d in dynamic if d < len(shape))
        x = tracer.symbolic_fake(torch.ones(shape, dtype=dtype), dims_, "x")
        with tracer.fake_mode:
            if other == "same":
                b = torch.empty(x.shape)
            elif other == "trailing":
                b = torch.empty(x.shape[-1:], dtype=dtype)
            elif other == "ones":
                b = torch.empty([1] * (len(shape) - 1) + [x.shape[-1]])
            elif other == "scalar":
                b = torch.empty([], dtype=torch.float64)
            else:
                b = 2.5 if other == "number" else 3
        return [x, b]

    mine, theirs, mine_guards, _ = _both(op, make)
    assert mine == theirs and mine_guards == 0
