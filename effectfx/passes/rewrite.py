"""Rebuilding a program's graphs without touching the input: the shared machinery of the token passes.

A :class:`GraphRewrite` walks the root graph and, through ``invoke_subgraph`` calls, every region body; it
rebuilds each body exactly once (memoized by identity), so a subgraph shared by many call sites is still one
subgraph object in the new program.  Subclasses give the per-node rules as a table keyed by call target.
The input graph modules are only read, never modified (see ``thread_tokens.py`` for the pattern).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from ..errors import EffectfxError
from ..graph.build import Graph, graph_module
from ..graph.walk import get_attr, set_attr
from ..program.program import Program
from ..program.records import Form


class EffectCodeGen(fx.graph.CodeGen):
    """FX code generation that can print ``effectfx.ops.invoke_subgraph`` as an *argument* (the unlifted
    ``with_effects(token, invoke_subgraph, ...)``); stock FX prints a plain function argument as its repr,
    which is not Python."""

    runtime_calls = "overload"  # the code graphs run calls each OpOverload (effectfx.graph.codegen)

    # the higher-order ops of effectfx.ops.HOPS, as FX prints a function argument
    _FUNCTION_REPR = re.compile(rf"<function ({'|'.join(f.__name__ for f in ops.HOPS)}) at 0x[0-9a-fA-F]+>")

    def _gen_python_code(self, *args: Any, **kwargs: Any) -> Any:
        code = super()._gen_python_code(*args, **kwargs)
        for name in set(self._FUNCTION_REPR.findall(code.src)):
            code.globals[f"effectfx_ops_{name}"] = ops.TARGETS[f"effectfx.ops.{name}"]
        code.src = self._FUNCTION_REPR.sub(lambda m: f"effectfx_ops_{m.group(1)}", code.src)
        return code


def new_graph() -> fx.Graph:
    graph = Graph()
    graph.set_codegen(EffectCodeGen())
    return graph


class _Token:
    """The value of a token (or a tuple of tokens) in a graph whose tokens are being removed."""

    def __repr__(self) -> str:
        return "TOKEN"


TOKEN: Any = _Token()


@dataclass
class Results:
    """How the ``getitem`` users of an old tuple-valued node map into the new graph.

    ``getitem(old, i)`` is a token for ``i < n_tokens``; past the tokens it is ``getitem(new, i - shift)``
    (a negative ``shift`` when the new node puts tokens in front, as ``thread_tokens`` does),
    or ``new`` itself when ``single`` (an op returning one value that the old node wrapped in a tuple).
    ``token_of`` maps a token index to the new token value (unlifted calls keep their tokens).
    """

    new: fx.Node
    n_tokens: int
    shift: int
    single: bool = False
    token_of: Callable[[int], Any] | None = None


@dataclass
class GraphContext:
    """The graph being built from ``old``: its new graph, attribute holder and old-node -> value map."""

    old: fx.GraphModule
    keys: tuple[str, ...]  # the token keys at the old graph's boundary
    graph: fx.Graph = field(default_factory=new_graph)
    holder: torch.nn.Module = field(default_factory=torch.nn.Module)
    env: dict[fx.Node, Any] = field(default_factory=dict)

    def value(self, node: fx.Node, user: fx.Node) -> Any:
        v = self.env[node]
        if v is TOKEN or isinstance(v, Results):
            raise EffectfxError(
                f"{node.name} (a token or a with_effects/invoke_subgraph tuple) is used as data by "
                f"{user.format_node()}.\nOnly with_effects, invoke_subgraph, getitem, sink_tokens and the "
                "output may read tokens; run efx.verify(prog) to find where the graph went wrong."
            )
        return v

    def args(self, a: Any, user: fx.Node) -> Any:
        return fx.map_arg(a, lambda n: self.value(n, user))

    def copy(self, node: fx.Node) -> fx.Node:
        new = self.graph.node_copy(node, lambda n: self.value(n, node))  # copies meta too
        return new


def boundary_keys(gm: fx.GraphModule, form: Form) -> tuple[str, ...]:
    """The token keys a graph takes and returns (functionalized form only; Note [Effect tokens])."""
    if form is not Form.FUNCTIONALIZED:
        return ()
    return tuple(gm.meta.get("effectfx_token_keys", ()))


class GraphRewrite:
    """Rebuild a Program's graphs, each body once.  Subclasses fill ``rules`` (target -> method) and may
    override ``begin`` (after placeholders) and ``finish`` (the output)."""

    form_in: tuple[Form, ...] = ()
    form_out: Form

    def __init__(self, form: Form) -> None:
        self.form = form
        self.bodies: dict[int, fx.GraphModule] = {}
        self.rules: dict[Any, Callable[[GraphContext, fx.Node], Any]] = {}

    # -- driving ---------------------------------------------------------------------------------
    def program(self, prog: Program) -> Program:
        if prog.form not in self.form_in:
            raise EffectfxError(
                f"{type(self).__name__} needs a program in the {' or '.join(self.form_in)} form, but "
                f"{prog.name!r} is {prog.form}. Run the passes that lead there first (capture gives the "
                "functionalized form)."
            )
        keys = tuple(prog.token_keys) if self.form is Form.FUNCTIONALIZED else ()
        root = self.rebuild(prog.graph_module, keys)
        return prog.replace(graph_module=root, form=self.form_out, token_keys=())

    def body(self, gm: fx.GraphModule) -> fx.GraphModule:
        if id(gm) not in self.bodies:
            self.bodies[id(gm)] = self.rebuild(gm, boundary_keys(gm, self.form))
        return self.bodies[id(gm)]

    def rebuild(self, gm: fx.GraphModule, keys: tuple[str, ...]) -> fx.GraphModule:
        ctx = GraphContext(gm, keys)
        nodes = list(gm.graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        for i, node in enumerate(placeholders):
            ctx.env[node] = self.placeholder(ctx, node, i)
        self.begin(ctx)
        for node in nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                self.finish(ctx, node)
            elif node.op == "get_attr":
                sub = get_attr(gm, node.target)
                set_attr(ctx.holder, node.target, self.body(sub) if isinstance(sub, fx.GraphModule) else sub)
                ctx.env[node] = ctx.copy(node)
            else:
                rule = self.rules.get(node.target) if node.op == "call_function" else None
                ctx.env[node] = rule(ctx, node) if rule is not None else self.default(ctx, node)
        new = graph_module(ctx.holder, ctx.graph, gm.__class__.__name__)
        new.meta.update({k: v for k, v in gm.meta.items() if k != "effectfx_effect_keys"})
        new.meta["effectfx_token_keys"] = self.token_keys_out(ctx)
        self.done(new)
        return new

    # -- hooks -----------------------------------------------------------------------------------
    def token_keys_out(self, ctx: GraphContext) -> tuple[str, ...]:
        return ()

    def done(self, gm: fx.GraphModule) -> None:
        """Called on each new graph module once it is built."""

    def placeholder(self, ctx: GraphContext, node: fx.Node, index: int) -> Any:
        return ctx.copy(node)

    def begin(self, ctx: GraphContext) -> None:
        pass

    def default(self, ctx: GraphContext, node: fx.Node) -> Any:
        return ctx.copy(node)

    def finish(self, ctx: GraphContext, node: fx.Node) -> None:
        ctx.copy(node)

    # -- shared rules ----------------------------------------------------------------------------
    def getitem(self, ctx: GraphContext, node: fx.Node) -> Any:
        src, index = node.args
        value = ctx.env[src] if isinstance(src, fx.Node) else None
        if value is TOKEN:  # an element of a tuple of tokens
            return TOKEN
        if not isinstance(value, Results):
            return ctx.copy(node)
        if index < value.n_tokens:
            return value.token_of(index) if value.token_of is not None else TOKEN
        if value.single:
            return value.new
        new = ctx.graph.call_function(operator.getitem, (value.new, index - value.shift))
        new.meta.update(node.meta)
        return new


def returns_single_value(op: Any, node: fx.Node) -> bool:
    """Whether ``op`` returns one value (not a tuple or list), so ``with_effects`` wrapped it in a 1-tuple."""
    schema = getattr(op, "_schema", None)
    if schema is not None:
        returns = schema.returns
        return len(returns) == 1 and not str(returns[0].type).endswith("[]") and \
            not str(returns[0].type).startswith("List[")
    return not isinstance(node.meta.get("val"), (tuple, list))


def wrapped_results(ctx: GraphContext, call: fx.Node, n: int) -> Results:
    """How users of a node now wrapped as ``with_effects(token(s), ...)`` find its results: element 0 is
    the token (or the tuple of ``n`` tokens), getitems made on first use, the other results shifted."""
    made: dict[int, fx.Node] = {}

    def token_of(index: int) -> fx.Node:
        if -1 not in made:
            made[-1] = ctx.graph.call_function(operator.getitem, (call, 0))
        if n == 1:
            return made[-1]
        if index not in made:
            made[index] = ctx.graph.call_function(operator.getitem, (made[-1], index))
        return made[index]

    return Results(call, n_tokens=n, shift=n - 1, token_of=token_of)
