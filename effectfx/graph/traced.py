"""Plain records of a trace: tensor metadata, operand sources, and what one traced graph returns."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch.utils._pytree import TreeSpec

from ..errors import CaptureError
from .symbols import dims, hint

_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction


@dataclass(frozen=True, eq=False)
class TensorMeta:
    """A tensor's metadata.  Sizes and strides may be symbolic (``SymInt``: Note [Symbolic shapes]);
    metadata compare and hash by their expressions, never by asking the symbols (which would guard)."""

    shape: tuple[Any, ...]
    stride: tuple[Any, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def _fields(self) -> tuple:
        return (dims(self.shape), dims(self.stride), self.dtype, self.device, self.requires_grad)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorMeta) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    @property
    def symbolic(self) -> bool:
        """Whether a size or stride is not a plain int: a symbol, or its expression in a loaded program."""
        return any(type(d) is not int for d in (*self.shape, *self.stride))

    def example(self) -> TensorMeta:
        """The metadata with each symbolic size as it was in the captured call."""
        if not self.symbolic:
            return self
        return TensorMeta(tuple(map(hint, self.shape)), tuple(map(hint, self.stride)), self.dtype,
                          self.device, self.requires_grad)

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        # a FakeTensor knows its device without a dispatch (t.device would dispatch prim.device); the
        # tracer's torch-function mode need not see these reads, which come from effectfx itself
        with _NO_TORCH_FUNCTION():
            device = getattr(t, "fake_device", None) or t.device
            return TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype, device, t.requires_grad)

    def without_grad(self) -> TensorMeta:
        return TensorMeta(self.shape, self.stride, self.dtype, self.device, False)

    def tangent(self) -> TensorMeta:
        """A gradient of a tensor like this one as backward graphs take it: contiguous, whatever the
        tensor's layout (a transposed result's gradient arrives as its caller's formula made it), so every
        place a gradient enters a backward graph makes it contiguous first (Note [Joint trace])."""
        stride, step = [], 1
        for size in reversed(self.shape):
            stride.insert(0, step)
            step *= max(size, 1) if type(size) is int else size  # (a symbol is >= 2: it never is 0 or 1)
        return TensorMeta(self.shape, tuple(stride), self.dtype, self.device, False)

    def short(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        contiguous, step = [], 1
        for size in reversed(self.shape):
            contiguous.insert(0, step)
            step *= max(size, 1) if type(size) is int else size
        layout = "" if dims(contiguous) == dims(self.stride) else f" stride {list(self.stride)}"
        return f"{dt}{list(self.shape)}{layout}" + ("(grad)" if self.requires_grad else "")


def tangents_of(grads: tuple, mask: tuple[bool, ...]) -> list[torch.Tensor | None]:
    """The gradients a backward graph takes, of the outputs ``mask`` marks differentiable: contiguous, as
    it was traced (``TensorMeta.tangent``; a copy only where one is not)."""
    return [g if g is None or g.is_contiguous() else g.contiguous() for g, m in zip(grads, mask) if m]


class Kind(str, enum.Enum):
    """A kind named by a string: it compares, hashes, prints and saves as its value, so program text,
    saved files and messages read as with the plain string (what ``enum.StrEnum`` is, from Python 3.11)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class SourceKind(Kind):
    """Where a graph input comes from: ``OperandSource.kind``."""

    ARG = "arg"  # the tensor leaf ``index`` of the flattened (args, kwargs)
    MODULE = "module"  # parameter/buffer ``name`` of the nn.Module at leaf ``index``
    LIFTED = "lifted"  # the real ``tensor`` itself: a global, a closed-over constant, a root's parameter
    LABEL = "label"  # the string found at ``path`` from the call site's arguments (effectfx.guards.reads)


@dataclass(frozen=True)
class OperandSource:
    """Where a graph input comes from at a call site (Note [Region identity]); ``kind`` says which of
    the other fields locate it (``SourceKind``)."""

    kind: SourceKind
    index: int = -1
    name: str = ""
    tensor: Any = field(default=None, compare=False)
    path: tuple = ()


class OutputKind(Kind):
    """What a leaf of a traced graph's result is: ``OutputLeaf.kind``."""

    TENSOR = "tensor"  # the graph's tensor output ``value`` (an index)
    CONST = "const"  # the constant ``value`` itself, returned as traced


class OutputLeaf(NamedTuple):
    """One leaf of a traced graph's result, in the result's flattened order (``TracedGraph.out_layout``)."""

    kind: OutputKind
    value: Any


