"""Promotion (Note [Region identity]): under grad mode, a call whose floating tensor arguments need no
gradient while another of its tensors does is keyed as if they did, and shares the body of such calls --
unless the ambient state or the body's trace shows the body could not be eager's for it.  Also the guards
that make whether each tensor argument has a history part of a body's identity, when that can matter."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ..graph.traced import TensorMeta, TracedGraph
from ..graph.walk import is_effectful
from ..guards.kinds import Equals, Guard


def promoted_key(key: tuple, leaves: Sequence[Any]) -> tuple | None:
    """The key of a call under grad mode with its floating tensor arguments that do not require grad
    promoted to require it, when another of its tensors does (Note [Region identity], promotion): the
    first layer of a stack, whose input needs no gradient, shares the body of the others.  None when
    nothing is promoted."""
    if not key[0][0]:
        return None
    parts, promoted, needs_grad = list(key), False, False
    for i, leaf in enumerate(leaves):
        part = parts[2 + i]
        if isinstance(part, TensorMeta):
            if part.requires_grad:
                needs_grad = True
            elif part.dtype.is_floating_point or part.dtype.is_complex:
                parts[2 + i] = dataclasses.replace(part, requires_grad=True)
                promoted = True
        elif isinstance(leaf, torch.nn.Module):
            needs_grad = needs_grad or any(meta.requires_grad for _, meta in part[1][1])
    return tuple(parts) if promoted and needs_grad else None


def refusal_before_trace(key: tuple) -> str | None:
    """Why calls with this key are keyed as they are, promotion aside, before any trace: autocast caches
    its casts of leaves that require grad (so leaf-ness is part of a body's identity there)."""
    if any(key[0][1:]):
        return "autocast is on, and it casts a leaf that requires grad once for all its uses"
    return None


def refusal_after_trace(traced: TracedGraph, grad_state_reads: int) -> str | None:
    """Why a body traced with promoted arguments would not be eager's for a call that passes them without
    grad (Note [Region identity]), or None."""
    if traced.mutated:
        return "it updates an operand in place"
    if grad_state_reads:
        return ("its code (or a region it calls) reads a tensor's autograd state (requires_grad, grad_fn, "
                "is_leaf or grad) or calls an autograd.Function")
    if traced.backward is None:
        return None
    if traced.custom_autograd:
        return "it calls a torch.autograd.Function"
    if any(is_effectful(n) for n in traced.backward.graph.nodes if n.op == "call_function"):
        return "its backward has effects, which eager runs only for the gradients it needs"
    return None


def history_guards(looked_at_autograd: bool, autocast: bool, leafness: dict[int, bool]) -> dict[tuple, Guard]:
    """Guards on whether each tensor argument (by leaf index) was a leaf of autograd, when that is part of
    what the body is for: its code looked at autograd state (``x.is_leaf``, ``x.grad_fn is None``), or
    autocast caches its casts of leaves that require grad (the key already holds requires_grad)."""
    if not (looked_at_autograd or autocast):
        return {}
    paths = {i: (("leaf", i), "is_leaf") for i in leafness}
    return {paths[i]: Equals(paths[i], bool, leaf) for i, leaf in leafness.items()}
