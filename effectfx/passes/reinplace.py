"""reinplace_in_place: updates of a program's inputs made where the inputs live (Note [Mutations]).

Contract: a Program that is not half of a TrainingProgram (whose forward runs inside an autograd.Function,
which must not update its inputs in place) whose root graph writes inputs
(``Program.mutations``: a training step's parameters and optimizer state, an inference program's buffers);
gives the same Program, its root graph changed in place (efx.compile's own capture, as
``passes.simplify.simplify_in_place``), computing the same values and effects, in which an elementwise op
-- or one of torch's ``_foreach_`` ops -- whose first operand holds a value nothing reads afterwards runs in
place: ``add(x, y)`` becomes ``add_(x, y)``.  The operand is a written input (its old value is dead: the
graph's result replaces it anyway) or a fresh intermediate.  A written input's last update then leaves its
new value in the input itself, and ``Program.write_back`` has nothing to copy: an optimizer's step updates
its parameters and state where they are, as eager's does.

Safe by construction, conservatively: storage is followed through aten's views; anything else that could
alias (a region call, a higher-order op, a non-aten call, an op already in place) makes the storages it
touches ineligible; an op is rewritten only when every other read of its operand's storage comes before it
in graph order (the order the default backend runs), no result of the graph is that storage's earlier value,
and the in-place result has the functional result's shape, dtype and strides.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from ..program.program import Program

aten = torch.ops.aten
_UNKNOWN = object()  # a value whose storage is not followed: never written in place


def _aliases(target: Any) -> bool:
    """Whether an aten op's result may share its first argument's storage (views, ``_unsafe_view``)."""
    return target.is_view or any(r.alias_info is not None for r in target._schema.returns) or (
        target in (aten._unsafe_view.default, aten.alias.default))


def _inplace(target: Any) -> Any:
    """The in-place overload of an elementwise or ``_foreach_`` aten op, or None."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target._schema.name.split("::")[1]
    if name.endswith("_") or not (torch.Tag.pointwise in target.tags or name.startswith("_foreach_")):
        return None
    packet = getattr(aten, name + "_", None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    if overload is None or not overload._schema.arguments or overload._schema.arguments[0].alias_info is None:
        return None
    return overload


def _tensors(arg: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(arg, found.append)
    return found


def _same_layout(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            and a.dtype == b.dtype and a.stride() == b.stride())


def _chain(x: fx.Node, final: Any) -> set[tuple[fx.Node, int]]:
    """The ops (and operand positions) that compute a written input's new value ``final`` from the input
    ``x`` through first operands: the only ones that may write ``x`` in place (the write-back after the
    graph puts ``final`` there; another value written into ``x`` would show in a result that holds it)."""
    steps: set[tuple[fx.Node, int]] = set()
    cur = final
    while cur is not x:
        if not isinstance(cur, fx.Node) or cur.op != "call_function" or not cur.args:
            return set()
        if cur.target is operator.getitem and isinstance(cur.args[0], fx.Node):
            source, k = cur.args[0], cur.args[1]
            many = bool(source.args) and isinstance(source.args[0], (list, tuple))
            firsts = _tensors(source.args[0]) if many else []
            if not isinstance(k, int) or k >= len(firsts) or _inplace(source.target) is None:
                return set()
            steps.add((source, k))
            cur = firsts[k]
        elif _inplace(cur.target) is not None and not isinstance(cur.args[0], (list, tuple)):
            steps.add((cur, 0))
            cur = cur.args[0]
        else:
            return set()
    return steps


def _reinplace(gm: fx.GraphModule, written: dict[fx.Node, Any]) -> int:
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: k for k, n in enumerate(nodes)}
    root: dict[fx.Node, Any] = {}  # node -> the node whose storage it holds (or _UNKNOWN)
    members: dict[Any, list[fx.Node]] = {}  # storage -> the nodes holding it
    banned: set[Any] = set()  # storages something unfollowed may alias
    output = nodes[-1]

    def hold(node: fx.Node, storage: Any) -> None:
        root[node] = storage
        members.setdefault(storage, []).append(node)

    def merge(fresh: fx.Node, storage: Any) -> None:  # ``fresh``'s storage is ``storage``'s now
        for member in members.pop(fresh, []):
            hold(member, storage)

    for node in nodes:
        target = node.target
        if node.op == "placeholder":
            hold(node, node)
        elif node.op != "call_function":
            continue
        elif target is operator.getitem and isinstance(node.args[0], fx.Node):
            source = node.args[0]
            storage = root.get(source, _UNKNOWN)
            views = isinstance(source.target, torch._ops.OpOverload) and _aliases(source.target)
            hold(node, storage if storage is _UNKNOWN or views else node)  # (a fresh result's element)
        elif isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable:
            # an aten op or a custom op (torch forbids a custom op's result to alias its inputs)
            first = _tensors(node.args[0]) if node.args else []
            hold(node, root.get(first[0], _UNKNOWN) if first and _aliases(target) else node)
        else:  # a region call, a higher-order op, an op in place: whatever it reads may alias
            for arg in node.all_input_nodes:
                banned.add(root.get(arg, _UNKNOWN))
            hold(node, _UNKNOWN)

    def dead_after(storage: Any, node: fx.Node) -> bool:
        if storage is _UNKNOWN or storage in banned:
            return False
        if storage not in written and storage.op != "call_function":  # an input nothing writes
            return False
        return all(user is node or (user is not output and order[user] < order[node])
                   for member in members[storage] for user in member.users)

    allowed = {x: _chain(x, final) for x, final in written.items()}
    escapes: set[fx.Node] = set()  # nodes a result of the graph holds, directly or through views
    for node in reversed(nodes):
        if output in node.users or any(u in escapes and root.get(u) is root.get(node) for u in node.users):
            escapes.add(node)
    changed = 0
    for node in nodes:
        inplace = _inplace(node.target) if node.op == "call_function" else None
        if inplace is None or not node.args:
            continue
        many = isinstance(node.args[0], (list, tuple))
        firsts = _tensors(node.args[0])
        results = node.meta.get("val") if many else [node.meta.get("val")]
        if not firsts or not isinstance(results, (list, tuple)) or len(results) != len(firsts):
            continue
        storages = [root.get(f, _UNKNOWN) for f in firsts]
        others = {id(root.get(a, _UNKNOWN)) for arg in (*node.args[1:], *node.kwargs.values())
                  for a in _tensors(arg)}
        if len({id(s) for s in storages}) != len(storages) or any(id(s) in others for s in storages):
            continue
        if many and any(u.target is not operator.getitem for u in node.users):
            continue
        outs = [u for u in node.users if u.target is operator.getitem] if many else [node]
        finals = {k: next((u for u in outs if not many or u.args[1] == k), None) for k in range(len(firsts))}
        if not all(dead_after(s, node) and _same_layout(f.meta.get("val"), r) and (s not in written or (
                (node, k) in allowed[s]  # on the way to the input's new value, which alone may be a result
                and (finals[k] is written[s] or finals[k] not in escapes)))
                   for k, (s, f, r) in enumerate(zip(storages, firsts, results))):
            continue
        node.target = inplace
        changed += 1
        if not many:
            merge(node, storages[0])
            continue
        for user in list(node.users):  # the in-place op returns nothing: each result is its operand now
            operand = firsts[user.args[1]]
            merge(user, root[operand])
            user.replace_all_uses_with(operand)
            graph.erase_node(user)
    if changed:
        gm.recompile()
    return changed


def reinplace_in_place(prog: Program) -> Program:
    """The contract in the module docstring; returns ``prog`` (its root graph rewritten in place)."""
    if not prog.mutations or prog.n_extra_outputs:
        return prog
    graph = prog.graph_module.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"][len(prog.token_keys):]
    outs = list(next(reversed(graph.nodes)).args[0])[len(prog.token_keys):]
    first_new = len(outs) - len(prog.mutations)  # the new values follow the user's outputs (Note [Mutations])
    _reinplace(prog.graph_module, {inputs[i]: outs[first_new + j] for j, i in enumerate(prog.mutations)})
    return prog
