"""Python ``print`` inside captured code: an ordered effect that prints run-time values, as eager does.

Capture runs the user's code once, on fake tensors; a plain ``print`` would print fake tensors once, at
capture, and never again.  While a capture runs, :func:`capture_prints` makes ``print`` *on the capturing
thread* (other threads print normally) record one call of the effect op ``effectfx::print`` (key
``"ordered"``; ``effectfx.interposers.print_op``: its text with a slot per tensor, and each slot's *mode*, how
it renders its run-time tensor as eager would have -- autograd suffix, ``format`` spec, ``torch.func``
wrappers).  The print options the captured code sets are effects on the same key
(``effectfx.interposers.print_options``), so each print is laid out with those eager would use.

Tensors reach the text through ``repr`` and ``format``, wherever they are -- ``print(x)``, ``print([x, y])``,
an object's ``__repr__``, an f-string built before ``print`` was called -- because during capture
``Tensor.__repr__`` and ``Tensor.__format__`` (on the capturing thread) return a *marker* naming the
tensor; ``print`` turns the markers of its text into slots.

The print higher-order op (``torch._higher_order_ops.print(format_str, *args, **kwargs)``) is this same
effect: in eager it is ``print(format_str.format(*args, **kwargs))``, and ``effectfx.hops.print_hop`` runs
exactly that under the tracer, so it records one ``effectfx::print`` node like any ``print``.

Where the run-time print cannot equal eager's, capture warns (:class:`UnfaithfulPrintWarning`) naming the
user's line: ``file=`` another stream (printed once, at capture, as before), a tensor whose ``grad_fn``
eager would show but effectfx cannot know (a region's result, or a region's argument that requires grad),
a forward-AD dual tensor (eager adds its ``tangent=``), a marker of another capture.
"""

from __future__ import annotations

import builtins
import itertools
import logging
import operator
import re
import sys
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .. import ops
from ..graph.source import user_location
from ..graph.symbols import is_symbolic
from ..threads import ThreadStack
from . import print_options
from .interpose import interpose
from .print_op import ORIGINAL_PRINT as _ORIGINAL_PRINT
from .print_op import ORIGINAL_REPR as _ORIGINAL_REPR
from .print_op import batched, peel
from .print_options import emit, warn_unfaithful

_ORIGINAL_FORMAT = torch.Tensor.__format__


# -- markers ---------------------------------------------------------------------------------------------
def _ours(grad_fn: Any) -> bool:
    """Whether ``grad_fn`` belongs to effectfx's own autograd functions (a region call), not to an op."""
    forward_cls = getattr(type(grad_fn), "_forward_cls", None)
    return getattr(forward_cls, "__module__", "").startswith("effectfx.")


def _grad_fn_name(grad_fn: Any) -> str:
    name = type(grad_fn).__name__  # as torch._tensor_str names it
    return grad_fn.name().rsplit("::", 1)[-1] if name == "CppFunction" else name



_MARKER = re.compile(r"\x1f<effectfx tensor #(\d+)>\x1e")
_IDS = itertools.count()


def region_result_grad_fn(tracer: Any, t: torch.Tensor) -> str | None:
    """The grad_fn eager would show on a region's result: that of the body's output, found through the
    ``getitem(invoke_subgraph(body, ...), i)`` node that produced ``t`` (nested regions followed)."""
    builder = tracer.builder
    node, owner = builder.values.get(id(t)), builder.holder
    while node is not None and node.target is operator.getitem:
        call, i = node.args
        if getattr(call, "target", None) is not ops.invoke_subgraph:
            return None
        owner = getattr(owner, call.args[0].target, None)
        if owner is None:
            return None
        node = next(reversed(owner.graph.nodes)).args[0][i]
        value = node.meta.get("val")
        grad_fn = getattr(value, "grad_fn", None)
        if grad_fn is None:
            return None
        written = tracer.written_by_region.get(id(value))  # a nested region's write-back: its body's op
        if written is not None and written[0] is grad_fn:
            return written[1]
        if not _ours(grad_fn):
            return _grad_fn_name(grad_fn)
    return None


