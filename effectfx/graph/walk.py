"""Walks over effectfx's graphs: the subgraphs a node runs, every graph nested in another, and the one
answer to "is this node effectful" that dead-code elimination, the partitioner, the verifier and the
passes ask (Note [Effect tokens]).

A node runs subgraphs when its target is a higher-order op of ``effectfx.ops.HOPS`` -- called directly, or
wrapped by the unlifted form's ``with_effects(token, op, ...)``; its subgraphs are its ``get_attr``
arguments.  Which ops are effectful is the effect registry's to say (``effectfx.effects``); a node is
effectful when its op is, or when a subgraph it runs performs an effect.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from ..effects import effect_of

# FX's own dead-code elimination (``Graph.eliminate_dead_code``, used by torch's passes) keeps these too
torch.fx.node._side_effectful_functions.update({ops.with_effects, ops.sink_tokens})

_NONE: frozenset[str] = frozenset()
_ALWAYS_LIVE = {ops.sink_tokens, ops.with_effects}
_RANDOM = torch.Tag.nondeterministic_seeded


def get_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def set_attr(holder: torch.nn.Module, target: str, value: Any) -> None:
    *path, last = target.split(".")
    for part in path:
        if not hasattr(holder, part):
            setattr(holder, part, torch.nn.Module())
        holder = getattr(holder, part)
    setattr(holder, last, value)


def hop_call(node: fx.Node) -> tuple[Any, tuple]:
    """``(higher-order op, its arguments)`` of a node that calls one (directly or wrapped in
    ``with_effects``), else ``(None, ())``."""
    if node.op != "call_function":
        return None, ()
    target, args = node.target, node.args
    if target is ops.with_effects and len(args) > 1:
        target, args = args[1], args[2:]
    return (target, args) if target in ops.HOPS else (None, ())


def region_call(node: fx.Node) -> tuple[int, tuple] | None:
    """(index of the subgraph get_attr in args, args from there) if ``node`` calls a region, else None."""
    if node.op != "call_function":
        return None
    if node.target is ops.invoke_subgraph:
        return 0, node.args
    if node.target is ops.with_effects and len(node.args) > 1 and node.args[1] is ops.invoke_subgraph:
        return 2, node.args[2:]
    return None


def control_flow_graphs(node: fx.Node) -> list[fx.Node]:
    """The get_attr nodes of the subgraphs a control-flow node runs (Note [Control flow]), else []."""
    target, args = hop_call(node)
    if target is None or target is ops.invoke_subgraph:
        return []
    return [a for a in args if isinstance(a, fx.Node) and a.op == "get_attr"]


def nested_graphs(gm: fx.GraphModule, regions_only: bool = True) -> Iterator[tuple[str, str, fx.GraphModule]]:
    """Every subgraph reachable from ``gm``, once each, depth first: (attr, identifier, module).  Region
    bodies, and with ``regions_only=False`` also the subgraphs of control flow (identifier: their attr)."""
    seen: set[int] = set()

    def visit(owner: fx.GraphModule) -> Iterator[tuple[str, str, fx.GraphModule]]:
        for node in owner.graph.nodes:
            target, args = hop_call(node)
            if target is None:
                continue
            if target is not ops.invoke_subgraph:
                for attr in control_flow_graphs(node):
                    body = getattr(owner, attr.target)
                    if id(body) not in seen:
                        seen.add(id(body))
                        if not regions_only:
                            yield attr.target, attr.target, body
                        yield from visit(body)
                continue
            body = getattr(owner, args[0].target)
            if id(body) in seen:
                continue
            seen.add(id(body))
            yield args[0].target, args[1], body
            yield from visit(body)

    yield from visit(gm)


def subgraphs(gm: fx.GraphModule) -> Iterator[tuple[str, str, fx.GraphModule]]:
    """Every region subgraph reachable from ``gm`` (inside control flow too), once each, depth first:
    (attr, identifier, module)."""
    return nested_graphs(gm)


# -- effects of nodes ------------------------------------------------------------------------------------
def node_effect_keys(node: Any) -> frozenset[str]:
    """The effect keys a node performs: its op's key, or every key inside the subgraphs it runs."""
    if node.op != "call_function":
        return _NONE
    target = node.target
    if target is operator.getitem:  # most nodes of a graph of region calls: answered at once
        return _NONE
    hop, args = hop_call(node)
    if hop is ops.invoke_subgraph:
        return graph_effect_keys(getattr(node.graph.owning_module, args[0].target))
    if hop is not None:
        keys: frozenset[str] = _NONE
        for a in args:
            if getattr(a, "op", None) == "get_attr":
                keys |= graph_effect_keys(getattr(node.graph.owning_module, a.target))
        return keys
    if target is ops.with_effects:
        target = node.args[1]
    key = effect_of(target)
    return frozenset([key]) if key else _NONE


def graph_effect_keys(gm: Any) -> frozenset[str]:
    """Every effect key performed by a graph module, its regions included (memoized on the module)."""
    cached = gm.meta.get("effectfx_effect_keys")
    if cached is None:
        keys: set[str] = set()
        for node in gm.graph.nodes:
            keys |= node_effect_keys(node)
        cached = gm.meta["effectfx_effect_keys"] = frozenset(keys)
    return cached


def is_effectful(node: fx.Node) -> bool:
    """Whether ``node`` must stay whatever uses it: a graph boundary, a token op, or a node performing an
    effect."""
    if node.op in ("placeholder", "output"):
        return True
    return node.target in _ALWAYS_LIVE or bool(node_effect_keys(node))


def draws_random(node: fx.Node) -> bool:
    """Whether ``node`` draws from the global random generator (or saves or restores its state): it stays
    even when nothing reads its result, so the generator ends each graph where eager's does -- it is not
    an effect (Note [Random numbers], ``effectfx.interposers.rng``).  A region or control-flow call draws when
    a subgraph it runs does."""
    if isinstance(node.target, torch._ops.OpOverload):
        return _RANDOM in node.target.tags
    hop, args = hop_call(node)
    return hop is not None and any(_graph_draws(get_attr(node.graph.owning_module, a.target))
                                   for a in args if getattr(a, "op", None) == "get_attr")


def _graph_draws(gm: Any) -> bool:
    cached = gm.meta.get("effectfx_draws_random")
    if cached is None:
        cached = gm.meta["effectfx_draws_random"] = any(draws_random(n) for n in gm.graph.nodes)
    return cached


def effectful_nodes(nodes: list[fx.Node]) -> list[fx.Node]:
    """The nodes of ``nodes`` that must survive whatever uses them (:func:`is_effectful`,
    :func:`draws_random`); a region's effects are asked once per subgraph."""
    by_attr: dict[fx.Node, bool] = {}
    found = []
    for node in nodes:
        if node.target is operator.getitem:
            continue
        if node.target is ops.invoke_subgraph:
            attr = node.args[0]
            keep = by_attr.get(attr)
            if keep is None:
                keep = by_attr[attr] = is_effectful(node) or draws_random(node)
        else:
            keep = is_effectful(node) or draws_random(node)
        if keep:
            found.append(node)
    return found


def eliminate_dead_code(graph: fx.Graph) -> fx.Graph:
    """Remove, in place, every pure node whose value is unused; returns the graph."""
    for node in reversed(list(graph.nodes)):
        if not node.users and not is_effectful(node) and not draws_random(node):
            graph.erase_node(node)
    return graph