@dataclass
class TracedGraph:
    """One traced graph (the root or a region body), partitioned when it was traced jointly.

    ``forward`` maps inputs to ``(*tensor outputs, *saved)``; ``backward`` maps ``(*saved, *tangents)``
    to one gradient per input whose ``grad_mask`` is set (None where no gradient flows).  A region body's
    forward does not return the saved values that are its inputs (``saved_inputs``): each call site
    passes its own operand to the backward instead.
    """

    forward: fx.GraphModule
    backward: fx.GraphModule | None
    sources: list[OperandSource]
    input_meta: list[TensorMeta]
    out_spec: TreeSpec
    out_layout: list[OutputLeaf]  # per output leaf: tensor output k, or a constant
    out_meta: list[TensorMeta]
    saved_meta: list[TensorMeta] = field(default_factory=list)
    saved_names: tuple[str, ...] = ()  # the saved values' node names: a partial backward's key to them
    saved_inputs: tuple[int | None, ...] = ()  # per saved value: the input it is, when not returned (None)
    tangent_mask: tuple[bool, ...] = ()
    grad_mask: tuple[bool, ...] = ()
    grad_meta: list[TensorMeta | None] = field(default_factory=list)  # per backward output
    # inputs written in place, by index: their new values are the last tensor outputs (Note [Mutations])
    mutated: tuple[int, ...] = ()
    # per differentiable output: the others whose backward reaches its own (Note [Partial backward])
    covered_by: tuple[frozenset[int], ...] = ()
    # a body's, per tensor output: the inputs its autograd graph reaches; and whether that graph holds an
    # autograd.Function of the code's own (Note [Region identity], promotion)
    out_deps: tuple[frozenset[int], ...] = ()
    custom_autograd: bool = True
    # top-level arguments whose containers the code changed: the result is (out, their new values), which
    # the call site writes into the caller's (Note [Mutations], ``program.containers``)
    written_args: tuple = ()
    # the Python state a body wrote (``program.python_writes``): the result is then (out, tensors written)
    # and each call site makes the writes into its own objects (Note [Python state])
    python_writes: tuple = ()

    @property
    def n_outs(self) -> int:
        return len(self.out_meta)

    @property
    def returned_saved(self) -> list[int]:
        """Positions (among the saved values) of those the forward returns, in its output order."""
        return [k for k, j in enumerate(self.saved_inputs) if j is None]

    @property
    def saved(self) -> tuple[tuple[str, TensorMeta], ...]:
        return tuple(zip(self.saved_names, self.saved_meta))

    @property
    def n_user_outs(self) -> int:
        """Tensor outputs the traced code returned (the rest are new values of mutated inputs)."""
        return len(self.out_meta) - len(self.mutated)

    def passthrough(self) -> dict[int, int]:
        """{tensor output k: input j} for outputs that are an input returned unchanged."""
        found = self.__dict__.get("_passthrough")
        if found is None:
            inputs = [n for n in self.forward.graph.nodes if n.op == "placeholder"]
            output = next(iter(reversed(self.forward.graph.nodes)))
            outs = output.args[0][: self.n_outs]
            found = {k: inputs.index(o) for k, o in enumerate(outs) if o in inputs}
            self.__dict__["_passthrough"] = found
        return found


def mask_text(mask: tuple[bool, ...]) -> str:
    """``(True, False)`` -> ``"10"``: which outputs a partial backward serves, for names."""
    return "".join("1" if m else "0" for m in mask)


def saved_positions(full: tuple[tuple[str, TensorMeta], ...], part: tuple[tuple[str, TensorMeta], ...],
                    where: str) -> tuple[int, ...]:
    """Where each ``(name, meta)`` value a partial backward reads sits among the full backward's saved
    values (Note [Partial backward]): both traces ran the same forward, so its nodes have the same names."""
    index = {item: i for i, item in enumerate(full)}
    found = tuple(index.get(item, -1) for item in part)
    if -1 in found:
        raise_changed(where)
    return found


def same_forward(full: fx.GraphModule, part: fx.GraphModule, where: str) -> None:
    """Check that a retrace's forward is the first trace's (Note [Partial backward]): every node it kept
    (it drops what only the full backward needed) is the node of that name in ``full``, same op, same
    arguments -- constants included, which names alone would not show.  A ``detach`` is no computation in
    a graph that runs below autograd, and a retrace that needs fewer gradients keeps fewer of them: both
    sides are compared as if each ``detach`` were its argument."""
    nodes = {n.name: n for n in full.graph.nodes}
    for node in part.graph.nodes:
        if node.op == "output" or node.target is _DETACH:
            continue
        twin = nodes.get(node.name)
        if twin is None or (twin.op, twin.target, _args_text(twin), repr(twin.kwargs)) != (
                node.op, node.target, _args_text(node), repr(node.kwargs)):
            raise_changed(where)


_DETACH = torch.ops.aten.detach.default


def _args_text(node: fx.Node) -> str:
    def through_detach(arg: Any) -> Any:
        while isinstance(arg, fx.Node) and arg.target is _DETACH:
            arg = arg.args[0]
        return arg

    return repr(fx.node.map_arg(node.args, through_detach))


def raise_changed(where: str) -> None:
    raise CaptureError(
        f"{where}: its backward was asked for some of its outputs only, which effectfx traces anew (Note "
        "[Partial backward]), but the new trace ran a different forward (state the code reads changed since "
        "the forward ran?), so its backward would not be the forward's.\nMake the code's behaviour depend "
        "only on its arguments, or use every output in the loss."
    )
