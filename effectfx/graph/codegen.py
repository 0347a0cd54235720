"""The Python that effectfx's graphs run: a lean code generator, for running only (printing uses FX's).

FX's generator serves printing as much as running: it annotates every line with the value's type, renames
every node through a fresh namespace and rewrites every node's repr to do so.  That costs ~13 us per node,
and Python's ``compile`` of the long annotated source as much again -- on a capture whose root graph has a
handful of nodes per region call site, the largest cost per site.  Code to run needs none of it:

* a line per node, named by ``node.name`` (unique in its graph and a valid identifier);
* ``a, b = _g3_items(invoke_subgraph(...))`` (``operator.itemgetter``) for a call whose only users take
  items of its result: one statement instead of one per item, and the tuple is never bound, so it is freed
  at once;
* operators, functions and every constant that is not a plain literal are bound as globals, so the source
  never depends on a repr round-tripping;
* a computed value is released (``x = None``) after its last use, as FX's code does: peak memory is the
  same (inputs are not: the caller's argument list holds them for the whole call anyway).

Anything else (``call_module`` nodes, placeholders with defaults, pytree calling conventions, attribute
paths that are not identifiers) goes to FX's generator, which stays the only one used for printing.
"""

from __future__ import annotations

import keyword
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.graph import PythonCode
from torch.fx.immutable_collections import immutable_dict, immutable_list


class _Unsupported(Exception):
    """A node the lean generator leaves to FX."""


class _Globals:
    def __init__(self, taken: set[str]) -> None:
        self.values: dict[str, Any] = {}
        self._names: dict[int, str] = {}
        self._taken = taken

    def name(self, value: Any, hint: str) -> str:
        found = self._names.get(id(value))
        if found is not None:
            return found
        name = f"_g{len(self.values)}_{hint}"
        while name in self._taken:
            name += "_"
        self.values[name] = value  # holds the value: its id stays unique while the code lives
        self._names[id(value)] = name
        return name


def _hint(value: Any) -> str:
    text = getattr(value, "_opname", None) or getattr(value, "__name__", None) or type(value).__name__
    return "".join(c if c.isalnum() else "_" for c in str(text).split(".")[-1])[:24]


class _Writer:
    def __init__(self, graph: fx.Graph, direct: bool) -> None:
        self.graph = graph
        self.direct = direct
        # names the code binds: nodes, and the inputs' parameter names
        self.globals = _Globals({n.name for n in graph.nodes} | {str(n.target) for n in graph.nodes
                                                                  if n.op == "placeholder"})
        self._getters: dict[tuple[int, ...], str] = {}

    def items(self, indices: list[int]) -> str:
        """The global ``itemgetter`` of these indices: one per distinct tuple, shared by every line."""
        key = tuple(indices)
        name = self._getters.get(key)
        if name is None:
            name = self._getters[key] = self.globals.name(operator.itemgetter(*key), "items")
        return name

    def arg(self, value: Any) -> str:
        kind = type(value)
        if kind is fx.Node:
            return value.name
        if value is None or kind is bool or kind is int or kind is str:
            return repr(value)
        if kind is float and math.isfinite(value):
            return repr(value)
        if kind is tuple:
            inner = ", ".join(self.arg(v) for v in value)
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        if kind is list or kind is immutable_list:
            return "[" + ", ".join(self.arg(v) for v in value) + "]"
        if kind is dict or kind is immutable_dict:
            if not all(type(k) is str for k in value):
                raise _Unsupported
            return "{" + ", ".join(f"{k!r}: {self.arg(v)}" for k, v in value.items()) + "}"
        if kind is slice:
            make = self.globals.name(slice, "slice")
            return f"{make}({self.arg(value.start)}, {self.arg(value.stop)}, {self.arg(value.step)})"
        if isinstance(value, (tuple, list, dict)):  # a subclass FX may hold nodes in: let FX decide
            raise _Unsupported
        return self.globals.name(value, _hint(value))  # functions, ops, dtypes, devices, inf, objects

    def call(self, node: fx.Node) -> str:
        args = [self.arg(a) for a in node.args]
        args.extend(f"{k}={self.arg(v)}" for k, v in node.kwargs.items())
        if node.op == "call_method":
            if not node.args or not str(node.target).isidentifier():
                raise _Unsupported
            return f"{args[0]}.{node.target}({', '.join(args[1:])})"
        target = node.target
        if target is operator.getitem and len(node.args) == 2 and not node.kwargs:
            return f"{args[0]}[{args[1]}]"
        if self.direct and isinstance(target, torch._ops.OpOverload):
            fn = self.globals.name(target._op, "op_" + target._opname)
        else:
            fn = self.globals.name(target, _hint(target))
        return f"{fn}({', '.join(args)})"


