"""Python ``print`` inside captured code: an ordered effect that prints run-time values, as eager does.

Capture runs the user's code once, on fake tensors; a plain ``print`` would print fake tensors once, at
capture, and never again.  While a capture runs, :func:`capture_prints` makes ``print`` *on the capturing
thread* (other threads print normally) record one call of the effect op ``effectfx::print`` (key
``"ordered"``), which prints at run time:

    effectfx::print(str fmt, Tensor[] tensors, str[] modes, int stream, bool flush) -> ()

``fmt`` is the whole printed text (``sep`` and ``end`` included) with a ``{}`` slot per tensor; at run time
each slot gets its tensor rendered as eager would have rendered it, by ``mode``:

* ``"r"`` -- ``Tensor.__repr__`` of the run-time tensor (a graph input: its own ``requires_grad``);
* ``"r:<suffix>"`` -- ``Tensor.__repr__`` of the run-time value plus the autograd suffix eager shows
  (``grad_fn=<MulBackward0>``, ``requires_grad=True``), known at capture: graphs run without autograd;
* ``"f:<spec>"`` -- ``format(value, spec)`` of a 0-dim tensor (``f"{loss:.3f}"``).

Tensors reach the text through ``repr`` and ``format``, wherever they are -- ``print(x)``, ``print([x, y])``,
an object's ``__repr__``, an f-string built before ``print`` was called -- because during capture
``Tensor.__repr__`` and ``Tensor.__format__`` (on the capturing thread) return a *marker* naming the
tensor; ``print`` turns the markers of its text into slots.  ``stream`` is 1 for ``sys.stdout`` and 2 for
``sys.stderr``, looked up at run time (as eager's ``print`` does).

The print higher-order op (``torch._higher_order_ops.print(format_str, *args, **kwargs)``) is this same
effect: in eager it is ``print(format_str.format(*args, **kwargs))``, and ``effectfx.hops.print_hop`` runs
exactly that under the tracer, so it records one ``effectfx::print`` node like any ``print``.

Where the run-time print cannot equal eager's, capture warns (:class:`UnfaithfulPrintWarning`) naming the
user's line: ``file=`` another stream (printed once, at capture, as before), a tensor whose ``grad_fn``
eager would show but effectfx cannot know (a region's result, or a region's argument that requires grad),
a marker of another capture.
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import operator
import re
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .. import ops
from ..effects import register_effect
from ..errors import UnfaithfulPrintWarning
from ..graph.source import user_frame, user_location

_ORIGINAL_PRINT = builtins.print
_ORIGINAL_REPR = torch.Tensor.__repr__
_ORIGINAL_FORMAT = torch.Tensor.__format__
_STREAMS = {1: lambda: None, 2: lambda: sys.stderr}  # None: print's own default, the current sys.stdout


# -- the effect op ---------------------------------------------------------------------------------------
def _with_suffix(text: str, suffix: str) -> str:
    """``Tensor.__repr__`` text with one more suffix, laid out as torch's ``_add_suffixes`` does."""
    body, indent = text[:-1], len("tensor(")
    last_line = len(body) - body.rfind("\n") + 1
    if last_line + len(suffix) + 2 > torch._tensor_str.PRINT_OPTS.linewidth:
        return f"{body},\n{' ' * indent}{suffix})"
    return f"{body}, {suffix})"


def _render(t: torch.Tensor, mode: str) -> str:
    kind, _, rest = mode.partition(":")
    if kind == "f":
        return format(t.detach().item(), rest)
    if not rest:
        return _ORIGINAL_REPR(t)
    return _with_suffix(_ORIGINAL_REPR(t.detach()), rest)


@torch.library.custom_op("effectfx::print", mutates_args=(),
                         schema="(str fmt, Tensor[] tensors, str[] modes, int stream, bool flush) -> ()")
def print_op(fmt: str, tensors: list[torch.Tensor], modes: list[str], stream: int, flush: bool) -> None:
    """Print ``fmt`` with each ``{}`` slot filled by its tensor rendered by its mode (module docstring)."""
    text = fmt.format(*(_render(t, m) for t, m in zip(tensors, modes)))
    _ORIGINAL_PRINT(text, end="", file=_STREAMS[stream](), flush=flush)


