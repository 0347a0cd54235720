"""Readable, normalized text of a program's graphs (used by ``print(prog)`` and golden tests)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch.fx as fx

from .. import ops

_DEL_SUFFIX = re.compile(r";\s+[\w\s=;,]*= None\s*$")
_GLOBALS = {
    "effectfx_ops_invoke_subgraph": "effectfx.ops.invoke_subgraph",
    "effectfx_ops_with_effects": "effectfx.ops.with_effects",
    "effectfx_ops_make_token": "effectfx.ops.make_token",
    "effectfx_ops_sink_tokens": "effectfx.ops.sink_tokens",
    "effectfx_ops_cond": "effectfx.ops.cond",
    "effectfx_ops_while_loop": "effectfx.ops.while_loop",
    "effectfx_ops_scan": "effectfx.ops.scan",
}
_GLOBAL_RE = re.compile("|".join(_GLOBALS))
_DIRECT_RE = re.compile(r"\b(_op\d+_\w+)\(")


def graph_code(gm: fx.GraphModule, name: str = "forward") -> str:
    """The body of ``gm`` as Python, without FX's bookkeeping (``x = None`` frees, blank lines)."""
    display = getattr(gm.graph._codegen, "display_names", None)  # passes.direct_calls: ops by their names
    lines = []
    # FX's generator: the code a graph runs comes from effectfx.codegen, which is for running only
    for line in fx.Graph.python_code(gm.graph, root_module="self").src.splitlines():
        if not line.strip():
            continue
        line = _DEL_SUFFIX.sub("", line.rstrip())
        line = _GLOBAL_RE.sub(lambda m: _GLOBALS[m.group(0)], line)
        if display:
            line = _DIRECT_RE.sub(lambda m: display.get(m.group(1), m.group(1)) + "(", line)
        if line.startswith("def forward("):
            line = line.replace("def forward(", f"def {name}(", 1)
        lines.append(line)
    return "\n".join(lines)


def control_flow_graphs(node: fx.Node) -> list[fx.Node]:
    """The get_attr nodes of the subgraphs a control-flow node runs (Note [Control flow]), else []."""
    if node.op != "call_function":
        return []
    args = node.args
    if node.target is ops.with_effects and len(args) > 1:
        target, args = args[1], args[2:]
    else:
        target = node.target
    if target not in ops.CONTROL_FLOW:
        return []
    return [a for a in args if isinstance(a, fx.Node) and a.op == "get_attr"]


def nested_graphs(gm: fx.GraphModule, regions_only: bool = True) -> Iterator[tuple[str, str, fx.GraphModule]]:
    """Every subgraph reachable from ``gm``, once each, depth first: (attr, identifier, module).  Region
    bodies, and with ``regions_only=False`` also the subgraphs of control flow (identifier: their attr)."""
    seen: set[int] = set()

    def visit(owner: fx.GraphModule) -> Iterator[tuple[str, str, fx.GraphModule]]:
        for node in owner.graph.nodes:
            if node.op != "call_function":
                continue
            args = node.args
            if node.target is ops.with_effects and len(args) > 1 and args[1] is ops.invoke_subgraph:
                args = args[2:]
            elif node.target is not ops.invoke_subgraph:
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


def program_text(gm: fx.GraphModule, title: str = "") -> str:
    parts = [f"# {title}" if title else "", graph_code(gm)]
    for attr, identifier, body in nested_graphs(gm, regions_only=False):
        label = f"'{identifier}'" if identifier != attr else "control flow (Note [Control flow])"
        parts.append(f"\n# {attr}: {label}\n" + graph_code(body, attr))
    return "\n".join(p for p in parts if p)
