"""simplify_for_runtime: fewer and cheaper calls in the graphs efx.compile runs.

Contract: requires the token-free form (graphs run with grad disabled; Note [Effect tokens]); gives a new
Program computing the same values with the same effects in the same order, with the calls that only autograd
needed removed, and generated code that calls operators directly (``passes.direct_calls``).  Rules
(``_simplify``):

========================  =====================================================================
``aten.detach(x)``         ``x``: without autograd recording, detach is the identity on values (kept
                           where something could tell: returned, it must not alias an input; passed to
                           an effect, a region or a custom op, which may show ``requires_grad``)
``aten.t(aten.t(x))``      ``x``: the double transposes a joint trace leaves in backward formulas
========================  =====================================================================

``simplify_in_place`` applies the same rules to the graphs of a program nobody else holds -- efx.compile's
own capture, which it runs once and drops -- instead of to copies: a capture's root graph has a few nodes
per region call site, and copying them is most of what the pass costs.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph.walk import get_attr, node_effect_keys
from ..program.program import Program
from ..program.records import Form
from .dce import eliminate_dead_code
from .direct_calls import DirectOpCodeGen
from .rewrite import GraphRewrite

aten = torch.ops.aten


def _plain_aten(node: fx.Node) -> bool:
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and target.namespace == "aten" and not node_effect_keys(node))


def _observed(node: fx.Node) -> bool:
    """Whether anything could tell the detach is gone: only plain aten ops use the value, through detaches."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for user in n.users:
            if user.target is aten.detach.default:
                if user not in seen:
                    seen.add(user)
                    stack.append(user)
            elif not _plain_aten(user):
                return True
    return False


def _simplify(gm: fx.GraphModule) -> None:
    """The rules of the table above, applied to ``gm``'s own graph in place (in order: a node's argument is
    already simplified when the node is looked at)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.detach.default:
            # the value of a graph input may require grad (the compiled function's own inputs and
            # parameters): returned without its detach it would hand the caller its own input back, and an
            # effect, a region or a custom op would see requires_grad=True where eager passes a detached alias
            if not _observed(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
        elif node.target is aten.t.default:
            inner = node.args[0]
            if isinstance(inner, fx.Node) and inner.op == "call_function" and inner.target is aten.t.default:
                node.replace_all_uses_with(inner.args[0])
                graph.erase_node(node)
    eliminate_dead_code(graph)  # the transposes a fold left without users
    graph.set_codegen(DirectOpCodeGen())
    gm.recompile()


class _Copied(GraphRewrite):
    """Every graph copied (each body once), then simplified."""

    form_in = (Form.TOKEN_FREE,)
    form_out = Form.TOKEN_FREE

    def done(self, gm: fx.GraphModule) -> None:
        _simplify(gm)


def simplify_for_runtime(prog: Program) -> Program:
    """Token-free -> token-free without autograd-only calls (see the module docstring)."""
    return _Copied(prog.form).program(prog)


def _simplify_all(gm: fx.GraphModule, seen: set[int]) -> None:
    if id(gm) in seen:
        return
    seen.add(id(gm))
    for node in gm.graph.find_nodes(op="get_attr"):
        sub = get_attr(gm, node.target)
        if isinstance(sub, fx.GraphModule):
            _simplify_all(sub, seen)
    _simplify(gm)


def simplify_in_place(prog: Program) -> Program:
    """``simplify_for_runtime`` for a program nobody else holds (see the module docstring): the program it
    was given, its graphs simplified in place.  Contract: requires the token-free form."""
    if prog.form is not Form.TOKEN_FREE:
        return simplify_for_runtime(prog)  # refuses the form, as the copying pass does
    _simplify_all(prog.graph_module, set())
    return prog.replace(form=Form.TOKEN_FREE, token_keys=())
