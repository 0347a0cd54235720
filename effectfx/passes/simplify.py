"""simplify_for_runtime: fewer and cheaper calls in the graphs efx.compile runs.

Contract: requires the token-free form (graphs run with grad disabled; Note [Effect tokens]); gives a new
Program computing the same values with the same effects in the same order, with the calls that only autograd
needed removed, and generated code that calls operators directly (``passes.direct_calls``).  Rules, keyed
by op (``RULES``):

========================  =====================================================================
``aten.detach(x)``         ``x``: without autograd recording, detach is the identity on values (kept
                           where something could tell: returned, it must not alias an input; passed to
                           an effect, a region or a custom op, which may show ``requires_grad``)
``aten.t(aten.t(x))``      ``x``: the double transposes a joint trace leaves in backward formulas
========================  =====================================================================
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..effects import node_effect_keys
from ..graphs import graph_module
from ..runtime.program import Program
from .dce import eliminate_dead_code
from .direct_calls import DirectOpCodeGen
from .rewrite import GraphContext, GraphRewrite, get_attr, set_attr

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


def _drop_detach(ctx: GraphContext, node: fx.Node) -> Any:
    # the value of a graph input may require grad (the compiled function's own inputs and parameters):
    # returned without its detach it would hand the caller its own input back, and an effect, a region
    # or a custom op would see requires_grad=True (print shows it) where eager passes a detached alias
    if _observed(node):
        return ctx.copy(node)
    return ctx.value(node.args[0], node)


def _fold_double_transpose(ctx: GraphContext, node: fx.Node) -> Any:
    inner = ctx.value(node.args[0], node)
    if isinstance(inner, fx.Node) and inner.op == "call_function" and inner.target is aten.t.default:
        return inner.args[0]
    return ctx.copy(node)


RULES = {aten.detach.default: _drop_detach, aten.t.default: _fold_double_transpose}


class Simplify(GraphRewrite):
    form_in = ("token-free",)
    form_out = "token-free"

    def __init__(self, form: str) -> None:
        super().__init__(form)
        self.rules = dict(RULES)

    def rebuild(self, gm: fx.GraphModule, keys: tuple[str, ...]) -> fx.GraphModule:
        if any(n.op == "call_function" and n.target in self.rules for n in gm.graph.nodes):
            return super().rebuild(gm, keys)
        # nothing to simplify (a root that only calls regions, say): a new module around the same graph,
        # holding the new bodies under the same names -- no node is copied, and graphs are never changed
        # once built, so sharing one is safe
        holder = torch.nn.Module()
        for node in gm.graph.find_nodes(op="get_attr"):
            sub = get_attr(gm, node.target)
            set_attr(holder, node.target, self.body(sub) if isinstance(sub, fx.GraphModule) else sub)
        new = graph_module(holder, gm.graph, gm.__class__.__name__)
        new.meta.update(gm.meta)
        new.runtime_calls = "direct"
        return new

    def done(self, gm: fx.GraphModule) -> None:
        eliminate_dead_code(gm.graph)  # the transposes a fold left without users
        gm.graph.set_codegen(DirectOpCodeGen())  # same rebuild, so direct calls cost nothing extra
        gm.recompile()


def simplify_for_runtime(prog: Program) -> Program:
    """Token-free -> token-free without autograd-only calls (see the module docstring)."""
    return Simplify(prog.form).program(prog)


def _simplify_graph(gm: fx.GraphModule, seen: set[int]) -> None:
    """The rules of ``RULES``, applied to ``gm`` and every subgraph it holds, in place."""
    if id(gm) in seen:
        return
    seen.add(id(gm))
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "get_attr":
            sub = get_attr(gm, node.target)
            if isinstance(sub, fx.GraphModule):
                _simplify_graph(sub, seen)
        elif node.op == "call_function" and node.target is aten.detach.default:
            if not _observed(node):  # the rule of _drop_detach
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
        elif node.op == "call_function" and node.target is aten.t.default:
            inner = node.args[0]  # already simplified: nodes are visited in order, as a rebuild does
            if isinstance(inner, fx.Node) and inner.op == "call_function" and inner.target is aten.t.default:
                node.replace_all_uses_with(inner.args[0])
                graph.erase_node(node)
    eliminate_dead_code(graph)
    graph.set_codegen(DirectOpCodeGen())
    gm.recompile()


def simplify_in_place(prog: Program) -> Program:
    """``simplify_for_runtime`` for a program nobody else holds -- efx.compile's own capture, which it runs
    once and drops: the same rules, applied to its graphs in place instead of to copies (a capture's root
    graph has a few nodes per region call site, and copying them is most of what the pass costs).
    Contract: requires the token-free form; gives the program it was given, its graphs simplified."""
    if prog.form != "token-free":
        return simplify_for_runtime(prog)  # refuses the form, as the copying pass does
    _simplify_graph(prog.graph_module, set())
    return prog.replace(form="token-free", token_keys=())