class _Capture:
    """One capture on one thread: its tracer and the tensors its markers stand for."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.marked: dict[int, tuple[torch.Tensor, str, str]] = {}  # id -> (tensor, "r"|"f", format spec)
        self.options = print_options.Shadow(self._record)
        self.as_text = False

    def _record(self, op: Any, args: tuple) -> None:
        if self.tracer.builders and self.tracer.recording:
            emit(self.tracer, op, args)

    def mark(self, t: torch.Tensor, kind: str, spec: str = "") -> str:
        n = next(_IDS)
        self.marked[n] = (t, kind, spec)
        return f"\x1f<effectfx tensor #{n}>\x1e"

    # -- print -----------------------------------------------------------------------------------------
    def print(self, args: tuple, sep: Any, end: Any, file: Any, flush: Any) -> None:
        sep = " " if sep is None else sep
        end = "\n" if end is None else end
        tracer = self.tracer
        plain = isinstance(sep, str) and isinstance(end, str)
        if not plain or not tracer.builders or not tracer.recording:
            # print's own errors (a non-str sep), or code that runs outside any graph
            return _ORIGINAL_PRINT(*args, sep=sep, end=end, file=file, flush=flush)
        self.as_text = True  # a size turned into text here is the example's (``_sym_repr``)
        try:
            text = sep.join(str(a) for a in args) + end
        finally:
            self.as_text = False
        if file is None or file is sys.stdout:
            stream = 1
        elif file is sys.stderr:
            stream = 2
        else:
            self._warn(f"print(..., file={file!r}) runs once, during capture, with fake tensors, and "
                       "never at run time: effectfx captures prints to sys.stdout and sys.stderr only. Print "
                       "outside the captured function, or write through an effect op "
                       "(torch.library.custom_op + efx.register_effect)")
            return _ORIGINAL_PRINT(self._unmarked(text), end="", file=file, flush=flush)
        fmt, tensors, modes = self._template(text)
        emit(tracer, torch.ops.effectfx.print.default, (fmt, tensors, modes, stream, bool(flush)))

    def _template(self, text: str) -> tuple[str, list[torch.Tensor], list[str]]:
        pieces = _MARKER.split(text)  # literal, id, literal, id, ..., literal
        fmt = [pieces[0].replace("{", "{{").replace("}", "}}")]
        tensors: list[torch.Tensor] = []
        modes: list[str] = []
        for n, literal in zip(pieces[1::2], pieces[2::2]):
            found = self.marked.get(int(n))
            if found is None:
                self._warn("print() of a string that holds a tensor from another capture: it prints "
                           "'<tensor>' at run time. Build the string inside the captured function")
                fmt.append("<tensor>")
            else:
                t, kind, spec = found
                t, wrappers = peel(t)
                if wrappers is None:
                    self._warn("print() of a tensor in a torch.func wrapper effectfx does not know: it "
                               "prints the value inside, without the wrapper eager shows")
                self._warn_if_dual(t)
                tensors.append(t)
                modes.append(f"f:{spec}" if kind == "f" else (wrappers or "") + self._repr_mode(t))
                fmt.append("{}")
            fmt.append(literal.replace("{", "{{").replace("}", "}}"))
        return "".join(fmt), tensors, modes

    def _warn_if_dual(self, t: torch.Tensor) -> None:
        if torch.autograd.forward_ad._current_level < 0:
            return
        with self.tracer.paused():  # a look, not an op of the program
            dual = torch.autograd.forward_ad.unpack_dual(t).tangent is not None
        if dual:
            self._warn("print() of a forward-AD dual tensor (torch.autograd.forward_ad): eager adds its "
                       "tangent=...; effectfx prints the primal only. Print unpack_dual(x).tangent apart")

    def _repr_mode(self, t: torch.Tensor) -> str:
        """How the run-time repr gets eager's autograd suffix (module docstring)."""
        if not t.requires_grad:
            return "r"
        tracer = self.tracer
        fake = tracer.to_fake(t)
        node = tracer.builder.values.get(id(fake))
        if node is not None and node.op == "placeholder":
            if id(fake) not in tracer.real_of and tracer.region_stack:
                self._warn(f"print() of an argument of region {tracer.region_stack[-1].name!r} that requires "
                           "grad: eager shows the grad_fn of the caller's tensor, which one body shared by "
                           "every call cannot know; effectfx prints it without")
            return "r"  # the run-time input shows its own requires_grad
        tracer.label_mode.grad_state_read()  # the suffix is baked in: Note [Region identity], promotion
        grad_fn = t.grad_fn
        if grad_fn is None:
            return "r:requires_grad=True"
        written = tracer.written_by_region.get(id(t))
        if written is not None and written[0] is grad_fn:  # a region's in-place update, written back
            return f"r:grad_fn=<{written[1]}>"
        name = _grad_fn_name(grad_fn) if not _ours(grad_fn) else region_result_grad_fn(tracer, t)
        if name is None:
            self._warn("print() of a region's result that requires grad: eager shows the grad_fn of the "
                       "region's last op, which effectfx could not find; it prints the tensor without it")
            return "r"
        return f"r:grad_fn=<{name}>"

    def _unmarked(self, text: str) -> str:
        def original(match: re.Match) -> str:
            found = self.marked.get(int(match.group(1)))
            if found is None:
                return "<tensor>"
            # torch's repr re-enters Tensor.__repr__ through __torch_function__: no capture on this thread
            # while it runs, or it would hand back another marker
            with _CAPTURES.pushed(None), self.tracer.paused():
                return _ORIGINAL_REPR(found[0])

        return _MARKER.sub(original, text)

    def _warn(self, message: str) -> None:
        warn_unfaithful(message)


