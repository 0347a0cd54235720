"""Higher-order ops the tracer has a rule for (the others are refused: ``effectfx.capture.unsupported``).

A higher-order op (HOP) reaches a dispatch mode through the op's own table of rules, one per mode class
(``hop.py_impl(Tracer)``), not through ``__torch_dispatch__``.  The HOP's dispatch pops the mode before
calling the rule; a rule that records ops pushes the tracer back for the time it runs.

The print HOP (``torch._higher_order_ops.print(format_str, *args, **kwargs)``).  In eager it prints
``format_str.format(*args, **kwargs)`` with the built-in ``print``; that is what the rule runs, with the
tracer on the stack, so the call is Python ``print`` in captured code (``effectfx.capture.python_print``):
the tensors' ``format``/``repr`` become slots, and one ``effectfx::print`` node (key ``"ordered"``) prints
the text at run time, with run-time values, in program order.  Capture prints nothing.
"""

from __future__ import annotations

from typing import Any

from torch._higher_order_ops.print import print as print_hop
from torch._higher_order_ops.print import print_impl

from .tracer import Tracer


@print_hop.py_impl(Tracer)
def _print_under_tracer(mode: Tracer, format_str: str, *args: Any, **kwargs: Any) -> None:
    # eager's kernel, under the tracer: its built-in ``print`` is the capture's (python_print)
    with mode:
        print_impl(format_str, *args, **kwargs)


# torch.cond, while_loop, scan and flex_attention: taken over before dispatch (see each module)
from . import control_flow, flex  # noqa: E402, F401
