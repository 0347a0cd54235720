"""verify: check the invariants of Note [Effect tokens] on every graph of a program.

Contract: reads any form, changes nothing; raises :class:`~effectfx.errors.VerificationError` naming the
graph, the node (with the graph text around it), the pass that ran last (``after=``) and what to do.

Checked, per graph (root and every region body, each body once):
  * per effect key one linear chain, in program order, from the token placeholder (functionalized) or
    ``make_token()`` (unlifted) to the token output (functionalized) or ``sink_tokens([...])`` (unlifted);
    every token value is consumed at most once, and tokens are never used as data;
  * the keys at a graph's boundary are exactly the keys its nodes perform, asked of the registry;
  * forms functionalized/unlifted: every effectful op is inside ``with_effects`` (unlifted: effectful
    region calls too); token-free/captured: no ``with_effects``, ``make_token`` or ``sink_tokens`` at all;
  * at every region call site: the operand count and tensor metadata match the body's placeholders, the
    ``getitem`` indices stay inside its results, and one identifier names one body.
In debug mode (``EFFECTFX_DEBUG=1``) the pipeline runs this after every pass.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from ..effects import effect_of
from ..errors import VerificationError
from ..graph.walk import control_flow_graphs, get_attr, region_call
from ..program.program import Program
from ..program.records import Form
from ..program.training import TrainingProgram
from . import control_flow
from .rewrite import boundary_keys

_TOKEN_OPS = (ops.with_effects, ops.make_token, ops.sink_tokens)
CONTEXT_LINES = 3


def graph_context(gm: fx.GraphModule, node: fx.Node | None, radius: int = CONTEXT_LINES) -> str:
    """The nodes of ``gm`` around ``node``, one per line, the offending one marked ``>>``."""
    nodes = list(gm.graph.nodes)
    at = nodes.index(node) if node is not None and node in nodes else len(nodes) - 1
    lines = []
    for i in range(max(0, at - radius), min(len(nodes), at + radius + 1)):
        text = nodes[i].format_node() or f"{nodes[i].op} {nodes[i].name}"
        lines.append(("  >> " if i == at else "     ") + text)
    return "\n".join(lines)


@dataclass
class _GraphCheck:
    """The token chains of one graph, walked in node order."""

    verifier: _Verifier
    gm: fx.GraphModule
    where: str
    keys: tuple[str, ...]
    key_of: dict[fx.Node, str] = field(default_factory=dict)  # token value -> key
    current: dict[str, fx.Node | None] = field(default_factory=dict)  # key -> latest token
    consumed_by: dict[fx.Node, fx.Node] = field(default_factory=dict)  # token -> its consumer
    pending: dict[fx.Node, dict[int, tuple[Any, fx.Node]]] = field(default_factory=dict)  # {i: (key, call)}
    produced_by: dict[str, fx.Node] = field(default_factory=dict)  # key -> call whose token is pending

    def fail(self, node: fx.Node | None, problem: str, fix: str) -> None:
        self.verifier.fail(self.gm, self.where, node, problem, fix)

    # -- the chain -------------------------------------------------------------------------------
    def start(self, node: fx.Node, key: str) -> None:
        self.key_of[node] = key
        self.current[key] = node

    def consume(self, token: Any, key: str, user: fx.Node) -> None:
        if not isinstance(token, fx.Node) or token not in self.key_of:
            self.fail(user, f"{token} is not a token, but is passed where the token of key {key!r} goes.",
                      "pass the latest token of that key (the chain must be unbroken)")
        if self.key_of[token] != key:
            self.fail(user, f"the token {token.name} of key {self.key_of[token]!r} is passed as the token "
                            f"of key {key!r}.", "keep one chain per key; token positions follow sorted keys")
        if token in self.consumed_by:
            self.fail(user, f"token {token.name} (key {key!r}) is consumed twice: first by "
                            f"{self.consumed_by[token].name}, again here.",
                      "each effect must take the token its predecessor returned, so the chain stays linear")
        if self.current.get(key) is not token:
            self.fail(user, f"token {token.name} (key {key!r}) is not the latest token of its chain.",
                      "an effect must follow the previous effect of its key")
        self.consumed_by[token] = user
        self.current[key] = None
        self.produced_by[key] = user

    def expect(self, src: fx.Node, index: int, key: Any, call: fx.Node | None = None) -> None:
        """``getitem(src, index)`` will be the new token of ``key`` (a tuple of keys: a tuple of tokens)."""
        self.pending.setdefault(src, {})[index] = (key, call if call is not None else src)

    def getitem(self, node: fx.Node) -> bool:
        src, index = node.args
        keys = self.pending.get(src) if isinstance(src, fx.Node) else None
        if not keys or index not in keys:
            return False
        key, call = keys.pop(index)
        if isinstance(key, tuple):  # element 0 of a multi-key region call: a tuple of tokens
            for j, k in enumerate(key):
                self.expect(node, j, k, call)
            return True
        if self.produced_by.get(key) is not call:
            self.fail(node, f"{call.name} returns a token of key {key!r}, but a later effect of that key has "
                            "already run.", "keep one chain per key, in program order")
        self.produced_by.pop(key)
        self.start(node, key)
        return True

    def finish(self, final: Any, node: fx.Node, what: str) -> None:
        final = list(final)
        if len(final) != len(self.keys):
            self.fail(node, f"{what} has {len(final)} tokens but the graph has keys {list(self.keys)}.",
                      "return (sink) exactly one token per key, in sorted key order")
        for key, token in zip(self.keys, final):
            if self.current.get(key) is None:
                last = self.produced_by[key].name if key in self.produced_by else "?"
                self.fail(node, f"the chain of key {key!r} is broken: the token result of {last} is dropped.",
                          "extract getitem(call, 0) and pass it on")
            self.consume(token, key, node)


class _Verifier:
    def __init__(self, prog: Program, after: str | None) -> None:
        self.prog = prog
        self.form = prog.form
        self.after = after
        self.done: set[int] = set()
        self.keys_memo: dict[int, frozenset[str]] = {}
        self.bodies: dict[tuple, int] = {}  # (identifier, direction) -> id(body)

    def fail(self, gm: fx.GraphModule, where: str, node: fx.Node | None, problem: str, fix: str) -> None:
        after = f" after pass {self.after!r}" if self.after else ""
        raise VerificationError(
            f"{self.prog.name}, {self.form} form{after}: in {where}: {problem}\n"
            f"{graph_context(gm, node)}\nFix: {fix}."
            + ("\n(The pass named above produced this graph; its input verified or was not checked.)"
               if self.after else "")
        )

    # -- the registry's view ---------------------------------------------------------------------
    def keys_of(self, gm: fx.GraphModule) -> frozenset[str]:
        """Every key ``gm`` performs, regions included (recomputed: graphs may have been edited)."""
        if id(gm) not in self.keys_memo:
            self.keys_memo[id(gm)] = frozenset()  # recursion guard
            keys: set[str] = set()
            for node in gm.graph.nodes:
                keys |= self.node_keys(gm, node)
            self.keys_memo[id(gm)] = frozenset(keys)
        return self.keys_memo[id(gm)]

    def node_keys(self, gm: fx.GraphModule, node: fx.Node) -> frozenset[str]:
        if node.op != "call_function":
            return frozenset()
        attrs = control_flow_graphs(node)
        if attrs:  # Note [Control flow]: every key any of its subgraphs performs
            return frozenset().union(*(self.keys_of(get_attr(gm, a.target)) for a in attrs))
        found = region_call(node)
        if found is not None:
            attr = found[1][0]
            return self.keys_of(get_attr(gm, attr.target)) if isinstance(attr, fx.Node) else frozenset()
        op = node.args[1] if node.target is ops.with_effects and len(node.args) > 1 else node.target
        key = effect_of(op)
        return frozenset([key]) if key else frozenset()

    # -- graphs ----------------------------------------------------------------------------------
    def program(self) -> None:
        root = self.prog.graph_module
        keys = tuple(self.prog.token_keys)
        if self.form is not Form.FUNCTIONALIZED and keys:
            self.fail(root, "the root", None, f"a {self.form} program lists token keys {list(keys)}.",
                      "only the functionalized form has tokens at the root's boundary")
        self.graph(root, "the root graph", keys)

    def graph(self, gm: fx.GraphModule, where: str, keys: tuple[str, ...], subgraph: bool = False) -> None:
        self.done.add(id(gm))
        wanted = tuple(sorted(self.keys_of(gm)))
        # control flow: tokens of keys the subgraph does not perform pass through (Note [Control flow])
        if subgraph and self.form in (Form.FUNCTIONALIZED, Form.UNLIFTED):
            if not set(wanted) <= set(gm.meta.get(control_flow.META, ())):
                _GraphCheck(self, gm, where, wanted).fail(
                    None, f"the subgraph performs {list(wanted)} but its boundary lists "
                          f"{list(gm.meta.get(control_flow.META, ()))}.", "run thread_tokens again")
            wanted = tuple(gm.meta.get(control_flow.META, ()))
        check = _GraphCheck(self, gm, where, wanted)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if self.form is Form.FUNCTIONALIZED:
            if keys != wanted:
                check.fail(placeholders[0] if placeholders else None,
                           f"the graph takes tokens for keys {list(keys)} but performs effects of keys "
                           f"{list(wanted)} (asked of the effect registry).",
                           "thread one token per key the graph uses, sorted (run thread_tokens again)")
            for key, ph in zip(keys, placeholders):
                check.start(ph, key)
        made = 0
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "get_attr"):
                continue
            if node.op == "output":
                self.output(check, node)
                continue
            self.uses(check, node)
            target = node.target
            if node.op != "call_function":
                continue
            if target in _TOKEN_OPS and self.form in (Form.TOKEN_FREE, Form.CAPTURED):
                check.fail(node, f"{getattr(target, '__name__', target)} appears in the {self.form} form.",
                           "this form has no tokens: remove_effect_tokens must unwrap every effect")
            if target is ops.make_token:
                if self.form is not Form.UNLIFTED:
                    check.fail(node, "make_token() outside the unlifted form.",
                               "tokens are placeholders here")
                if made >= len(wanted):
                    check.fail(node, f"more make_token() calls than keys {list(wanted)}.",
                               "make one token per key the graph uses, in sorted key order")
                check.start(node, wanted[made])
                made += 1
            elif target is ops.sink_tokens:
                check.finish(node.args[0], node, "sink_tokens")
            elif control_flow.cf_target(node) is not None:
                self.control_flow(check, gm, node)
            elif target is ops.with_effects:
                self.with_effects(check, gm, node)
            elif target is ops.invoke_subgraph:
                self.invoke(check, gm, node, wrapped=False)
            elif target is operator.getitem:
                check.getitem(node)
            elif effect_of(target) is not None and self.form in (Form.FUNCTIONALIZED, Form.UNLIFTED):
                check.fail(node, f"the effectful op {target} (key {effect_of(target)!r}) is not wrapped in "
                                 "with_effects, so nothing orders it.",
                           "every effectful op must be with_effects(token, op, *args) in this form")
        if self.form is Form.UNLIFTED and made != len(wanted):
            check.fail(None, f"{made} make_token() calls for keys {list(wanted)}.",
                       "make one token per key the graph uses")
        sunk = any(n.target is ops.sink_tokens for n in gm.graph.nodes)
        if self.form is Form.UNLIFTED and wanted and not sunk:
            check.fail(None, "no sink_tokens([...]) keeps the final tokens alive.",
                       "end the graph with sink_tokens of the last token of every key")

    def uses(self, check: _GraphCheck, node: fx.Node) -> None:
        """Tokens may only be read where tokens go (checked by the rules); never as data."""
        allowed: list[Any] = []
        if node.target is ops.with_effects and node.args:
            allowed = list(node.args[0]) if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
        elif node.target is ops.invoke_subgraph and self.form is Form.FUNCTIONALIZED:
            body = get_attr(check.gm, node.args[0].target)
            allowed = list(node.args[2:2 + len(boundary_keys(body, self.form))])
        elif node.target in (ops.sink_tokens, operator.getitem):
            return
        else:
            allowed = control_flow.allowed_tokens(node, check.gm, self.form)
        for inp in node.all_input_nodes:
            if inp in check.key_of and inp not in allowed:
                check.fail(node, f"token {inp.name} is used as data.", "tokens only flow between effects")

    def output(self, check: _GraphCheck, node: fx.Node) -> None:
        outs = list(node.args[0]) if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
        n = len(check.keys) if self.form is Form.FUNCTIONALIZED else 0
        if n:
            check.finish(outs[:n], node, "the output")
        for out in outs[n:]:
            if isinstance(out, fx.Node) and out in check.key_of:
                check.fail(node, f"token {out.name} is returned as data.", "tokens only flow between effects")

    def control_flow(self, check: _GraphCheck, gm: fx.GraphModule, node: fx.Node) -> None:
        wrapped = node.target is ops.with_effects
        if wrapped and self.form is not Form.UNLIFTED:
            check.fail(node, "a wrapped control-flow call outside the unlifted form.",
                       "in the functionalized form control flow takes its tokens as operands")
        keys = control_flow.verify_node(self, check, gm, node, wrapped)
        if wrapped:
            token = node.args[0]
            tokens = list(token) if isinstance(token, (tuple, list)) else [token]
            if len(keys) != len(tokens):
                check.fail(node, f"the subgraphs have effect keys {list(keys)} but the call passes "
                                 f"{len(tokens)} token(s).", "pass the tokens of its keys (sorted)")
            for key, t in zip(keys, tokens):
                check.consume(t, key, node)
            check.expect(node, 0, keys[0] if len(keys) == 1 else tuple(keys))  # type: ignore[arg-type]

    def with_effects(self, check: _GraphCheck, gm: fx.GraphModule, node: fx.Node) -> None:
        if len(node.args) < 2:
            check.fail(node, "with_effects without an op.", "write with_effects(token, op, *args)")
        token, op = node.args[0], node.args[1]
        if op is ops.invoke_subgraph:
            if self.form is not Form.UNLIFTED:
                check.fail(node, "a wrapped region call outside the unlifted form.",
                           "in the functionalized form a region takes its tokens as operands")
            keys = self.invoke(check, gm, node, wrapped=True)
            tokens = list(token) if isinstance(token, (tuple, list)) else [token]
            if len(keys) != len(tokens) or (len(keys) == 1) != (not isinstance(token, (tuple, list))):
                check.fail(node, f"the region has effect keys {list(keys)} but the call passes "
                                 f"{len(tokens)} token(s) as {type(token).__name__}.",
                           "pass the token of its one key, or a tuple of the tokens of its keys (sorted)")
            for key, t in zip(keys, tokens):
                check.consume(t, key, node)
            check.expect(node, 0, keys[0] if len(keys) == 1 else tuple(keys))  # type: ignore[arg-type]
            return
        key = effect_of(op)
        if key is None:
            check.fail(node, f"with_effects wraps {op}, which the effect registry says is pure.",
                       "register the op with efx.register_effect, or call it directly")
        check.consume(token, key, node)
        check.expect(node, 0, key)

    def invoke(self, check: _GraphCheck, gm: fx.GraphModule, node: fx.Node, wrapped: bool) -> tuple:
        start = 2 if wrapped else 0
        attr, identifier, *operands = node.args[start:]
        if not isinstance(attr, fx.Node) or attr.op != "get_attr":
            check.fail(node, "a region call whose subgraph is not a get_attr.",
                       "reach subgraphs via get_attr")
        body = get_attr(gm, attr.target)
        if not isinstance(body, fx.GraphModule):
            check.fail(node, f"{attr.target} is not a graph module.", "call a traced region body")
        # a cond's backward branch calls a region's forward and backward body (Note [Control flow])
        direction = (body.meta.get("effectfx_region", (None,) * 4)[3]
                     if isinstance(body, fx.GraphModule) else None)
        # a body's backward has variants of its own, under its identifier: for some outputs only (Note
        # [Partial backward]), without a promoted operand's gradient (``_skip0``)
        variant = attr.target.rpartition("_backward")[2] if isinstance(attr, fx.Node) else ""
        if self.bodies.setdefault((identifier, direction, variant), id(body)) != id(body):
            check.fail(node, f"identifier {identifier!r} names two different subgraphs.",
                       "one identifier is one traced body (Note [Region identity])")
        keys = tuple(sorted(self.keys_of(body)))
        where = f"subgraph {attr.target} ({identifier!r})"
        if self.form is Form.UNLIFTED and keys and not wrapped:
            check.fail(node, f"region {identifier!r} has effects {list(keys)} but its call is not wrapped.",
                       "wrap it: with_effects(token, invoke_subgraph, subgraph, identifier, *operands)")
        n = len(boundary_keys(body, self.form))
        placeholders = [p for p in body.graph.nodes if p.op == "placeholder"]
        if len(placeholders) != len(operands):
            check.fail(node, f"the call passes {len(operands)} operands but {where} takes "
                             f"{len(placeholders)}.", "call sites and the body signature must agree")
        for i, (ph, operand) in enumerate(zip(placeholders, operands)):
            a, b = ph.meta.get("val"), operand.meta.get("val") if isinstance(operand, fx.Node) else None
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (
                    tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype):
                check.fail(node, f"operand {i} is {b.dtype}{list(b.shape)} but {where} expects "
                                 f"{a.dtype}{list(a.shape)}.", "call sites and the body signature must agree")
        body_out = next(n_ for n_ in reversed(body.graph.nodes) if n_.op == "output").args[0]
        n_results = len(body_out) + (1 - n if wrapped else 0)
        for user in node.users:
            if user.target is operator.getitem and not (0 <= user.args[1] < n_results):
                check.fail(user, f"getitem index {user.args[1]} but {where} gives {n_results} results.",
                           "shift getitem indices when tokens enter or leave a signature")
        if not wrapped:
            if self.form is Form.FUNCTIONALIZED:
                for j, (key, t) in enumerate(zip(keys, operands[:n])):
                    check.consume(t, key, node)
                    check.expect(node, j, key)
            if self.form is Form.FUNCTIONALIZED and tuple(boundary_keys(body, self.form)) != keys:
                check.fail(node, f"{where} takes tokens {list(boundary_keys(body, self.form))} but performs "
                                 f"effects {list(keys)}.", "thread one token per key the region uses")
        if id(body) not in self.done:
            self.graph(body, where, tuple(boundary_keys(body, self.form)))
        return keys


def verify(prog: Program | TrainingProgram, after: str | None = None) -> None:
    """Raise :class:`VerificationError` if ``prog`` breaks Note [Effect tokens] (see the module docstring)."""
    if isinstance(prog, TrainingProgram):
        verify(prog.forward, after)
        verify(prog.backward, after)
        return
    _Verifier(prog, after).program()
