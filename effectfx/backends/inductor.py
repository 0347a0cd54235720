"""lower_to_inductor: token-free form -> token-free form whose pure parts run as Inductor kernels (CPU).

Contract: requires the token-free form; gives a new Program whose root graph calls, in order, compiled
*segments* (``call_module`` of :class:`InductorSegment`) and the effectful ops between them, so every
effect runs exactly where eager runs it and Inductor never sees one.  Raises
:class:`~effectfx.errors.BackendError` for what cannot go to Inductor rather than running it wrongly.

How (see Note [Effect tokens] for why order needs care):
  1. Regions are inlined (Inductor gets one flat graph; the effects of every call site stay in place).
  2. Each effectful node (the registry decides) is a barrier; effect ``k`` runs after segment ``k``.  A pure
     node goes to the earliest segment in which all its inputs exist: ``seg(n) = max(avail(input))`` with
     ``avail`` 0 for graph inputs, ``seg(p)`` for a pure producer and ``k + 1`` for effect ``k``'s results.
     Pure work may move earlier (it is pure); effects never move.
  3. Every non-empty segment is decomposed to core aten (Inductor's decomposition table, via ``make_fx``
     on fake tensors) and compiled by ``torch._inductor.compile_fx.compile_fx_inner`` on example
     inputs built from the capture's tensor metadata.  TrainingPrograms are lowered half by half: their
     forward and backward graphs are already plain aten graphs (Note [Joint trace]).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .. import ops
from ..effects import effect_of
from ..errors import BackendError
from ..graphs import graph_module
from ..runtime.program import Program


class InductorSegment(torch.nn.Module):
    """One compiled pure segment: ``forward(*tensors) -> tuple`` of the values later steps read."""

    def __init__(self, source: fx.GraphModule, compiled: Any, strides: list[tuple[int, ...]]) -> None:
        super().__init__()
        object.__setattr__(self, "source", source)  # the aten graph it was compiled from (not a submodule)
        self.compiled = compiled
        self.strides = strides  # compiled code asserts its inputs' strides (e.g. an expanded tangent)

    def forward(self, *args: torch.Tensor) -> tuple:
        inputs = list(args)
        for i, (t, stride) in enumerate(zip(inputs, self.strides)):
            if t.stride() != stride:
                inputs[i] = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
        return tuple(self.compiled(inputs))


def inline_regions(gm: fx.GraphModule, constants: dict[str, Any] | None = None) -> fx.Graph:
    """A flat copy of a token-free graph: every ``invoke_subgraph`` replaced by its body, recursively.
    Program constants that are not subgraphs (a ProcessGroup) stay ``get_attr`` nodes, named in
    ``constants`` (name -> object)."""
    graph = fx.Graph()
    constants = {} if constants is None else constants
    names: dict[int, fx.Node] = {}

    def emit(owner: fx.GraphModule, inputs: list[Any] | None) -> list[Any]:
        env: dict[fx.Node, Any] = {}
        placeholders = iter(inputs) if inputs is not None else None
        for node in owner.graph.nodes:
            if node.op == "placeholder":
                if placeholders is None:
                    env[node] = graph.node_copy(node)
                else:
                    env[node] = next(placeholders)
            elif node.op == "get_attr":
                value = getattr(owner, node.target)
                if isinstance(value, fx.GraphModule):
                    env[node] = value
                else:  # written into generated code, it would be its repr: keep it an attribute
                    if id(value) not in names:
                        name = f"_constant{len(constants)}"
                        constants[name] = value
                        names[id(value)] = graph.get_attr(name)
                    env[node] = names[id(value)]
            elif node.op == "output":
                return [fx.map_arg(o, lambda n: env[n]) for o in node.args[0]]
            elif node.target is ops.invoke_subgraph:
                body, _identifier, *operands = node.args
                env[node] = emit(env[body], [fx.map_arg(o, lambda n: env[n]) for o in operands])
            elif node.target is operator.getitem and isinstance(env.get(node.args[0]), list):
                env[node] = env[node.args[0]][node.args[1]]
            elif node.op == "call_function" and node.target in (ops.with_effects, ops.make_token,
                                                                ops.sink_tokens):
                raise BackendError("Inductor lowering needs the token-free form; run remove_effect_tokens.")
            elif node.op == "call_function":
                env[node] = graph.node_copy(node, lambda n: env[n])
            else:
                raise BackendError(f"cannot lower node {node.format_node()} ({node.op}) to Inductor.")
        raise BackendError("graph without output")

    graph.output(tuple(emit(gm, None)))
    return graph


def _example(node: fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise BackendError(
            f"{node.format_node()} passes a {type(val).__name__} between an effect and Inductor code; only "
            "tensors can cross a segment boundary. Use the default backend for this program."
        )
    device = getattr(val, "fake_device", None) or val.device
    return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=device).zero_()


def _is_effect(node: fx.Node) -> bool:
    return node.op == "call_function" and effect_of(node.target) is not None


def lower_graph(gm: fx.GraphModule, name: str) -> fx.GraphModule:
    """Split a token-free graph into Inductor segments and effects (see the module docstring)."""
    constants: dict[str, Any] = {}
    flat = inline_regions(gm, constants)
    nodes = [n for n in flat.nodes if n.op not in ("placeholder", "output", "get_attr")]
    avail: dict[fx.Node, int] = {n: 0 for n in flat.nodes if n.op in ("placeholder", "get_attr")}
    segment_of: dict[fx.Node, int] = {}
    effects: list[fx.Node] = []
    effect_index: dict[fx.Node, int] = {}
    for node in nodes:
        if _is_effect(node):
            effect_index[node] = len(effects)
            effects.append(node)
            avail[node] = len(effects)
        elif node.target is operator.getitem and node.args[0] in effect_index:
            effect_index[node] = effect_index[node.args[0]]  # runs with its effect, in Python
            avail[node] = avail[node.args[0]]
        else:
            seg = max((avail[i] for i in node.all_input_nodes), default=0)
            segment_of[node] = avail[node] = seg

    new = fx.Graph()
    holder = torch.nn.Module()
    env: dict[fx.Node, Any] = {}
    for node in flat.nodes:
        if node.op == "placeholder":
            env[node] = new.node_copy(node)
        elif node.op == "get_attr":
            setattr(holder, node.target, constants[node.target])
            env[node] = new.node_copy(node)
    output = next(n for n in flat.nodes if n.op == "output")
    for seg in range(len(effects) + 1):
        members = [n for n in nodes if segment_of.get(n) == seg]
        if members:
            _emit_segment(new, holder, env, members, f"segment_{seg}", name)
        if seg < len(effects):
            for node in [effects[seg], *[n for n in nodes if effect_index.get(n) == seg
                                         and n is not effects[seg]]]:
                env[node] = new.node_copy(node, lambda n: env[n])
    new.output(fx.map_arg(output.args[0], lambda n: env[n]))
    return graph_module(holder, new, f"Inductor{type(gm).__name__}")


def _emit_segment(new: fx.Graph, holder: torch.nn.Module, env: dict[fx.Node, Any], members: list[fx.Node],
                  attr: str, name: str) -> None:
    inside = set(members)
    inputs: list[fx.Node] = []
    for node in members:
        for i in node.all_input_nodes:
            if i.op == "get_attr":
                raise BackendError(
                    f"{node.format_node()} in {name!r} takes the program constant {i.target} (a "
                    "ProcessGroup or torchbind object), which Inductor code cannot take. Use the default "
                    "backend for this program."
                )
            if i not in inside and i not in inputs:
                inputs.append(i)
    outputs = [n for n in members if any(u not in inside for u in n.users)]
    if not outputs:
        return  # nothing outside reads it: pure dead code
    graph = fx.Graph()
    local: dict[fx.Node, fx.Node] = {}
    for i in inputs:
        local[i] = graph.placeholder(i.name)
        local[i].meta = dict(i.meta)
    for node in members:
        local[node] = graph.node_copy(node, lambda n: local[n])
    graph.output(tuple(local[o] for o in outputs))
    source = fx.GraphModule(torch.nn.Module(), graph, attr)
    try:
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table
        from torch.fx.experimental.proxy_tensor import make_fx

        examples = [_example(i) for i in inputs]
        with torch.no_grad():  # Inductor lowers core aten: decompose first (as aot_autograd would)
            decomposed = make_fx(source, decomposition_table=select_decomp_table(), tracing_mode="fake")(
                *examples)
            compiled = compile_fx_inner(decomposed, examples)
    except BackendError:
        raise
    except Exception as e:
        raise BackendError(
            f"Inductor could not compile {attr} of {name!r} ({len(members)} nodes): {type(e).__name__}: {e}\n"
            "This program cannot go to Inductor; use efx.compile(fn) (the default backend) instead."
        ) from e
    setattr(holder, attr, InductorSegment(source, compiled, [tuple(e.stride()) for e in examples]))
    call = new.call_module(attr, tuple(env[i] for i in inputs))
    for k, out in enumerate(outputs):
        env[out] = new.call_function(operator.getitem, (call, k))
        env[out].meta = dict(out.meta)


def lower_to_inductor(prog: Program) -> Program:
    """Token-free -> token-free with Inductor segments between the effects (module docstring)."""
    if prog.form != "token-free":
        raise BackendError(f"lower_to_inductor needs the token-free form, got {prog.form}; run "
                           "thread_tokens and remove_effect_tokens first.")
    return prog.replace(graph_module=lower_graph(prog.graph_module, prog.name))
