"""The print HOP (``torch._higher_order_ops.print(format_str, *args, **kwargs)``) in captured code.

In eager it prints ``format_str.format(*args, **kwargs)`` with the built-in ``print``; that is what its
capture rule runs, with the tracer on the stack, so the call is Python ``print`` in captured code
(``effectfx.interposers.python_print``): the tensors' ``format``/``repr`` become slots, and one
``effectfx::print`` node (key ``"ordered"``) prints the text at run time, with run-time values, in program
order.  Capture prints nothing.  It leaves no node of its own, so it has no row in ``effectfx.ops.HOPS``.
"""

from __future__ import annotations

from typing import Any

from torch._higher_order_ops.print import Print, print_impl

from ..interposers.takeover import take_over


def capture_print(tracer: Any, format_str: str, *args: Any, **kwargs: Any) -> None:
    print_impl(format_str, *args, **kwargs)  # eager's kernel: its built-in ``print`` is the capture's


take_over(Print, capture_print)
