"""A JSON description of a program's graphs, for pictures (``effectfx show --html``).

The description is plain data (strings, numbers, lists, dicts), so the HTML page and tests read the same
thing.  Shape::

    {"title": str, "form": str, "keys": [effect keys, sorted], "colors": {key: "#rrggbb"},
     "programs": [{"name", "form", "token_keys", "history": [[pass, seconds]], "root": graph id,
                   "code": readable text of every graph}],
     "graphs": {graph id: {"id", "attr", "identifier", "region", "direction", "effects", "effects_inside",
                           "signature", "nodes": [node], "chains": {key: {"nodes": [node names], "style"}}}}}

    node = {"name", "kind", "target", "args", "text", "key", "tokens", "subgraph", "identifier", "region"}

``kind`` is one of "input", "output", "op", "getitem", "effect" (an effectful op, wrapped in
``with_effects`` or not), "region" (a region call, wrapped or not), "token" (``make_token``,
``sink_tokens``, and token-valued ``getitem``s).  ``key`` is the effect key of an effect node or the key
of a token; ``tokens`` lists the keys of the tokens a node takes or gives.  A chain's ``style`` is
"token" when tokens thread it (functionalized and unlifted forms) and "order" when only node order keeps
it (captured and token-free forms): then the chain links the key's effect nodes and region calls.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from ..effects import effect_of
from ..graph.walk import region_call
from ..program.records import Form
from ..program.text import graph_code, program_text

# Distinct, readable on white; assigned to effect keys in sorted order.
PALETTE = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22")

_TOKEN_FUNCS = (ops.make_token, ops.sink_tokens)


def _programs_of(prog: Any) -> list[Any]:
    forward = getattr(prog, "forward", None)
    backward = getattr(prog, "backward", None)
    if forward is not None and backward is not None and hasattr(forward, "graph_module"):
        return [forward, backward]
    return [prog]


def _short_target(target: Any) -> str:
    if target is ops.invoke_subgraph:
        return "invoke_subgraph"
    if target is ops.with_effects:
        return "with_effects"
    if target in _TOKEN_FUNCS:
        return target.__name__
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target._schema.name.split("::", 1)
        overload = target._overloadname
        return f"{ns}.{name}" + ("" if overload == "default" else f".{overload}")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target._qualified_op_name).replace("::", ".")
    return getattr(target, "__name__", str(target))


def _fmt(value: Any) -> str:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_fmt(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.Tensor):
        return f"tensor({str(value.dtype).replace('torch.', '')}{list(value.shape)})"
    if callable(value) and not isinstance(value, type):
        return _short_target(value)
    return repr(value)


def _sorted_keys(keys: Any) -> list[str]:
    return sorted(keys) if keys else []


class _GraphDescriber:
    """Describes one program's graphs; subgraphs are described once each (by attribute name)."""

    def __init__(self, prog: Any, index: int, out: dict[str, Any]) -> None:
        self.prog = prog
        self.index = index
        self.out = out  # graph id -> description (shared across programs)
        self.form = getattr(prog, "form", Form.CAPTURED)
        self.regions = getattr(prog, "regions", {}) or {}
        self.seen: dict[int, str] = {}
        self.out_tokens: dict[fx.Node, list[str | None]] = {}  # node -> keys of its leading token results

    def gid(self, attr: str) -> str:
        return f"p{self.index}:{attr}"

    def region_keys(self, gm: fx.GraphModule, identifier: str | None) -> list[str] | None:
        """The token keys a graph takes and returns at its boundary, if it has token boundaries."""
        keys = gm.meta.get("effectfx_token_keys")
        if keys is not None:
            return list(keys)
        if self.form is not Form.FUNCTIONALIZED:
            return None
        if identifier is None:
            return list(getattr(self.prog, "token_keys", ()))
        entry = self.regions.get(identifier)
        return _sorted_keys(getattr(entry, "effects", None))

    def describe(self, gm: fx.GraphModule, attr: str, identifier: str | None,
                 boundary_keys: list[str] | None) -> str:
        if id(gm) in self.seen:
            return self.seen[id(gm)]
        gid = self.gid(attr)
        self.seen[id(gm)] = gid
        info = gm.meta.get("effectfx_region")
        entry = self.regions.get(identifier) if identifier else None
        desc: dict[str, Any] = {
            "id": gid,
            "attr": attr,
            "identifier": identifier,
            "region": getattr(entry, "name", None) or (info[0].name if info else None),
            "direction": info[3] if info else None,
            "effects": _sorted_keys(getattr(entry, "effects", None)) if entry is not None else [],
            "effects_known": entry is not None and getattr(entry, "effects", None) is not None,
            "signature": graph_code(gm, attr).splitlines()[0] if identifier else None,
            "nodes": [],
            "chains": {},
        }
        self.out[gid] = desc  # before the nodes, so nested descriptions come after their parent
        tok: dict[fx.Node, str | None] = {}
        pending: list[fx.Node] = []  # make_token nodes whose key is known only from their consumer
        nodes: list[dict[str, Any]] = []
        by_name: dict[str, dict[str, Any]] = {}

        def set_key(n: Any, key: str | None) -> None:
            if isinstance(n, fx.Node) and key is not None and tok.get(n) is None and n in tok:
                tok[n] = key

        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if boundary_keys:
            for n, key in zip(placeholders, boundary_keys):
                tok[n] = key
        subgraph_attrs = set()
        for node in gm.graph.nodes:
            call = region_call(node)
            if call is not None and isinstance(call[1][0], fx.Node):
                subgraph_attrs.add(call[1][0].target)

        for node in gm.graph.nodes:
            d: dict[str, Any] = {"name": node.name, "kind": "op", "target": "", "args": [], "text": "",
                                 "key": None, "tokens": [], "subgraph": None, "identifier": None,
                                 "region": None}
            if node.op == "placeholder":
                d["kind"] = "input"
                d["target"] = str(node.target)
                if node in tok:
                    d["kind"], d["key"] = "token", tok[node]
                d["text"] = f"input {node.name}"
            elif node.op == "output":
                d["kind"] = "output"
                outs = node.args[0]
                outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
                d["args"] = [_fmt(a) for a in outs]
                d["tokens"] = [tok[a] for a in outs if isinstance(a, fx.Node) and tok.get(a)]
                d["text"] = f"return ({', '.join(d['args'])})"
            elif node.op == "get_attr":
                if node.target in subgraph_attrs:
                    continue  # drawn as the region box of the call that uses it
                d["target"] = str(node.target)
                d["text"] = f"{node.name} = self.{node.target}"
            elif node.op == "call_function":
                self._call(gm, node, d, tok, pending, set_key)
            else:
                d["target"] = str(node.target)
                d["text"] = node.format_node() or node.name
            nodes.append(d)
            by_name[node.name] = d
        for n in pending:
            if tok.get(n) is not None:
                by_name[n.name]["key"] = tok[n]
                by_name[n.name]["tokens"] = [tok[n]]
        # token consumers and producers
        for node in gm.graph.nodes:
            d = by_name.get(node.name)
            if d is None:
                continue
            if node in tok and tok[node] is not None and d["kind"] in ("getitem", "token", "input"):
                d["kind"] = "token"
                d["key"] = tok[node]
            consumed = [tok[a] for a in node.all_input_nodes if tok.get(a)]
            produced = [tok[node]] if tok.get(node) else []
            keys = list(dict.fromkeys([*consumed, *produced, *d["tokens"]]))
            d["tokens"] = keys
        desc["nodes"] = nodes
        desc["chains"] = self._chains(gm, nodes)
        return gid

    def _call(self, gm: fx.GraphModule, node: fx.Node, d: dict[str, Any], tok: dict[fx.Node, Any],
              pending: list[fx.Node], set_key: Any) -> None:
        target = node.target
        args = list(node.args)
        d["target"] = _short_target(target)
        if target is ops.make_token:
            d["kind"] = "token"
            tok[node] = None
            pending.append(node)
            d["text"] = f"{node.name} = make_token()"
            return
        if target is ops.sink_tokens:
            d["kind"] = "token"
            d["args"] = [_fmt(a) for a in args]
            d["text"] = f"sink_tokens({', '.join(d['args'])})"
            return
        if target is operator.getitem:
            src, index = args
            d["kind"] = "getitem"
            d["args"] = [_fmt(src), repr(index)]
            d["text"] = f"{node.name} = {_fmt(src)}[{index}]"
            src_keys = self.out_tokens.get(src) if isinstance(src, fx.Node) else None
            if src_keys and isinstance(index, int) and index < len(src_keys):
                tok[node] = src_keys[index]
                d["kind"] = "token"
                d["key"] = src_keys[index]
            return
        wrapped_token = None
        effect_key = None
        if target is ops.with_effects:
            wrapped_token, op, *rest = args
            if op is ops.invoke_subgraph:
                target, args = op, rest
            else:
                effect_key = effect_of(op) or (tok.get(wrapped_token) if isinstance(wrapped_token, fx.Node)
                                               else None)
                set_key(wrapped_token, effect_key)
                if isinstance(wrapped_token, fx.Node) and tok.get(wrapped_token) is None:
                    tok[wrapped_token] = effect_key
                d.update(kind="effect", key=effect_key, target=_short_target(op),
                         args=[_fmt(a) for a in rest])
                kw = "".join(f", {k}={_fmt(v)}" for k, v in node.kwargs.items())
                d["text"] = f"{_short_target(op)}({', '.join(d['args'])}{kw})"
                self.out_tokens[node] = [effect_key]
                return
        if target is ops.invoke_subgraph:
            attr_node, identifier, *operands = args
            sub = getattr(gm, attr_node.target)
            sub_keys = self.region_keys(sub, identifier)
            entry = self.regions.get(identifier)
            d.update(kind="region", target="invoke_subgraph", identifier=identifier,
                     region=getattr(entry, "name", None))
            if sub_keys:
                for a, key in zip(operands, sub_keys):
                    set_key(a, key)
                    if isinstance(a, fx.Node) and a not in tok:
                        tok[a] = key
            out_tokens = list(sub_keys or [])
            if wrapped_token is not None:  # unlifted: the region call is itself one effect
                keys = _sorted_keys(getattr(entry, "effects", None))
                key = tok.get(wrapped_token) if isinstance(wrapped_token, fx.Node) else None
                key = key or (keys[0] if len(keys) == 1 else None)
                set_key(wrapped_token, key)
                d["key"] = key
                out_tokens = [key, *out_tokens]
            self.out_tokens[node] = out_tokens
            d["subgraph"] = self.describe(sub, attr_node.target, identifier, sub_keys)
            d["args"] = [_fmt(a) for a in operands]
            # the user's name for the region (``Block.forward``) rather than the subgraph attribute
            # (``Block_forward_subgraph0``), which the page shows beside it
            name = d["region"] or self.out[d["subgraph"]]["region"] or attr_node.target
            backward = self.out[d["subgraph"]]["direction"] == "backward"
            d["text"] = f"{name}{' backward' if backward else ''}({', '.join(d['args'])})"
            return
        key = effect_of(target) if isinstance(target, (torch._ops.OpOverload,)) else None
        d["args"] = [_fmt(a) for a in args] + [f"{k}={_fmt(v)}" for k, v in node.kwargs.items()]
        if key is not None:  # captured or token-free form: an effectful op called directly
            d.update(kind="effect", key=key)
            d["text"] = f"{d['target']}({', '.join(d['args'])})"
        else:
            d["text"] = f"{node.name} = {d['target']}({', '.join(d['args'])})"

    def _chains(self, gm: fx.GraphModule, nodes: list[dict[str, Any]]) -> dict[str, Any]:
        chains: dict[str, Any] = {}
        for d in nodes:
            for key in d["tokens"]:
                chains.setdefault(key, {"nodes": [], "style": "token"})["nodes"].append(d["name"])
        region_effects = {g["id"]: g["effects"] for g in self.out.values()}
        for d in nodes:  # keys without tokens: node order links the effects (captured, token-free)
            keys = [d["key"]] if d["kind"] == "effect" and d["key"] else []
            if d["kind"] == "region" and d["subgraph"]:
                keys += region_effects.get(d["subgraph"], []) or self._nested_keys(d["subgraph"])
            for key in keys:
                chain = chains.setdefault(key, {"nodes": [], "style": "order"})
                if chain["style"] == "order" and d["name"] not in chain["nodes"]:
                    chain["nodes"].append(d["name"])
        return chains

    def _nested_keys(self, gid: str, depth: int = 0) -> list[str]:
        """Effect keys of a subgraph found by looking inside it (when the region cache has none)."""
        g = self.out.get(gid)
        if g is None or depth > 50:
            return []
        keys = {d["key"] for d in g["nodes"] if d["kind"] == "effect" and d["key"]}
        for d in g["nodes"]:
            if d["kind"] == "region" and d["subgraph"]:
                keys.update(g2 for g2 in (self.out[d["subgraph"]]["effects"] or
                                          self._nested_keys(d["subgraph"], depth + 1)))
        return sorted(keys)


