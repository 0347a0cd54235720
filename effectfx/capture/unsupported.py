"""Turning torch's failures on things effectfx cannot capture yet into errors that name them.

Higher-order ops (``torch.cond``, ``while_loop``, the print HOP, ``flex_attention``) have no rule for
effectfx's tracer, so torch raises a bare ``NotImplementedError`` from deep inside its dispatcher.  This
module recognizes that failure and raises :class:`UnsupportedOperatorError` naming the op and the user's
line instead.

Eager ``torch.cond`` and friends run through ``torch.compile``; called under effectfx's dispatch mode,
Dynamo skips every frame it sees and remembers those skips on the code objects, after which eager
``torch.cond`` fails in the whole process.  :func:`dynamo_mark` / :func:`forget_dynamo_frames` undo
that: the frames Dynamo first saw during the failed trace are reset, as if never seen.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import UnsupportedOperatorError
from .source import user_location

_ADVICE = {
    "cond": "compute both branches and select with torch.where, or decide outside the captured function",
    "while_loop": "unroll the loop in Python (its trip count must then be known), or run it outside the "
                  "captured function",
    "scan": "unroll the loop in Python, or run it outside the captured function",
    "map": "call the function on each slice in a Python loop, or run it outside the captured function",
    "print": "use Python print() (captured as an ordered effect) or torch.ops.aten._print",
    "flex_attention": "use torch.nn.functional.scaled_dot_product_attention with an attention mask, or run "
                      "it outside the captured function",
}


def _input_codes() -> Any:
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    return getattr(convert_frame, "input_codes", None)


def dynamo_mark() -> int:
    """How many code objects Dynamo has seen so far (cheap; pass it to :func:`unsupported_operator`)."""
    codes = _input_codes()
    return len(codes.seen) if codes is not None else 0


def forget_dynamo_frames(mark: int, exc: BaseException) -> None:
    """Reset Dynamo's state of the code objects it first saw after ``mark`` and of those ``exc`` passed
    through (the HOP's compiled wrapper, seen already by an earlier eager call): see the module docstring."""
    codes = _input_codes()
    if codes is None:
        return
    import torch

    reset_code = torch._C._dynamo.eval_frame.reset_code
    seen = [ref() for ref in codes.seen[mark:]]
    tb = exc.__traceback__
    while tb is not None:
        seen.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    for code in seen:
        if code is not None and code in codes:
            reset_code(code)


def _higher_order_op(exc: BaseException) -> Any:
    """The HigherOrderOperator whose dispatch raised ``exc`` (innermost first), or None."""
    from torch._ops import HigherOrderOperator

    tb = exc.__traceback__
    found = None
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, HigherOrderOperator):
            found = candidate
        tb = tb.tb_next
    return found


def unsupported_operator(exc: BaseException, where: str, mark: int) -> UnsupportedOperatorError | None:
    """The error to raise instead of ``exc`` when it is torch refusing a higher-order op under effectfx's
    tracer (``where`` names the graph being traced), else None."""
    if not isinstance(exc, NotImplementedError):
        return None
    hop = _higher_order_op(exc)
    if hop is None or "no rule registered for" not in str(exc):
        return None
    forget_dynamo_frames(mark, exc)
    name = hop.name()
    advice = _ADVICE.get(name, "run it outside the captured function")
    return UnsupportedOperatorError(
        f"{where} calls the higher-order op {name!r} (torch.ops.higher_order.{name}) at "
        f"{user_location(exc)}.\neffectfx cannot capture higher-order ops yet: {advice}."
    )
