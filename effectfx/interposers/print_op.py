"""The effect op a captured ``print`` becomes, and how it renders each tensor as eager would have:

    effectfx::print(str fmt, Tensor[] tensors, str[] modes, int stream, bool flush) -> ()

``fmt`` is the whole printed text (``sep`` and ``end`` included) with a ``{}`` slot per tensor; at run time
each slot gets its tensor rendered by its ``mode``:

* ``"r"`` -- ``Tensor.__repr__`` of the run-time tensor (a graph input: its own ``requires_grad``);
* ``"r:<suffix>"`` -- ``Tensor.__repr__`` of the run-time value plus the autograd suffix eager shows
  (``grad_fn=<MulBackward0>``, ``requires_grad=True``), known at capture: graphs run without autograd;
* ``"f:<spec>"`` -- ``format(value, spec)`` of a 0-dim tensor (``f"{loss:.3f}"``);
* an ``"r"`` mode led by the ``torch.func`` wrappers eager shows around the value, outermost first, as
  torch's ``_functorch_wrapper_str_intern`` lays them out: ``"B<lvl>,<bdim>;"`` (vmap's
  ``BatchedTensor``), ``"G<lvl>;"`` (grad's and jvp's ``GradTrackingTensor``), ``"F<lvl>;"``
  (functionalize's ``FunctionalTensor``).  The op gets the plain tensor inside them (:func:`peel`): eager's
  print is not an op, so no transform may see this one (``print_options.emit``).

A program run under ``torch.vmap`` prints its batched tensors as eager does too (:func:`_vmap_rule`).

Every tensor is laid out with the print options in force when the op runs: the caller's, and those the
captured code set before it (``effectfx.interposers.print_options``).  ``stream`` is 1 for ``sys.stdout`` and
2 for ``sys.stderr``, looked up at run time (as eager's ``print`` does).
"""

from __future__ import annotations

import builtins
import re
import sys
import textwrap
from typing import Any

import torch

from ..effects import register_effect

ORIGINAL_PRINT = builtins.print
ORIGINAL_REPR = torch.Tensor.__repr__
_STREAMS = {1: lambda: None, 2: lambda: sys.stderr}  # None: print's own default, the current sys.stdout
_WRAPPER = re.compile(r"([BGF])(\d+)(?:,(\d+))?;")
_SUFFIX_LINE = re.compile(r" {7}[a-z_]+=")  # "       dtype=torch.float64": a suffix torch wrapped
_FUNCTORCH = torch._C._functorch


def _with_suffix(text: str, suffix: str) -> str:
    """``Tensor.__repr__`` text with one more suffix, laid out as torch's ``_add_suffixes`` does."""
    body, indent = text[:-1], len("tensor(")
    last = body[body.rfind("\n") + 1:]
    # torch counts a line of the values 2 longer than it is, a line it wrapped a suffix onto as it is
    last_line = len(last) + (0 if _SUFFIX_LINE.match(last) else 2)
    if last_line + len(suffix) + 2 > torch._tensor_str.PRINT_OPTS.linewidth:
        return f"{body},\n{' ' * indent}{suffix})"
    return f"{body}, {suffix})"


def _wrapped(text: str, kind: str, level: str, bdim: str | None) -> str:
    if kind == "F":
        return f"FunctionalTensor(lvl={level}, value=\\\n{text})"
    value = textwrap.indent(text, " " * 4)
    if kind == "B":
        return f"BatchedTensor(lvl={level}, bdim={bdim}, value=\n{value}\n)"
    return f"GradTrackingTensor(lvl={level}, value=\n{value}\n)"


def render(t: torch.Tensor, mode: str) -> str:
    """``t`` as eager prints the tensor it stands for (module docstring)."""
    wrappers = []
    while (wrapper := _WRAPPER.match(mode)) is not None:
        wrappers.append(wrapper.groups())
        mode = mode[wrapper.end():]
    kind, _, rest = mode.partition(":")
    if kind == "f":
        return format(t.detach().item(), rest)
    text = ORIGINAL_REPR(t) if not rest else _with_suffix(ORIGINAL_REPR(t.detach()), rest)
    for wrapper in reversed(wrappers):
        text = _wrapped(text, *wrapper)
    return text


def peel(t: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """The plain tensor inside ``t``'s ``torch.func`` wrappers and the prefix of its mode naming them; None
    for a wrapper torch itself cannot print."""
    prefix = ""
    while _FUNCTORCH.is_functorch_wrapped_tensor(t):
        level = _FUNCTORCH.maybe_get_level(t)
        if _FUNCTORCH.is_batchedtensor(t):
            prefix += f"B{level},{_FUNCTORCH.maybe_get_bdim(t)};"
        elif _FUNCTORCH.is_gradtrackingtensor(t):
            prefix += f"G{level};"
        elif _FUNCTORCH.is_functionaltensor(t):
            torch._sync(t)  # its value up to date, as eager's print makes it (recorded: pure ops)
            prefix += f"F{level};"
        else:
            return t, None
        t = _FUNCTORCH.get_unwrapped(t)
    return t, prefix


def batched(t: torch.Tensor) -> bool:
    """Whether ``t`` is, or wraps, a ``vmap`` BatchedTensor (which has no item, in eager as here)."""
    while _FUNCTORCH.is_functorch_wrapped_tensor(t):
        if _FUNCTORCH.is_batchedtensor(t):
            return True
        t = _FUNCTORCH.get_unwrapped(t)
    return False


@torch.library.custom_op("effectfx::print", mutates_args=(),
                         schema="(str fmt, Tensor[] tensors, str[] modes, int stream, bool flush) -> ()")
def print_op(fmt: str, tensors: list[torch.Tensor], modes: list[str], stream: int, flush: bool) -> None:
    """Print ``fmt`` with each ``{}`` slot filled by its tensor rendered by its mode (module docstring)."""
    text = fmt.format(*(render(t, m) for t, m in zip(tensors, modes)))
    ORIGINAL_PRINT(text, end="", file=_STREAMS[stream](), flush=flush)


@print_op.register_fake
def _(fmt: str, tensors: list[torch.Tensor], modes: list[str], stream: int, flush: bool) -> None:
    return None


def _vmap_rule(info: Any, in_dims: tuple, fmt: str, tensors: list[torch.Tensor], modes: list[str],
               stream: int, flush: bool) -> tuple[None, None]:
    """A program run under ``torch.vmap`` (``vmap(efx.compile(f))``): eager shows each tensor batched at
    this level as ``BatchedTensor(lvl, bdim, value=...)``, inside the wrappers of the levels above, whose
    rules ran first; the tensors come unwrapped."""
    level = _FUNCTORCH.maybe_current_level()
    marked = []
    for mode, bdim in zip(modes, in_dims[1]):
        end = 0
        while (wrapper := _WRAPPER.match(mode, end)) is not None:
            end = wrapper.end()
        marked.append(mode if bdim is None else f"{mode[:end]}B{level},{bdim};{mode[end:]}")
    print_op(fmt, tensors, marked, stream, flush)
    return None, None


print_op.register_vmap(_vmap_rule)
register_effect(print_op, key="ordered")