# -- interposed, on the capturing thread only ------------------------------------------------------------
_CAPTURES = ThreadStack()  # the prints of the captures running on this thread


def _current() -> _Capture | None:
    return _CAPTURES.top  # None on top: suspended (see _Capture._unmarked)


def _print(*args: Any, sep: Any = " ", end: Any = "\n", file: Any = None, flush: Any = False) -> None:
    capture = _current()
    if capture is None:
        return _ORIGINAL_PRINT(*args, sep=sep, end=end, file=file, flush=flush)
    return capture.print(args, sep, end, file, flush)


def _repr(self: torch.Tensor, *, tensor_contents: Any = None) -> str:
    capture = _current()
    if capture is None or tensor_contents is not None:
        return _ORIGINAL_REPR(self, tensor_contents=tensor_contents)
    return capture.mark(self, "r")


def _format(self: torch.Tensor, format_spec: str) -> str:
    capture = _current()
    # eager formats a 0-dim plain tensor as its item (f"{loss:.3f}"); a fake stands for a plain tensor; a
    # batched one cannot give its item, in eager as here
    if capture is None or not (isinstance(self, FakeTensor) or type(self) is torch.Tensor) or batched(self):
        return _ORIGINAL_FORMAT(self, format_spec)
    if self.dim() == 0:
        return capture.mark(self, "f", format_spec)
    if format_spec:
        return _ORIGINAL_FORMAT(self, format_spec)  # a TypeError, as in eager
    return capture.mark(self, "r")


# -- sizes as text (Note [Symbolic shapes]) -------------------------------------------------------------
# A symbolic size has no value at capture; text made of it (``print(x.shape)``, ``f"n={x.shape[0]}"``)
# would show the symbol's name at every run.  Text the captured code makes of a size pins the size to the
# example's value -- a shape guard: another size captures anew, and prints its own -- and efx.explain names
# it.  torch's and effectfx's own text (logs, messages) leaves sizes alone.
_LIBRARIES = tuple(str(p) for p in (Path(torch.__file__).parent, Path(__file__).parents[1],
                                    Path(logging.__file__).parent))


def _pinned(self: Any) -> Any:
    capture = _current()
    if capture is None or not is_symbolic(self):
        return None
    # (the frame of the size's repr or format, the interposer's dispatch, then the caller's)
    if not capture.as_text and sys._getframe(3).f_code.co_filename.startswith(_LIBRARIES):
        return None
    symbol = self.node.expr
    value = self.node.pytype(self)  # (guards: the program serves this value only)
    capture.tracer.specialized.append(f"text made of the size {symbol} at {user_location()} made {symbol} = "
                                      f"{value}")
    return value


def _interpose_sym(cls: type) -> None:
    original_repr, original_format = cls.__repr__, cls.__format__

    def repr_(self: Any) -> str:
        value = _pinned(self)
        return original_repr(self) if value is None else repr(value)

    def format_(self: Any, spec: str) -> str:
        value = _pinned(self)
        if value is None and spec and _current() is not None:  # (a size pinned already: ``{n / 2:.1f}``)
            value = self.node.pytype(self)
        return original_format(self, spec) if value is None else format(value, spec)

    interpose(cls, "__repr__", repr_)
    interpose(cls, "__format__", format_)


print_options.shadow_through(_current)
interpose(builtins, "print", _print)
interpose(torch.Tensor, "__repr__", _repr)
interpose(torch.Tensor, "__format__", _format)
for _cls in (torch.SymInt, torch.SymFloat, torch.SymBool):
    _interpose_sym(_cls)


def capture_prints(tracer: Any) -> AbstractContextManager[Any]:
    """While capturing with ``tracer``: ``print`` on this thread records ``effectfx::print`` calls."""
    return _CAPTURES.pushed(_Capture(tracer))


class _Silent:
    """A capture that prints nothing: see :func:`silenced`."""

    def __init__(self) -> None:
        self.options = print_options.Shadow(None)  # the kernel sets them again when the op runs

    def print(self, args: tuple, sep: Any, end: Any, file: Any, flush: Any) -> None:
        return None

    def mark(self, t: torch.Tensor, kind: str, spec: str = "") -> str:
        return "<tensor>"


def silenced() -> AbstractContextManager[Any]:
    """``print`` on this thread does nothing: for code that runs on fakes only to learn shapes (the kernel
    of a CompositeImplicitAutograd effect op, ``effectfx.interposers.composite``), whose prints happen when
    the op runs."""
    return _CAPTURES.pushed(_Silent())
