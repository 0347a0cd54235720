"""Direct operator calls: generated code without the Python ``OpOverload.__call__`` layer.

:class:`DirectOpCodeGen` makes a graph's code call each operator's C++ entry point (``OpOverload._op``)
directly -- about 1-2 us less per op, which is most of what a small layer costs; ``print(prog)`` still
shows ``torch.ops.ns.op.overload``.  ``simplify_for_runtime`` installs it on the graphs it rebuilds;
:func:`direct_op_calls` is the same as a pass of its own.

Contract of ``direct_op_calls``: requires the token-free form (what runs); gives a new Program whose
graphs compute the same values with the same effects in the same order.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx

from ..program.program import Program
from ..program.records import Form
from .rewrite import EffectCodeGen, GraphRewrite

_OP_CALL = re.compile(r"\btorch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)\(")


class DirectOpCodeGen(EffectCodeGen):
    """Generated code binds ``torch.ops.ns.op.overload`` to globals holding the overloads' ``_op``."""

    runtime_calls = "direct"  # and so does the code graphs run (effectfx.graph.codegen)

    def __init__(self) -> None:
        super().__init__()
        self.display_names: dict[str, str] = {}  # global -> how print(prog) spells it

    def _gen_python_code(self, *args: Any, **kwargs: Any) -> Any:
        code = super()._gen_python_code(*args, **kwargs)
        names: dict[str, str] = {}

        def bind(match: re.Match) -> str:
            spelled = match.group(0)[:-1]
            name = names.get(spelled)
            if name is None:
                op = getattr(getattr(getattr(torch.ops, match.group(1)), match.group(2)), match.group(3))
                name = names[spelled] = f"_op{len(names)}_{match.group(2)}"
                code.globals[name] = op._op
                self.display_names[name] = spelled
            return name + "("

        code.src = _OP_CALL.sub(bind, code.src)
        return code


class DirectCalls(GraphRewrite):
    form_in = (Form.TOKEN_FREE,)
    form_out = Form.TOKEN_FREE

    def done(self, gm: fx.GraphModule) -> None:
        gm.graph.set_codegen(DirectOpCodeGen())
        gm.recompile()


def direct_op_calls(prog: Program) -> Program:
    """Same graphs, generated code calling operators directly (see the module docstring)."""
    return DirectCalls(prog.form).program(prog)
