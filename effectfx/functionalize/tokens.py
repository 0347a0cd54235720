"""thread_tokens: captured form -> functionalized form (see Note [Effect tokens], Note [Region identity]).

Contract: requires the captured form; gives a new Program in which every effectful op is a
``with_effects`` node, every graph with effects takes and returns one token per key (sorted), and every
region call threads the caller's current tokens.  The input Program is not modified.

Effect discovery follows the seed: a body is functionalized with no tokens of its own; a token appears
the first time the body needs one, and the keys whose token differs after the body from before it are
the region's effects, recorded in the region cache under its identifier.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from ..capture.source import definition
from ..effects import effect_of, graph_effect_keys
from ..errors import RegionEffectsChangedError
from ..graphs import Graph, graph_module
from ..runtime.printing import subgraphs
from ..runtime.program import Program, RegionEntry


def check_region_effects(gm: fx.GraphModule, keys: frozenset[str], commits: list) -> None:
    """Compare a body's effect keys with what the same region and cache key showed before
    (Note [Region identity]); the new set is committed only once the whole pass succeeds."""
    info = gm.meta.get("effectfx_region")
    if info is None:
        return
    region, cache_key, identifier, direction = info
    known = region.known_effects.get((cache_key, direction))
    if known is not None and known != keys:
        changed = known ^ keys
        where = sorted({n.meta["location"] for n in gm.graph.nodes
                        if n.meta.get("effect_key") in changed and "location" in n.meta})
        raise RegionEffectsChangedError(
            f"region {region.name!r} ({identifier}, {direction}; defined at {definition(region.fn)}) had "
            f"effects {sorted(known)} when it was traced before with the same arguments, but has "
            f"{sorted(keys)} now" + (f" (from {'; '.join(where)})" if where else "") + ".\nIts effects "
            "depend on state that is not part of its cache key (a global flag?). Pass that state to the "
            "region as an argument so each variant gets its own body."
        )
    commits.append((region, (cache_key, direction), keys))


def _commit(commits: list) -> None:
    for region, cache_key, effect_keys in commits:  # only a pass that succeeded fills the cache
        region.known_effects[cache_key] = effect_keys


@dataclass
class _Functionalizer:
    done: dict[int, tuple[fx.GraphModule, tuple[str, ...]]] = field(default_factory=dict)
    effects: dict[str, frozenset[str]] = field(default_factory=dict)  # identifier -> keys
    commits: list[tuple[Any, Any, frozenset[str]]] = field(default_factory=list)

    def body(self, gm: fx.GraphModule, identifier: str) -> tuple[fx.GraphModule, tuple[str, ...]]:
        if id(gm) not in self.done:
            new, keys = self.graph(gm)
            self.effects[identifier] = frozenset(keys)
            check_region_effects(gm, frozenset(keys), self.commits)
            self.done[id(gm)] = (new, keys)
        return self.done[id(gm)]

    def graph(self, gm: fx.GraphModule) -> tuple[fx.GraphModule, tuple[str, ...]]:
        graph = Graph()
        holder = torch.nn.Module()
        env: dict[fx.Node, Any] = {}
        shift: dict[fx.Node, int] = {}  # node -> how many tokens precede its results
        start: dict[str, fx.Node] = {}  # key -> token placeholder (tokens "before")
        current: dict[str, fx.Node] = {}  # key -> latest token (tokens "after")

        def token(key: str) -> fx.Node:
            if key not in current:
                ph = graph.placeholder("token_" + re.sub(r"\W", "_", key))
                ph.meta["val"] = ops.make_token()
                start[key] = current[key] = ph
            return current[key]

        def arg(a: Any) -> Any:
            return fx.map_arg(a, lambda n: env[n])

        def results(call: fx.Node, keys: tuple[str, ...]) -> None:
            for j, key in enumerate(keys):
                current[key] = graph.call_function(operator.getitem, (call, j))

        for node in gm.graph.nodes:
            if node.op == "output":
                output_node = node
                continue
            if node.op == "get_attr":
                sub = getattr(gm, node.target)
                setattr(holder, node.target, sub)
                env[node] = graph.node_copy(node)
                continue
            target = node.target
            if node.op == "call_function" and target is ops.invoke_subgraph:
                attr, identifier, *operands = node.args
                new_body, keys = self.body(getattr(gm, attr.target), identifier)
                setattr(holder, attr.target, new_body)
                call = graph.call_function(
                    ops.invoke_subgraph, (env[attr], identifier, *[token(k) for k in keys], *arg(operands))
                )
                results(call, keys)
                shift[node] = len(keys)
                env[node] = call
            elif node.op == "call_function" and (key := effect_of(target)) is not None:
                call = graph.call_function(ops.with_effects, (token(key), target, *arg(node.args)),
                                           arg(node.kwargs))
                call.meta.update(node.meta)
                results(call, (key,))
                if isinstance(node.meta.get("val"), torch.Tensor):
                    env[node] = graph.call_function(operator.getitem, (call, 1))
                else:
                    shift[node] = 1
                    env[node] = call
            elif node.op == "call_function" and target is operator.getitem and node.args[0] in shift:
                src, index = node.args
                env[node] = graph.call_function(operator.getitem, (env[src], index + shift[src]))
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
            env[node].meta.update(node.meta)

        # the region's effects: keys whose token after the body differs from the one before it
        keys = tuple(sorted(k for k in current if current[k] is not start[k]))
        graph.output((*[current[k] for k in keys], *arg(output_node.args[0])))
        anchor = next(n for n in graph.nodes if n.op != "placeholder" or n not in start.values())
        for key in keys:  # token placeholders first, in sorted key order
            anchor.prepend(start[key])
        if len(keys) == 1:
            start[keys[0]]._rename("token")
            start[keys[0]].target = "token"
        new = graph_module(holder, graph, gm.__class__.__name__)
        new.meta.update({k: v for k, v in gm.meta.items() if k != "effectfx_effect_keys"})
        new.meta["effectfx_token_keys"] = keys
        return new, keys


def thread_tokens(prog: Program) -> Program:
    """Captured form -> functionalized form (see the module docstring for the contract)."""
    f = _Functionalizer()
    root, keys = f.graph(prog.graph_module)
    _commit(f.commits)
    regions = {
        ident: RegionEntry(entry.name, entry.traces, f.effects.get(ident, frozenset()))
        for ident, entry in prog.regions.items()
    }
    return prog.replace(graph_module=root, token_keys=keys, form="functionalized", regions=regions)


def discover_effects(prog: Program) -> Program:
    """Captured form -> token-free form, without rebuilding a graph.

    Contract: requires the captured form; gives the same graphs labelled token-free, with every region's
    effect keys recorded and checked exactly as :func:`thread_tokens` does.  The captured form already is
    token-free (effectful ops are bare and ordered by node order, DESIGN §2.4), so threading tokens and
    removing them again would rebuild every graph only to arrive where it started; efx.compile's default
    backend takes this shortcut, the tests check both routes agree.
    """
    commits: list = []
    effects: dict[str, frozenset[str]] = {}
    for _, identifier, body in subgraphs(prog.graph_module):
        keys = graph_effect_keys(body)
        effects[identifier] = effects.get(identifier, frozenset()) | keys
        check_region_effects(body, keys, commits)
    _commit(commits)
    regions = {ident: RegionEntry(e.name, e.traces, effects.get(ident, frozenset()))
               for ident, e in prog.regions.items()}
    return prog.replace(form="token-free", regions=regions)