@print_op.register_fake
def _(fmt: str, tensors: list[torch.Tensor], modes: list[str], stream: int, flush: bool) -> None:
    return None


register_effect(print_op, key="ordered")


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
        grad_fn = getattr(node.meta.get("val"), "grad_fn", None)
        if grad_fn is None:
            return None
        if not _ours(grad_fn):
            return _grad_fn_name(grad_fn)
    return None


class _Capture:
    """One capture on one thread: its tracer and the tensors its markers stand for."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.marked: dict[int, tuple[torch.Tensor, str, str]] = {}  # id -> (tensor, "r"|"f", format spec)

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
        text = sep.join(str(a) for a in args) + end
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
        torch.ops.effectfx.print.default(fmt, tensors, modes, stream, bool(flush))

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
                tensors.append(t)
                modes.append(f"f:{spec}" if kind == "f" else self._repr_mode(t))
                fmt.append("{}")
            fmt.append(literal.replace("{", "{{").replace("}", "}}"))
        return "".join(fmt), tensors, modes

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
            _LOCAL.stack.append(None)
            try:
                with self.tracer.paused():
                    return _ORIGINAL_REPR(found[0])
            finally:
                _LOCAL.stack.pop()

        return _MARKER.sub(original, text)

    def _warn(self, message: str) -> None:
        frame, _ = user_frame()
        filename, lineno = (frame[0], frame[1]) if frame is not None else ("<unknown>", 0)
        warnings.warn_explicit(f"{message} (at {user_location()}).", UnfaithfulPrintWarning, filename, lineno)


# -- patching, on the capturing thread only --------------------------------------------------------------
_LOCAL = threading.local()
_LOCK = threading.Lock()
_INSTALLED = 0


def _current() -> _Capture | None:
    stack = getattr(_LOCAL, "stack", None)
    return stack[-1] if stack else None  # None on top: suspended (see _Capture._unmarked)


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
    # eager formats a 0-dim plain tensor as its item (f"{loss:.3f}"); a fake stands for a plain tensor
    if capture is None or not (isinstance(self, FakeTensor) or type(self) is torch.Tensor):
        return _ORIGINAL_FORMAT(self, format_spec)
    if self.dim() == 0:
        return capture.mark(self, "f", format_spec)
    if format_spec:
        return _ORIGINAL_FORMAT(self, format_spec)  # a TypeError, as in eager
    return capture.mark(self, "r")


_PATCHES = ((builtins, "print", _ORIGINAL_PRINT, _print), (torch.Tensor, "__repr__", _ORIGINAL_REPR, _repr),
            (torch.Tensor, "__format__", _ORIGINAL_FORMAT, _format))


def _install() -> None:
    global _INSTALLED
    with _LOCK:
        if _INSTALLED == 0:
            for owner, name, _, patched in _PATCHES:
                setattr(owner, name, patched)
        _INSTALLED += 1


def _uninstall() -> None:
    global _INSTALLED
    with _LOCK:
        _INSTALLED -= 1
        if _INSTALLED == 0:
            for owner, name, original, patched in _PATCHES:
                if getattr(owner, name) is patched:  # someone patched over us: leave theirs in place
                    setattr(owner, name, original)


@contextlib.contextmanager
def capture_prints(tracer: Any) -> Iterator[None]:
    """While capturing with ``tracer``: ``print`` on this thread records ``effectfx::print`` calls."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    _install()
    stack.append(_Capture(tracer))
    try:
        yield
    finally:
        stack.pop()
        _uninstall()


class _Silent:
    """A capture that prints nothing: see :func:`silenced`."""

    def print(self, args: tuple, sep: Any, end: Any, file: Any, flush: Any) -> None:
        return None

    def mark(self, t: torch.Tensor, kind: str, spec: str = "") -> str:
        return "<tensor>"


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """``print`` on this thread does nothing: for code that runs on fakes only to learn shapes (the kernel
    of a CompositeImplicitAutograd effect op, ``effectfx.capture.composite``), whose prints happen when the
    op runs."""
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    _install()
    stack.append(_Silent())
    try:
        yield
    finally:
        stack.pop()
        _uninstall()
