"""Making graphs and GraphModules.

``Graph`` is ``torch.fx.Graph`` without two costs: FX 2.13 walks every new node's arguments with pytree to
warn about raw SymInts, which is most of the ~40 us a node costs, and checks every node's name with a
regex.  effectfx traces static shapes only (no SymInt ever reaches a graph), and a capture creates a node
per op and per region call site, so it skips that walk (about 5x cheaper per node) and checks a name
candidate once (``_Names``: the same names as FX's).  Code generation is deferred until a module is
printed or runs a third time, because most graphs of a capture are intermediate (joint graphs, forms that
passes immediately rewrite) and many run once or twice: a GraphModule's first runs are interpreted
(``effectfx.graph.interpreter``), and the code it runs after that comes from effectfx's lean generator
(``effectfx.graph.codegen``); printing still uses FX's.
"""

from __future__ import annotations

import threading
import types
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import PythonCode, _illegal_names, _name_regex, _Namespace

from .codegen import runtime_code
from .interpreter import INTERPRETED_RUNS, steps_for

_RUNTIME = threading.local()  # set while a GraphModule generates the code it runs


def _lasting(target: Any) -> bool:
    return isinstance(target, (torch._ops.OpOverload, types.BuiltinFunctionType)) or (
        getattr(target, "__module__", "") == "effectfx.ops")


class _Names(_Namespace):
    """FX's namespace, with the check of a candidate name (a regex) done once per candidate rather than once
    per node; names come out exactly as FX's.  Only candidates that name no number (``relu``, ``getitem``:
    a bounded set) take the fast path; ``getitem_57`` and any name given with an object go to FX's."""

    _valid: set[str] = set()

    def create_name(self, candidate: str, obj: object | None) -> str:
        if obj is not None or candidate[-1:].isdigit():
            return super().create_name(candidate, obj)
        if candidate not in self._valid:
            if _name_regex.match(candidate) is None or len(self._valid) > 4096:
                return super().create_name(candidate, obj)
            self._valid.add(candidate)
        # FX's rule for a candidate without a number: its base is itself
        used = self._used_names
        count = self._base_count.get(candidate, 0)
        name = candidate
        if _illegal_names.get(candidate) is not None:  # a keyword or builtin
            count += 1
            name = f"{candidate}_{count}"
        while name in used:
            count += 1
            name = f"{candidate}_{count}"
        used.add(name)
        self._base_count[candidate] = count
        return name


class Graph(fx.Graph):
    # FX's name for a target is a regex away: once per operator (a bounded set, unlike user functions)
    _target_names: dict[Any, str] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._graph_namespace = _Names()

    def _target_to_str(self, target: Any) -> str:
        name = self._target_names.get(target) if _lasting(target) else None
        if name is None:
            name = super()._target_to_str(target)
            if _lasting(target):
                self._target_names[target] = name
        return name

    def create_node(self, op: str, target: Any, args: tuple | None = None, kwargs: dict | None = None,
                    name: str | None = None, type_expr: Any | None = None) -> fx.Node:
        # FX's create_node, less its argument walk and checks (see the module docstring)
        name = self._graph_namespace.create_name(name if name is not None else self._target_to_str(target),
                                                 None)
        node = fx.Node(self, name, op, target, tuple(args) if args else (), dict(kwargs) if kwargs else {},
                       type_expr)
        hooks = getattr(self._owning_module, "_create_node_hooks", None)
        if hooks:
            for hook in hooks:
                hook(node)
        self._graph_namespace.associate_name_with_obj(name, node)
        self._insert(node)
        self._find_nodes_lookup_table.insert(node)
        self._len += 1
        return node

    def runtime_calls(self, module_calls: str | None) -> str | None:
        """How what runs this graph calls operators ("direct": their C++ entry points, or "overload"), or
        None for FX's code: the module's own setting first (``module_calls``), then the codegen's."""
        plain = "overload" if type(self._codegen) is fx.graph.CodeGen else None
        return module_calls or getattr(self._codegen, "runtime_calls", plain)

    def python_code(self, root_module: str, **kwargs: Any) -> PythonCode:
        # codegens that run effectfx's graphs say how they call operators (so may the module running the
        # graph); any other codegen (FX's pytree convention, say) and any printing option get FX's
        calls = self.runtime_calls(getattr(_RUNTIME, "calls", None))
        running = getattr(_RUNTIME, "active", False) and root_module == "self" and not any(kwargs.values())
        if running and calls:
            code = runtime_code(self, direct=calls == "direct")
            if code is not None:
                return code
        return super().python_code(root_module, **kwargs)


class GraphModule(_LazyGraphModule):
    """A lazily compiled GraphModule whose code comes from ``effectfx.graph.codegen``.  ``runtime_calls``
    ("direct" or "overload"), when set, says how its code calls operators whatever the graph's codegen
    (a loaded program's graphs: ``program.serialize``)."""

    runtime_calls: str | None = None

    def _lazy_forward(self, *args: Any, **kwargs: Any) -> Any:
        # the first runs are interpreted (graph.interpreter); the code is generated when the graph runs again.
        # The state lives on the module's own class (FX makes one per module), which nothing else holds:
        # copies and pickles of the module never see it, and it dies with the module
        cls = type(self)
        tier = cls.__dict__.get("_efx_tier")
        if tier is None:
            graph = self.graph
            calls = graph.runtime_calls(self.runtime_calls) if isinstance(graph, Graph) else None
            tier = [steps_for(graph, calls == "direct") if calls else None, 0]
            cls._efx_tier = tier
        if tier[0] is not None and tier[1] < INTERPRETED_RUNS and not kwargs:
            tier[1] += 1
            return tier[0](self, args)
        tier[0] = None  # the code runs from now on
        # FX's lazy forward would call the module (``self(...)``), and so run torch's global module hooks
        # on effectfx's own graphs: call the generated code directly, as every later run does
        self.real_recompile()
        return type(self).forward(self, *args, **kwargs)

    forward = _lazy_forward

    def recompile(self) -> None:  # type: ignore[override]
        if "_efx_tier" in type(self).__dict__:
            del type(self)._efx_tier  # the graph changed: new steps, and new code when it runs
        super().recompile()

    def __reduce__(self) -> Any:
        # pickling (torch.save) writes the module's code and imports its globals by name: FX's code, whose
        # globals are importable (the lean code binds itemgetters, slices and constants as globals)
        previous, _RUNTIME.pickling = getattr(_RUNTIME, "pickling", False), True
        try:
            return super().__reduce__()
        finally:
            _RUNTIME.pickling = previous

    def _real_recompile(self) -> PythonCode:
        previous = getattr(_RUNTIME, "active", False), getattr(_RUNTIME, "calls", None)
        _RUNTIME.active, _RUNTIME.calls = not getattr(_RUNTIME, "pickling", False), self.runtime_calls
        try:
            return super()._real_recompile()
        finally:
            _RUNTIME.active, _RUNTIME.calls = previous


def node_name(target: Any) -> str | None:
    # name aten nodes after the op ("add", "record_memory"), as the seed's graphs read
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    return None


def graph_module(root: torch.nn.Module, graph: fx.Graph, class_name: str) -> fx.GraphModule:
    return GraphModule(root, graph, class_name)
