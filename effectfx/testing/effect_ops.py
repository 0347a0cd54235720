"""Effectful ops that write to one log, so eager and effectfx runs can be compared call by call.

* ``efxtest::record_<key>(label)`` -- no tensors, one op per effect key in :data:`EFFECT_KEYS`;
* ``efxtest::log_tensor(x, label)`` -- logs a fingerprint of ``x``'s value (key "stdout"), so a wrong
  argument shows up in the log;
* ``efxtest::bump(x, label) -> x + 1`` -- an effect that returns a tensor (key "memory");
* ``efxtest::scale(x, s) -> x * s`` -- pure forward, but its backward records ``("grad", s)`` on key
  "memory": an effect that exists only in backward;
* :func:`noted` and :func:`shifted` -- plain Python functions for ``efx.callback`` (Note [Callbacks]), no op:
  the first logs a fingerprint of its tensor, the second also returns a tensor (``result_shape=x``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch

import effectfx as efx

LOG: list[tuple] = []
EFFECT_KEYS = ("memory", "stdout", "collective:tp")


def _fingerprint(x: torch.Tensor) -> float:
    return round(float(x.detach().double().sum()), 4)


def _define_record(key: str) -> None:
    name = "record_" + re.sub(r"\W", "_", key)

    def impl(label: str) -> None:
        LOG.append((name, label))

    op = torch.library.custom_op(f"efxtest::{name}", impl, mutates_args=(),
                                 schema="(str label) -> ()")
    op.register_fake(lambda label: None)
    efx.register_effect(op, key=key)


for _key in EFFECT_KEYS:
    _define_record(_key)


@torch.library.custom_op("efxtest::log_tensor", mutates_args=())
def log_tensor(x: torch.Tensor, label: str) -> None:
    LOG.append(("log_tensor", label, tuple(x.shape), _fingerprint(x)))


@log_tensor.register_fake
def _(x: torch.Tensor, label: str) -> None:
    return None


@torch.library.custom_op("efxtest::bump", mutates_args=())
def bump(x: torch.Tensor, label: str) -> torch.Tensor:
    LOG.append(("bump", label, _fingerprint(x)))
    return x + 1


@bump.register_fake
def _(x: torch.Tensor, label: str) -> torch.Tensor:
    return torch.empty_like(x)


bump.register_autograd(lambda ctx, g: (g, None))


@torch.library.custom_op("efxtest::scale", mutates_args=())
def scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


@scale.register_fake
def _(x: torch.Tensor, s: float) -> torch.Tensor:
    return torch.empty_like(x)


def _scale_backward(ctx: object, grad: torch.Tensor) -> tuple:
    torch.ops.efxtest.record_memory(f"grad {ctx.s}")  # type: ignore[attr-defined]
    return grad * ctx.s, None  # type: ignore[attr-defined]


def _scale_setup(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.s = inputs[1]  # type: ignore[attr-defined]


scale.register_autograd(_scale_backward, setup_context=_scale_setup)

efx.register_effect(log_tensor, key="stdout")
efx.register_effect(bump, key="memory")


def noted(x: torch.Tensor, label: str) -> None:
    """For ``efx.callback(noted, x, label, key=...)``: logs a fingerprint of ``x``."""
    LOG.append(("noted", label, tuple(x.shape), _fingerprint(x)))


def shifted(x: torch.Tensor, label: str) -> torch.Tensor:
    """For ``efx.callback(shifted, x, label, result_shape=x)``: logs ``x`` and returns ``cos(x) + 1``."""
    LOG.append(("shifted", label, _fingerprint(x)))
    return x.cos() + 1


@contextlib.contextmanager
def recording() -> Iterator[list[tuple]]:
    """Collect the effects performed inside the block (a fresh list each time)."""
    start = len(LOG)
    collected: list[tuple] = []
    try:
        yield collected
    finally:
        collected.extend(LOG[start:])
        del LOG[start:]
