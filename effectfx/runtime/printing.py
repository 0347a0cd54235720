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
}
_GLOBAL_RE = re.compile("|".join(_GLOBALS))
_DIRECT_RE = re.compile(r"\b(_op\d+_\w+)\(")


def graph_code(gm: fx.GraphModule, name: str = "forward") -> str:
    """The body of ``gm`` as Python, without FX's bookkeeping (``x = None`` frees, blank lines)."""
    display = getattr(gm.graph._codegen, "display_names", None)  # passes.direct_calls: ops by their names
    lines = []
    for line in gm.code.splitlines():
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


def subgraphs(gm: fx.GraphModule) -> Iterator[tuple[str, str, fx.GraphModule]]:
    """Every region subgraph reachable from ``gm``, once each, depth first: (attr, identifier, module)."""
    seen: set[int] = set()

    def visit(owner: fx.GraphModule) -> Iterator[tuple[str, str, fx.GraphModule]]:
        for node in owner.graph.nodes:
            if node.op != "call_function":
                continue
            args = node.args
            if node.target is ops.with_effects and len(args) > 1 and args[1] is ops.invoke_subgraph:
                args = args[2:]
            elif node.target is not ops.invoke_subgraph:
                continue
            body = getattr(owner, args[0].target)
            if id(body) in seen:
                continue
            seen.add(id(body))
            yield args[0].target, args[1], body
            yield from visit(body)

    yield from visit(gm)


def program_text(gm: fx.GraphModule, title: str = "") -> str:
    parts = [f"# {title}" if title else "", graph_code(gm)]
    for attr, identifier, body in subgraphs(gm):
        parts.append(f"\n# {attr}: '{identifier}'\n" + graph_code(body, attr))
    return "\n".join(p for p in parts if p)
