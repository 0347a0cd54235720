"""Turning torch's failures on things effectfx cannot capture yet into errors that name them.

Higher-order ops without a capture rule (``map``; ``effectfx.hops`` holds those effectfx captures:
print, cond, while_loop, scan, flex_attention) make torch raise a bare
``NotImplementedError`` from deep inside its dispatcher -- or, when the op's autograd rule runs first
(``map`` on a tensor that requires grad), whatever that rule trips over.  This module recognizes both and
raises :class:`UnsupportedOperatorError` naming the op and the user's line instead.

A refused capture leaves torch usable: eager ``torch.cond`` and friends run through ``torch.compile``, and
the frames Dynamo saw during the capture are forgotten when it ends (``effectfx.interposers.dynamo_frames``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import optimization_hint
from torch.utils._pytree import tree_map

from ..errors import (
    CaptureError,
    DataDependentControlFlowError,
    EffectfxError,
    MissingFakeImplError,
    UnsupportedOperatorError,
    op_error,
)
from ..graph.source import user_location
from ..interposers.takeover import taken_over

_ADVICE = {
    "map_impl": "call the function on each slice in a Python loop, or run it outside the captured function",
}


def _higher_order_op(exc: BaseException) -> Any:
    """The outermost HigherOrderOperator without a capture rule whose call raised ``exc`` -- the one the
    user called (``while_loop``, not the ``while_loop_stack_output`` its autograd rule calls) -- or None."""
    tb = exc.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, HigherOrderOperator) and not taken_over(candidate):
            return candidate
        tb = tb.tb_next
    return None


def unsupported_operator(exc: BaseException, where: str) -> UnsupportedOperatorError | None:
    """The error to raise instead of ``exc`` when it is torch refusing a higher-order op under effectfx's
    tracer, or any failure inside a higher-order op the tracer has no rule for (``where`` names the graph
    being traced), else None."""
    if isinstance(exc, UnsupportedOperatorError):
        return None
    if isinstance(exc, NotImplementedError):
        if "no rule registered for" not in str(exc):
            return None
    elif not isinstance(exc, (RuntimeError, EffectfxError)):
        return None
    hop = _higher_order_op(exc)
    if hop is None:
        return None
    name = hop.name()
    advice = _ADVICE.get(name, "run it outside the captured function")
    return UnsupportedOperatorError(
        f"{where} calls the higher-order op {name!r} (torch.ops.higher_order.{name}) at "
        f"{user_location(exc)}.\neffectfx cannot capture this higher-order op yet: {advice}."
    )


def fake_failure(exc: Exception, func: Any, args: tuple, kwargs: dict, where: str
                 ) -> tuple[EffectfxError, BaseException | None]:
    """The error naming the op for torch's failure to run ``func`` on fakes, and the cause to chain (torch's
    own message says no more than ours for a missing fake or a data-dependent shape, under dozens of
    dispatcher frames).  A failure eager has too (the op fails on real tensors like the fakes) is eager's
    error, of eager's class: :func:`effectfx.errors.op_error` (Note [Errors are eager's])."""
    text = str(exc)
    if "fake impl" in text or "meta" in text.lower() and "kernel" in text.lower():
        return MissingFakeImplError(
            f"{func} has no fake implementation, so effectfx cannot trace it without running it "
            f"(called from {where} at {user_location()}).\nRegister one with "
            f"@<op>.register_fake (torch.library.register_fake('{func._schema.name}'))."
        ), None
    if "data-dependent" in text or "DynamicOutputShape" in type(exc).__name__:
        return DataDependentControlFlowError(
            f"{func} in {where} has an output whose shape depends on tensor values (at {user_location()}); "
            "effectfx captures static shapes, or sizes symbolic in its inputs' (Note [Symbolic shapes]), "
            "never from a tensor's values. Mask instead of indexing (torch.where), or do that part outside."
        ), None
    eager = _eager_error(func, args, kwargs)
    if eager is not None:  # the user's error, not effectfx's: eager's class and message
        return op_error(type(eager), str(eager), f"{func} raised this in {where} at {user_location()}, as "
                                                 "it does in eager PyTorch"), None
    return CaptureError(f"effectfx could not trace {func} in {where} at {user_location()}: "
                        f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"), exc


_REAL_LIMIT = 1 << 24  # elements: a bigger tensor is made on the meta device, whose checks are eager's too


def _real(value: Any) -> Any:
    """A real tensor (zeros) with a fake's sizes, strides, offset, dtype and device; a size hint for a
    symbolic size."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return optimization_hint(value) if isinstance(value, torch.SymInt) else value.node.hint
    if not isinstance(value, FakeTensor):
        return value
    size = [optimization_hint(s) for s in value.shape]
    stride = [optimization_hint(s) for s in value.stride()]
    offset = optimization_hint(value.storage_offset())
    extent = 0 if 0 in size else offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
    device = value.fake_device if extent <= _REAL_LIMIT else torch.device("meta")
    return torch.zeros(extent, dtype=value.dtype, device=device).as_strided(size, stride, offset)


def _eager_error(func: Any, args: tuple, kwargs: dict) -> BaseException | None:
    """What eager raises running ``func`` on tensors like ``args``' fakes (a shape or dtype check fails
    alike on any values), or None: the op runs in eager, and the failure is the fake kernel's alone."""
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), torch.no_grad():
        try:
            real_args, real_kwargs = tree_map(_real, (args, kwargs))
        except Exception:  # (a device this process cannot allocate on)
            return None
        try:
            func(*real_args, **real_kwargs)
        except Exception as exc:
            return exc
    return None
