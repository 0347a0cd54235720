"""Running a graph without generating its code: its nodes as a list of steps (the first tier).

A GraphModule's code costs ~15-40 us per node to generate and for Python to ``compile``, about what
interpreting that node costs over 20 to 40 runs.  Most graphs of a capture run a handful of times, and
the root graph of a model whose layers are regions is one call per layer: generating its code is most of
what a call site costs on the first call.  So ``effectfx.graph.build.GraphModule`` runs a graph's
first :data:`INTERPRETED_RUNS` runs through :class:`Steps` and generates code (``graph.codegen``) when it
runs again.  Both tiers do the same thing in the same order: nodes run in graph order, operators are called as
the code would call them (``OpOverload`` or its direct ``_op``), and computed values are released after
their last use.

A step reads its arguments out of one list of values (``operator.itemgetter`` over slots: the arguments
of a node are gathered in C), so interpreting a node costs about a microsecond.  A graph this cannot
interpret exactly (``call_module``, placeholders with defaults, a pytree calling convention, containers
the fast path does not rebuild) is left to the code.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list

from .codegen import items_taken, release_points

INTERPRETED_RUNS = 2  # runs of a graph before its code is generated


class _Unsupported(Exception):
    """A graph these steps do not run exactly: its code does."""


def _gather(slots: list[int]) -> Callable[[list[Any]], tuple]:
    """A function of the values list returning the values at ``slots``, as a tuple."""
    if not slots:
        return lambda env: ()
    if len(slots) == 1:
        only = slots[0]
        return lambda env: (env[only],)
    return operator.itemgetter(*slots)


class Steps:
    """One graph as steps.  Call it with the module and the graph's inputs (no keyword arguments)."""

    def __init__(self, graph: fx.Graph, direct: bool) -> None:
        nodes = list(graph.nodes)
        index = {node: i for i, node in enumerate(nodes)}
        initial: list[Any] = []  # the values list at the start of a run: inputs, then constants filled in
        slots: dict[fx.Node, int] = {}
        constants: dict[Any, int] = {}

        def constant(value: Any) -> int:
            kind = type(value)
            plain = value is None or kind in (int, str, bool, float)
            # by value (0.0 and -0.0 are equal and hash alike: floats by their text)
            key = (kind, repr(value) if kind is float else value) if plain else id(value)
            slot = constants.get(key)
            if slot is None:
                slot = constants[key] = len(initial)
                initial.append(value)
            return slot

        def slot_of(value: Any, shared: bool = False) -> int:
            if type(value) is fx.Node:
                return slots[value]
            if isinstance(value, (tuple, list, dict, slice)) and not (shared and _constant(value)):
                raise _Unsupported  # a container the code builds anew on every run
            return constant(value)

        def new_slot(node: fx.Node) -> int:
            slot = slots[node] = len(initial)
            initial.append(None)
            return slot

        for node in nodes:
            if node.op == "placeholder":
                if node.args:
                    raise _Unsupported  # a default value
                new_slot(node)
        self.n_inputs = len(slots)
        step_of: dict[fx.Node, int] = {}  # a value -> the step that makes it
        folded: set[fx.Node] = set()  # items a call's step stores itself (the tuple is never stored)
        self.nodes: list[fx.Node] = []  # the node of each step, for describe()
        self.steps: list[tuple[int, Any, Any, dict, Any]] = []
        output: Callable[[list[Any]], Any] | None = None
        for node in nodes:
            op = node.op
            if op == "placeholder" or node in folded:
                continue
            if op == "output":
                output = _output(node.args[0], slot_of)
                break
            if op == "get_attr":
                step: tuple = (0, operator.attrgetter(str(node.target)), None, {}, new_slot(node))
            elif op in ("call_function", "call_method"):
                # an operator converts a constant list to its own argument type: it may share one
                shared = isinstance(node.target, torch._ops.OpOverload)
                gather = _gather([slot_of(a, shared) for a in node.args])
                kwargs = dict(node.kwargs)
                if not all(v is None or type(v) in (int, float, bool, str) or shared and _constant(v)
                           for v in kwargs.values()):
                    raise _Unsupported
                if op == "call_method":
                    fn = _method(str(node.target))
                else:
                    target = node.target
                    fn = target._op if direct and isinstance(target, torch._ops.OpOverload) else target
                items = items_taken(node) if node.users else None
                if items is None:
                    step = (1, fn, gather, kwargs, new_slot(node))
                else:  # ``a, b = call(...)`` as the code does: the items only
                    folded.update(user for _, user in items)
                    used = sorted(((k, u) for k, u in items if u.users), key=lambda item: index[item[1]])
                    for _, user in used:
                        step_of[user] = len(self.steps)
                    step = (2, fn, gather, kwargs, tuple((k, new_slot(u)) for k, u in used))
            else:
                raise _Unsupported  # call_module
            step_of[node] = len(self.steps)
            self.steps.append(step)
            self.nodes.append(node)
        if output is None:
            raise _Unsupported
        self.output = output
        self._output_node = node
        self._names = {slot: n.name for n, slot in slots.items()}
        self.initial = initial
        # each computed value is released after its last reader, as the code does; one nothing reads, at once
        last_use = {step_of[last]: [slots[n] for n in dead] for last, dead in release_points(
            nodes, index, lambda n: n not in slots).items()}
        self.release = [tuple(last_use.get(i, ())) for i in range(len(self.steps))]

    def describe(self) -> str:
        """The steps as text, one line per step: what it stores, what it calls, what it releases."""
        def text(value: Any) -> str:
            if type(value) is fx.Node:
                return value.name
            if isinstance(value, (tuple, list)):
                inner = ", ".join(text(v) for v in value)
                return f"({inner},)" if type(value) is tuple and len(value) == 1 else (
                    f"({inner})" if isinstance(value, tuple) else f"[{inner}]")
            return repr(value)

        lines = []
        for (kind, _, _, _, out), node, release in zip(self.steps, self.nodes, self.release):
            stored = ", ".join(self._names[slot] for _, slot in out) if kind == 2 else self._names[out]
            if kind == 0:
                call = f"self.{node.target}"
            else:
                args = [text(a) for a in node.args] + [f"{k}={text(v)}" for k, v in node.kwargs.items()]
                target = node.target
                name = str(target) if isinstance(target, torch._ops.OpOverload) else getattr(
                    target, "__name__", str(target))
                call = f"{name}({', '.join(args)})"
            freed = f"  # release {', '.join(self._names[s] for s in release)}" if release else ""
            lines.append(f"{stored} = {call}{freed}")
        lines.append(f"return {text(self._output_node.args[0])}")
        return "\n".join(lines)

    def __call__(self, module: torch.nn.Module, inputs: tuple) -> Any:
        if len(inputs) != self.n_inputs:
            raise TypeError(f"forward() takes {self.n_inputs} inputs, {len(inputs)} given")
        env = self.initial.copy()
        env[: self.n_inputs] = inputs
        for (kind, fn, gather, kwargs, out), release in zip(self.steps, self.release):
            if kind == 1:
                env[out] = fn(*gather(env), **kwargs) if kwargs else fn(*gather(env))
            elif kind == 2:
                value = fn(*gather(env), **kwargs) if kwargs else fn(*gather(env))
                for k, slot in out:
                    env[slot] = value[k]
            else:
                env[out] = fn(module)
            for dead in release:
                env[dead] = None
        return self.output(env)


def _method(name: str) -> Callable[..., Any]:
    def call(obj: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(obj, name)(*args, **kwargs)

    return call


def _output(value: Any, slot_of: Callable[[Any], int]) -> Callable[[list[Any]], Any]:
    """What the output node returns, read from the values list."""
    kind = type(value)
    if kind is tuple or kind is list or kind is immutable_list:
        gather = _gather([slot_of(v) for v in value])
        return gather if kind is tuple else (lambda env: list(gather(env)))
    if kind is dict or kind is immutable_dict:
        raise _Unsupported
    only = slot_of(value)
    return lambda env: env[only]


def _constant(value: Any) -> bool:
    """A container without nodes inside."""
    if isinstance(value, (tuple, list)):
        return all(_constant(v) for v in value)
    if isinstance(value, dict):
        return all(_constant(v) for v in value.values())
    return type(value) is not fx.Node and not isinstance(value, slice)


def steps_for(graph: fx.Graph, direct: bool) -> Steps | None:
    """The steps of ``graph``, or None when its code must run it."""
    try:
        return Steps(graph, direct)
    except _Unsupported:
        return None