def items_taken(node: fx.Node) -> list[tuple[int, fx.Node]] | None:
    """``[(index, getitem node)]`` when every user of ``node`` takes a constant item of it, else None."""
    items = []
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem and len(user.args) == 2
                and user.args[0] is node and type(user.args[1]) is int and not user.kwargs):
            return None
        items.append((user.args[1], user))
    return items or None


def release_points(nodes: list[fx.Node], index: dict[fx.Node, int], skip: Callable[[fx.Node], bool]
                   ) -> dict[fx.Node, list[fx.Node]]:
    """Computed values (neither inputs nor attributes, and not ``skip``) by the node after which they are
    dead: their last user, or themselves when nothing reads them.  What the output returns stays."""
    released: dict[fx.Node, list[fx.Node]] = {}
    for node in nodes:
        if node.op in ("placeholder", "get_attr", "output") or skip(node):
            continue
        last = max(node.users, key=index.__getitem__) if node.users else node
        if last.op != "output":
            released.setdefault(last, []).append(node)
    return released


def runtime_code(graph: fx.Graph, direct: bool) -> PythonCode | None:
    """Lean Python for ``graph`` (see the module docstring), or None to use FX's generator."""
    try:
        return _generate(graph, direct)
    except _Unsupported:
        return None


def _generate(graph: fx.Graph, direct: bool) -> PythonCode:
    w = _Writer(graph, direct)
    nodes = list(graph.nodes)
    if any(n.name == "self" or (n.op == "placeholder" and n.target == "self") for n in nodes):
        raise _Unsupported  # the module's own parameter name: FX's generator renames
    index = {node: i for i, node in enumerate(nodes)}
    # a call whose users all take items of it is one line binding those items; the tuple is never bound
    folded: dict[fx.Node, fx.Node] = {}
    unpacked: dict[fx.Node, list[tuple[int, fx.Node]]] = {}
    for node in nodes:
        if node.op in ("call_function", "call_method") and node.users and node not in folded:
            items = items_taken(node)
            if items is not None:
                used = [(k, u) for k, u in items if u.users]
                unpacked[node] = sorted(used, key=lambda item: index[item[1]])
                folded.update((user, node) for _, user in items)
    # each computed value is released after the line of its last user (never its own folded items);
    # inputs and attributes are not: the caller and the module hold them anyway
    released = {last: [n.name for n in dead] for last, dead in release_points(
        nodes, index, lambda n: n in unpacked or not n.users).items()}

    params: list[str] = []
    body: list[str] = []
    lineno_map: dict[int, int | None] = {}
    for i, node in enumerate(nodes):
        if node in folded:
            continue
        op = node.op
        if op == "placeholder":
            target = str(node.target)
            if node.args or not target.isidentifier() or keyword.iskeyword(target):
                raise _Unsupported
            params.append(target)
            if node.name != target:
                body.append(f"{node.name} = {target}")
        elif op == "get_attr":
            atoms = str(node.target).split(".")
            if not all(a.isidentifier() and not keyword.iskeyword(a) for a in atoms):
                raise _Unsupported
            body.append(f"{node.name} = self.{node.target}")
        elif op in ("call_function", "call_method"):
            expr = w.call(node)
            items = unpacked.get(node)
            if items is not None:
                if not items:
                    body.append(expr)
                elif len(items) == 1:
                    body.append(f"{items[0][1].name} = {expr}[{items[0][0]}]")
                else:
                    picked = w.items([k for k, _ in items])
                    body.append(f"{', '.join(user.name for _, user in items)} = {picked}({expr})")
            elif node.users:
                body.append(f"{node.name} = {expr}")
            else:
                body.append(expr)
        elif op == "output":
            body.append(f"return {w.arg(node.args[0])}")
            lineno_map[len(body)] = i
            break
        else:
            raise _Unsupported
        free = released.get(node)
        if free:
            body[-1] += "; " + " = ".join(free) + " = None"
        lineno_map[len(body)] = i
    lines = "\n".join("    " + line for line in body)
    src = f"\n\n\ndef forward(self, {', '.join(params)}):\n{lines}\n"
    return PythonCode(src, w.globals.values, _lineno_map=lineno_map, _prologue_start=4)
