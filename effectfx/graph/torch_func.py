"""torch.func transforms around effectfx's code: which are active on this thread, how the user spelled
them, which tensors they wrap, and the refusal that names them.  A region body is traced once, on plain
tensors (Note [Region identity]), and a program's graphs run below autograd, so a transform's wrapped
tensors cannot pass into them except as ``vmap`` batches of inference code: the drivers, the region call
and the programs refuse the rest with these words."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from ..errors import UnsupportedOperatorError
from .source import user_location

FUNCTORCH = torch._C._functorch
_FUNCTORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "_functorch") + os.sep
# torch.func's functions by the kind of transform they push (TransformType's names)
_PUBLIC = {"vmap": "Vmap", "grad": "Grad", "grad_and_value": "Grad", "vjp": "Grad", "jacrev": "Grad",
           "jvp": "Jvp", "jacfwd": "Jvp", "linearize": "Jvp", "functionalize": "Functionalize"}
_FAMILY = {"Vmap": "vmap", "Grad": "grad (or vjp, jacrev)", "Jvp": "jvp (or jacfwd)",
           "Functionalize": "functionalize"}


def torch_func_kinds() -> list[str]:
    """The torch.func transforms active on this thread, outermost first: 'Vmap', 'Grad', 'Jvp' or
    'Functionalize'."""
    return [interpreter.key().name for interpreter in FUNCTORCH.get_interpreter_stack() or ()]


def torch_func_name(kind: str) -> str:
    """``torch.func.<name>`` of the innermost call on the stack of a torch.func function of that kind (the
    one the user wrote: ``jacrev``, not the ``vjp`` it runs), else the kind's family."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(_FUNCTORCH_DIR):
            name = getattr(code, "co_qualname", code.co_name).split(".")[0]
            if _PUBLIC.get(name) == kind:
                return f"torch.func.{name}"
        frame = frame.f_back
    return f"torch.func.{_FAMILY.get(kind, kind.lower())}"


def wrapped_or_grad(tensors: list[tuple[str, Any]]) -> tuple[str | None, str | None]:
    """``(wrapped, needs_grad)``: the names of the first tensor in a torch.func wrapper and of the first
    that requires grad (at any level of its wrappers, under grad mode), or None."""
    wrapped = needs_grad = None
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if wrapped is None and FUNCTORCH.is_functorch_wrapped_tensor(t):
            wrapped = name
        while needs_grad is None and torch.is_grad_enabled():
            if t.requires_grad:
                needs_grad = name
            if not FUNCTORCH.is_functorch_wrapped_tensor(t):
                break
            t = FUNCTORCH.get_unwrapped(t)
    return wrapped, needs_grad


def torch_func_refusal(subject: str, kind: str, why: str, todo: str) -> UnsupportedOperatorError:
    """``<subject> is called under torch.func.<name> at <the user's line>: <why>. <todo>.``; ``todo`` may
    name the transform as ``{transform}``."""
    transform = torch_func_name(kind)
    return UnsupportedOperatorError(f"{subject} is called under {transform} at {user_location()}: {why}.\n"
                                    + todo.format(transform=transform) + ".")
