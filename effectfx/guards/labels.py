"""Labels (Note [Region identity]): a ``str`` a region body read, that notices any use of its value, and
labels as operands.  A ``str`` a body reads and only passes to effectful ops --
``record_memory("forward", self.name)`` -- becomes an input of the body, so one body serves every layer
and each call site passes its own value.

The body's reads (``effectfx.guards.reads``) hand it :class:`Label` s.  Effect ops see them first, at the
``__torch_function__`` level, where Python objects keep their identity: :class:`LabelMode` swaps a label
for a unique sentinel string, and the tracer maps the sentinel back to the label's placeholder when it
records the op.  Any other use -- a comparison, a hash, formatting, a non-effect op, a backward formula --
marks the label *used*, and :meth:`BodyLabels.finish` bakes its value back in as a constant, the body's
guards then holding that value.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from ..effects import effect_of

_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
_SENTINEL = "\x00efx-label-"
# a tensor's autograd state as Python code sees it: what a body reading it may decide on
_GRAD_STATE = frozenset(getattr(torch.Tensor, name) for name in ("requires_grad", "is_leaf", "grad_fn",
                                                                 "grad", "retains_grad"))
_GETTER = type(torch.Tensor.requires_grad.__get__)  # what a torch-function mode sees for a property read
# reads from effectfx's own code are its bookkeeping, not the traced code's (what effectfx itself decides on
# autograd state, it reports: ``LabelMode.grad_state_read``)
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_COUNTER = itertools.count()


# -- the label: a str that notices a use of its value ----------------------------------------------------


def _observed(method: str) -> Callable[..., Any]:
    base = getattr(str, method)

    def observe(self: Label, *args: Any) -> Any:
        Label.mark_used(self)
        args = tuple(str.__str__(a) if isinstance(a, Label) else a for a in args)
        return base(str.__str__(self), *args)

    observe.__name__ = method
    return observe


class Label(str):
    """A ``str`` a body read, that reports the first time anything looks at its value.

    ``owner`` made it (the body's recorder, which may pass it to the body as an operand); ``watchers`` are
    the other recorders that saw the read and must guard on its value once it is used.
    """

    def __new__(cls, value: str, owner: Any, path: tuple, on_use: Callable[[Label], None]) -> Label:
        self = super().__new__(cls, value)
        object.__setattr__(self, "_efx", {"owner": owner, "path": path, "used": False,
                                          "on_use": on_use, "watchers": [(owner, path)]})
        owner.operand(path)
        return self

    def state(self) -> dict:
        return object.__getattribute__(self, "_efx")

    def watch(self, reads: Any, path: tuple) -> None:  # reads: a guards.reads.Reads
        st = Label.state(self)
        if st["used"]:
            reads.specialize(path, str.__str__(self))
        else:
            st["watchers"].append((reads, path))
            reads.operand(path)

    def mark_used(self) -> None:
        st = Label.state(self)
        if st["used"]:
            return
        st["used"] = True
        value = str.__str__(self)
        for reads, path in st["watchers"]:
            reads.specialize(path, value)
        st["on_use"](self)

    def __getattribute__(self, name: str) -> Any:
        # isinstance() asks for __class__, torch's argument parser probes for __torch_function__
        if name in ("state", "watch", "mark_used", "__class__") or name.startswith("__torch"):
            return object.__getattribute__(self, name)
        Label.mark_used(self)
        return getattr(str.__str__(self), name)

    def __str__(self) -> str:
        Label.mark_used(self)
        return str.__str__(self)

    def __repr__(self) -> str:
        Label.mark_used(self)
        return repr(str.__str__(self))

    def __hash__(self) -> int:
        Label.mark_used(self)
        return hash(str.__str__(self))

    def __reduce__(self) -> Any:
        Label.mark_used(self)
        return (str, (str.__str__(self),))

    for _m in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__len__", "__getitem__",
               "__iter__", "__contains__", "__add__", "__mul__", "__rmul__", "__mod__", "__rmod__",
               "__format__", "__sizeof__", "__getnewargs__"):
        locals()[_m] = _observed(_m)
    del _m

    def __radd__(self, other: Any) -> Any:
        Label.mark_used(self)
        return other + str.__str__(self)


def raw(value: Any) -> Any:
    """The plain ``str`` behind a Label, without counting as a use; anything else unchanged."""
    return str.__str__(value) if isinstance(value, Label) else value


# -- labels as operands ----------------------------------------------------------------------------------


class BodyLabels:
    """The labels one body handed out, and the placeholder of each one passed on as an operand."""

    def __init__(self, add_input: Callable[[Label, tuple], fx.Node]) -> None:
        self.add_input = add_input
        self.reads: Any = None  # the body's recorder (a guards.reads.Reads), which the labels report to
        self.by_path: dict[tuple, Label] = {}
        self.nodes: dict[int, tuple[Label, fx.Node]] = {}
        self.done = False

    def make(self, path: tuple, value: str, parent: Any = None) -> Label:
        label = self.by_path.get(path)
        if label is None:
            on_use = (lambda _label: Label.mark_used(parent)) if isinstance(parent, Label) else _ignore
            label = self.by_path[path] = Label(value, self.reads, path, on_use)
        return label

    def node_for(self, value: Any) -> Any:
        """What a graph of this body passes for ``value``: a label's placeholder, or the plain value."""
        if not isinstance(value, Label):
            return value
        st = Label.state(value)
        # (in the backward phase too: an effect a checkpoint's recompute performs again reads the
        # forward's placeholder, which the call site passes to the backward call as well)
        if st["used"] or st["owner"] is not self.reads or self.done:
            Label.mark_used(value)
            return raw(value)
        found = self.nodes.get(id(value))
        if found is None:
            found = self.nodes[id(value)] = (value, self.add_input(value, st["path"]))
        return found[1]

    def finish(self, graph: fx.Graph, consts: list[Any]) -> list[Label]:
        """Before the body's graph is split or run: labels the body also used otherwise (or that appear
        inside other strings it baked in, or that it returns) become constants again.  Returns them."""
        self.done = True
        self._replayed(graph)
        clean = [lab for lab in self.by_path.values() if not Label.state(lab)["used"]]
        if clean:
            baked = [c for c in consts if isinstance(c, str)]
            for node in graph.nodes:
                if node.op == "call_function":
                    fx.node.map_aggregate((node.args, node.kwargs),
                                          lambda a: baked.append(a) if isinstance(a, str) else None)
            for lab in clean:
                value = raw(lab)
                if any(value in raw(s) for s in baked if s is not lab):
                    Label.mark_used(lab)
        dropped = []
        for label, node in list(self.nodes.values()):
            if Label.state(label)["used"]:
                value = raw(label)
                for user in list(node.users):
                    swap = (lambda n, node=node, v=value: v if n is node else n)
                    user.args, user.kwargs = fx.node.map_arg((user.args, user.kwargs), swap)
                graph.erase_node(node)
                dropped.append(label)
        return dropped


    def _replayed(self, graph: fx.Graph) -> None:
        """A checkpoint's recompute replays the forward in the backward, where no torch-function mode
        runs (the engine calls it): a label it passes to an effect reaches the op as its plain value.  An
        argument of a backward effect node whose value is that of the label the forward passed to the same
        op at the same position is that label; were that value also a constant there, it is ambiguous and
        stays baked (the label then specializes)."""
        if not self.nodes:
            return
        labelled: dict[tuple, set[Any]] = {}  # (op, position) -> label placeholders the forward passed
        constant: set[tuple] = set()  # (op, position, value) the forward passed as a constant
        replays = []
        for node in graph.nodes:
            if node.op != "call_function" or effect_of(node.target) is None:
                continue
            if node.meta.get("phase") == "backward":
                replays.append(node)
                continue
            for i, a in enumerate(node.args):
                if isinstance(a, fx.Node) and a.op == "placeholder" and isinstance(a.meta.get("val"), str):
                    labelled.setdefault((node.target, i), set()).add(a)
                elif isinstance(a, str):
                    constant.add((node.target, i, a))
        for node in replays:
            args = list(node.args)
            for i, a in enumerate(args):
                if not isinstance(a, str) or (node.target, i, a) in constant:
                    continue
                same = [ph for ph in labelled.get((node.target, i), ()) if ph.meta["val"] == a]
                if len(same) == 1:
                    args[i] = same[0]
            node.args = tuple(args)


def _ignore(_label: Label) -> None:
    pass


def _has_label(values: Any) -> bool:
    for v in values:
        if isinstance(v, Label) or isinstance(v, (list, tuple)) and any(isinstance(x, Label) for x in v):
            return True
    return False


def _ours(frame: Any) -> bool:
    return frame.f_code.co_filename.startswith(_OURS)


class LabelMode(TorchFunctionMode):
    """Sees torch calls before their arguments become C++ values: labels passed to an effectful op become
    sentinels (recorded as the body's operand); labels passed anywhere else count as used.  It also counts
    the traced code's reads of a tensor's autograd state (``x.requires_grad``, ``x.grad_fn``...): a body
    traced with an argument promoted to require grad must not have decided anything on it (Note [Region
    identity])."""

    def __init__(self) -> None:
        super().__init__()
        self.sentinels: dict[str, Label] = {}
        self.grad_state_reads = 0
        self.counting = True  # off while effectfx itself differentiates the trace

    def entered(self) -> contextlib.AbstractContextManager:
        """The mode, to enter around a body's trace; nothing where it is on the stack already (an
        enclosing body's trace).  It is off the stack while its own handler runs, and
        ``torch.autograd.grad`` reaches the engine through that handler: a region's backward that traces
        its body anew while its caller's backward is derived (Note [Partial backward]) enters it again, or
        the retrace's labels would reach their effects as constants (another forward than the first)."""
        on_stack = any(mode is self for mode in _get_current_function_mode_stack())
        return contextlib.nullcontext() if on_stack else self

    def grad_state_read(self) -> None:
        """What the trace records depends on a tensor's autograd state (a printed ``grad_fn``, say)."""
        self.grad_state_reads += 1

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        counting, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = counting

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if type(func) is _GETTER and func.__self__ in _GRAD_STATE and self.counting and not _ours(
                sys._getframe(1)):
            self.grad_state_reads += 1
        if _has_label(args) or _has_label(kwargs.values()):
            effectful = isinstance(func, _OPS) and effect_of(func) is not None
            args, kwargs = _map(lambda v: self._swap(v, effectful), (args, kwargs))
        return func(*args, **kwargs)

    def _swap(self, value: Any, effectful: bool) -> Any:
        if not isinstance(value, Label):
            return value
        if effectful and not Label.state(value)["used"]:
            sentinel = f"{_SENTINEL}{next(_COUNTER)}"
            self.sentinels[sentinel] = value
            return sentinel
        Label.mark_used(value)
        return raw(value)

    def resolve(self, value: Any, labels: BodyLabels | None, effectful: bool) -> tuple[Any, Any]:
        """(what the op runs on, what its node records) for one argument seen by the tracer."""
        if not (isinstance(value, str) and value.startswith(_SENTINEL)):
            return value, value
        label = self.sentinels.get(value)
        if label is None:
            return value, value
        if labels is None or not effectful:
            Label.mark_used(label)
            return raw(label), raw(label)
        return raw(label), labels.node_for(label)


def _map(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return type(value)(_map(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map(fn, v) for k, v in value.items()}
    return fn(value)


def has_sentinel(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(has_sentinel(v) for v in value)
    if isinstance(value, dict):
        return any(has_sentinel(v) for v in value.values())
    return isinstance(value, str) and value.startswith(_SENTINEL)


def resolve_labels(mode: LabelMode, labels: BodyLabels | None, effectful: bool, args: Any,
                   node_args: Any) -> tuple[Any, Any]:
    """The tracer's half: sentinels back to their values for the op to run on, and to the label's
    placeholder in the recorded node (when the op is effectful and the label the body's own)."""
    run = _map(lambda v: mode.resolve(v, labels, effectful)[0], args)
    nodes = _map(lambda v: mode.resolve(v, labels, effectful)[1], node_args)
    return run, nodes