def _inside(graphs: dict[str, Any], gid: str, seen: set[str]) -> list[str]:
    if gid in seen:
        return []
    seen.add(gid)
    g = graphs[gid]
    keys = {d["key"] for d in g["nodes"] if d["kind"] == "effect" and d["key"]}
    for d in g["nodes"]:
        if d["kind"] == "region" and d["subgraph"]:
            keys.update(graphs[d["subgraph"]]["effects"] or _inside(graphs, d["subgraph"], seen))
    return sorted(keys)


def program_json(prog: Any, title: str | None = None) -> dict[str, Any]:
    """Describe a Program or TrainingProgram (every graph, every node) as JSON-able data."""
    graphs: dict[str, Any] = {}
    programs = []
    for index, p in enumerate(_programs_of(prog)):
        describer = _GraphDescriber(p, index, graphs)
        root_keys = describer.region_keys(p.graph_module, None)
        if not root_keys and getattr(p, "token_keys", ()):
            root_keys = list(p.token_keys)
        root = describer.describe(p.graph_module, "forward", None, root_keys)
        programs.append({
            "name": getattr(p, "name", "program"),
            "form": str(getattr(p, "form", Form.CAPTURED)),  # (the JSON holds its name)
            "token_keys": list(getattr(p, "token_keys", ())),
            "history": [[r.name, r.seconds] for r in getattr(p, "history", ())],
            "root": root,
            "code": program_text(p.graph_module),
        })
    for gid, g in graphs.items():  # keys effectful somewhere inside each graph (regions nested or not)
        g["effects_inside"] = _inside(graphs, gid, set())
    keys = sorted({k for g in graphs.values() for d in g["nodes"] for k in [d["key"], *d["tokens"]] if k}
                  | {k for g in graphs.values() for k in g["effects"]})
    return {
        "title": title or programs[0]["name"],
        "form": programs[0]["form"],
        "keys": keys,
        "colors": {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(keys)},
        "programs": programs,
        "graphs": graphs,
    }
