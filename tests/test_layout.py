"""The package's layout is its architecture (README, "How the code is laid out"): imports only go down the
layers, packages of one layer do not import each other, and no module imports itself through others --
counting every import, also those inside functions and under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "effectfx"

# bottom to top; a module belongs to the longest prefix listed (README's table, in the same order)
LAYERS: tuple[tuple[str, ...], ...] = (
    ("effectfx.errors", "effectfx.notes", "effectfx.threads"),
    ("effectfx.ops",),
    ("effectfx.effects",),
    ("effectfx.graph",),
    ("effectfx.guards",),
    ("effectfx.program", "effectfx.regions", "effectfx.autograd"),
    ("effectfx.interposers",),
    ("effectfx.capture", "effectfx.passes"),
    ("effectfx.hops", "effectfx.backends", "effectfx.viz"),
    ("effectfx.drivers",),
    ("effectfx.explanation",),
    ("effectfx",),  # the public face: effectfx/__init__.py
    ("effectfx.testing",),
    ("effectfx.cli",),
    ("effectfx.__main__",),
)


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str, source: str | None = None) -> set[str]:
    """The effectfx modules ``name`` (whose text is ``source``, by default its file's) imports, wherever
    the import statement stands."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "effectfx")
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "effectfx":
                continue
            for alias in node.names:  # ``from . import ops``: the submodule itself
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
    return {m for m in found if m in MODULES and m != name}


def layer_of(name: str) -> tuple[int, str]:
    """(layer index, the prefix that places it) of a module."""
    best = max(((i, p) for i, prefixes in enumerate(LAYERS) for p in prefixes
                if name == p or name.startswith(p + ".")), key=lambda ip: len(ip[1]))
    return best


GRAPH = {name: imports_of(name) for name in MODULES}


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in MODULES if layer_of(m)[1] == "effectfx" and m != "effectfx"]
    assert not unplaced, f"modules outside every package of LAYERS: {unplaced}"


def upward(name: str, targets: set[str]) -> list[str]:
    """The imports of ``targets`` by ``name`` that go up the layers, or sideways to another package."""
    layer, home = layer_of(name)
    wrong = []
    for target in sorted(targets):
        t_layer, t_home = layer_of(target)
        if t_layer > layer or (t_layer == layer and t_home != home):
            wrong.append(f"{target} (layer {t_layer}, {t_home})")
    return wrong


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_down(name: str) -> None:
    wrong = upward(name, GRAPH[name])
    assert not wrong, f"{name} (layer {layer_of(name)}) imports upward or sideways: {wrong}"


def test_no_import_circles() -> None:
    """Tarjan's strongly connected components of the import graph are single modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_an_import_inside_a_function_counts() -> None:
    """The way an upward import (and so a circle) is usually dodged is seen: a lazy import of the passes
    by the graph walks."""
    lazy = "\n\ndef f():\n    from ..passes.dce import dead_code_elimination\n"
    targets = imports_of("effectfx.graph.walk", MODULES["effectfx.graph.walk"].read_text() + lazy)
    assert "effectfx.passes.dce" in targets
    assert upward("effectfx.graph.walk", targets) == ["effectfx.passes.dce (layer 7, effectfx.passes)"]
