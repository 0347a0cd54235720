"""Readable, normalized text of a program's graphs (used by ``print(prog)`` and golden tests)."""

from __future__ import annotations

import re

import torch.fx as fx

from .. import ops
from ..graph.walk import nested_graphs

_DEL_SUFFIX = re.compile(r";\s+[\w\s=;,]*= None\s*$")
# FX names a function global after its module and name: effectfx_ops_cond -> effectfx.ops.cond
_GLOBALS = {name.replace(".", "_"): name for name in ops.TARGETS}
_GLOBAL_RE = re.compile("|".join(_GLOBALS))
_DIRECT_RE = re.compile(r"\b(_op\d+_\w+)\(")


def graph_code(gm: fx.GraphModule, name: str = "forward") -> str:
    """The body of ``gm`` as Python, without FX's bookkeeping (``x = None`` frees, blank lines)."""
    display = getattr(gm.graph._codegen, "display_names", None)  # passes.direct_calls: ops by their names
    lines = []
    # FX's generator: the code a graph runs comes from effectfx.graph.codegen, which is for running only
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


def program_text(gm: fx.GraphModule, title: str = "") -> str:
    parts = [f"# {title}" if title else "", graph_code(gm)]
    for attr, identifier, body in nested_graphs(gm, regions_only=False):
        label = f"'{identifier}'" if identifier != attr else "control flow (Note [Control flow])"
        parts.append(f"\n# {attr}: {label}\n" + graph_code(body, attr))
    return "\n".join(p for p in parts if p)
