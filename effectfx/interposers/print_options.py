"""Print options set inside captured code: ordered effects, so that every ``print`` renders as eager's does.

Eager's ``print`` of a tensor reads ``torch._tensor_str.PRINT_OPTS`` when it runs, and a program may change
them (``torch.set_printoptions``, the ``torch._tensor_str.printoptions`` context).  The print op
(``effectfx.interposers.python_print``) reads them at run time too; what capture adds is the changes the
captured code makes, recorded on the print op's key ``"ordered"`` -- so each runs between the same prints, and
the caller finds the options as eager leaves them:

    effectfx::set_printoptions(Scalar? precision, Scalar? threshold, Scalar? edgeitems, Scalar? linewidth,
                               str? profile, Scalar? sci_mode) -> ()   # torch.set_printoptions(...)
    effectfx::printoptions_enter(<the same>) -> ()                      # with printoptions(...):
    effectfx::printoptions_exit() -> ()                                 # its end

``printoptions_enter`` saves the options *of the run time* (on a per-thread stack) before it sets its own,
and ``printoptions_exit`` restores them: the options outside the context are the caller's, whatever they are
when the program runs, not those of the capture.  (An effect op raising between the two at run time leaves
the context's options set, where eager's ``finally`` restores them.)  What captured code *reads* of the
options (``torch._tensor_str.get_printoptions()``) is the capture's, baked in: capture warns.

Capture itself changes no option (it runs no effect, and other threads keep printing with theirs): while a
capture runs, ``PRINT_OPTS`` answers the capturing thread from a *shadow*, its options as the captured code
has set them so far.  Writes are seen wherever the call comes from (``from torch import set_printoptions``
too): ``PRINT_OPTS``' class is swapped (an interposer, ``effectfx.interposers.interpose``), on every
thread, for one that asks :func:`shadow_through`'s ``current`` for the capturing thread's shadow.
``set_printoptions`` writes ``sci_mode`` last, once per call: that write
records the call, with the arguments of its frame; a ``set_printoptions`` called by ``printoptions``' own
frame is its enter (first) or its exit (second).
"""

from __future__ import annotations

import contextlib
import linecache
import sys
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode_temporarily

from ..effects import register_effect
from ..errors import UnfaithfulPrintWarning, UnsupportedOperatorError
from ..graph.source import user_frame, user_location
from .interpose import interpose

_TENSOR_STR = torch._tensor_str
PRINT_OPTS = _TENSOR_STR.PRINT_OPTS
_ORIGINAL_SET = _TENSOR_STR.set_printoptions
FIELDS = ("precision", "threshold", "edgeitems", "linewidth", "sci_mode")
_ARGS = ("precision", "threshold", "edgeitems", "linewidth", "profile", "sci_mode")  # set_printoptions'
_SET_CODE = _ORIGINAL_SET.__code__
_GET_CODE = _TENSOR_STR.get_printoptions.__code__
_CONTEXT_CODE = _TENSOR_STR.printoptions.__wrapped__.__code__  # the generator of the printoptions context
_SCHEMA = ("(Scalar? precision, Scalar? threshold, Scalar? edgeitems, Scalar? linewidth, str? profile, "
           "Scalar? sci_mode) -> ()")


def warn_unfaithful(message: str, caller: types.FrameType | None = None) -> None:
    """An :class:`UnfaithfulPrintWarning` naming the user's line (``caller``'s, when the stack between is the
    standard library's), attributed to it."""
    if caller is None:
        frame, _ = user_frame()
        filename, lineno = (frame[0], frame[1]) if frame is not None else ("<unknown>", 0)
        where = user_location()
    else:
        filename, lineno = caller.f_code.co_filename, caller.f_lineno
        code = linecache.getline(filename, lineno).strip()
        where = f"{filename}:{lineno} (in {caller.f_code.co_name}): {code}"
    warnings.warn_explicit(f"{message} (at {where}).", UnfaithfulPrintWarning, filename, lineno)


def emit(tracer: Any, op: Any, args: tuple) -> Any:
    """Record ``op(*args)`` as the tracer's, as if the user's Python had called no op at all: eager's
    ``print`` and ``set_printoptions`` are not ops, so no dispatch mode of the user's code (selective
    checkpointing's, which would cache the op and skip it in the recompute), no ``torch.func`` transform
    (which has no rule for it) and no autograd (the op returns nothing) may see it -- ``args`` hold the
    plain tensors inside functorch's wrappers.  Returns the op's (fake) result."""
    modes = _get_current_dispatch_mode_stack()
    at = next((i for i, m in enumerate(modes) if m is tracer), len(modes) - 1)
    with contextlib.ExitStack() as stack:
        for _ in modes[at + 1:]:  # the modes the user's code entered during the capture: SAC's
            stack.enter_context(_pop_mode_temporarily())
        stack.enter_context(torch._C._DisableFuncTorch())
        stack.enter_context(torch._C._AutoDispatchBelowAutograd())
        return op(*args)


# -- the effect ops --------------------------------------------------------------------------------------
_SAVED = threading.local()  # per thread: the options each printoptions_enter found, innermost last


def _set(precision: Any, threshold: Any, edgeitems: Any, linewidth: Any, profile: str | None,
         sci_mode: Any) -> None:
    _ORIGINAL_SET(precision=precision, threshold=threshold, edgeitems=edgeitems, linewidth=linewidth,
                  profile=profile, sci_mode=sci_mode)


set_op = torch.library.custom_op("effectfx::set_printoptions", _set, mutates_args=(), schema=_SCHEMA)


def _enter(precision: Any, threshold: Any, edgeitems: Any, linewidth: Any, profile: str | None,
           sci_mode: Any) -> None:
    saved = getattr(_SAVED, "stack", None)
    if saved is None:
        saved = _SAVED.stack = []
    saved.append({name: getattr(PRINT_OPTS, name) for name in FIELDS})
    _set(precision, threshold, edgeitems, linewidth, profile, sci_mode)


enter_op = torch.library.custom_op("effectfx::printoptions_enter", _enter, mutates_args=(), schema=_SCHEMA)


def _exit() -> None:
    saved = getattr(_SAVED, "stack", None)
    if saved:
        _ORIGINAL_SET(**saved.pop())


exit_op = torch.library.custom_op("effectfx::printoptions_exit", _exit, mutates_args=(), schema="() -> ()")

for _op in (set_op, enter_op, exit_op):
    _op.register_fake(lambda *args: None)
    register_effect(_op, key="ordered")


# -- the shadow of one capture ---------------------------------------------------------------------------
def _recordable(value: Any, profile: bool) -> bool:
    return value is None or isinstance(value, str if profile else (bool, int, float))


class Shadow:
    """The print options as the captured code on one thread sees them.  ``record(op, args)`` records an
    effect op (None: a capture whose code runs again at run time -- a composite kernel's -- records
    nothing)."""

    def __init__(self, record: Callable[[Any, tuple], None] | None) -> None:
        self.values = {name: getattr(PRINT_OPTS, name) for name in FIELDS}  # an enclosing capture's, if any
        self.record = record
        self.contexts: list[types.FrameType] = []  # printoptions() frames entered and not yet exited

    def read(self, name: str) -> Any:
        if self.record is not None and name == FIELDS[0]:  # get_printoptions reads every field: warn once
            self._warn_if_get(sys._getframe(2))
        return self.values[name]

    def write(self, name: str, value: Any, writer: types.FrameType) -> None:
        self.values[name] = value
        if self.record is None:
            return
        if writer.f_code is not _SET_CODE:
            warn_unfaithful(f"torch._tensor_str.PRINT_OPTS.{name} = {value!r} in captured code changes the "
                            "options during capture only, not at run time: call torch.set_printoptions")
            return
        if name != "sci_mode":  # the call is recorded at its last write, sci_mode's
            return
        args = tuple(writer.f_locals[a] for a in _ARGS)
        bad = [f"{a}={v!r}" for a, v in zip(_ARGS, args) if not _recordable(v, a == "profile")]
        if bad:
            raise UnsupportedOperatorError(
                f"torch.set_printoptions({', '.join(bad)}) in captured code at {user_location()}: effectfx "
                "records the call as an effect op, whose arguments are Python numbers, a profile string or "
                "None. Pass a Python number (int(...), float(...)).")
        context = writer.f_back
        if context is None or context.f_code is not _CONTEXT_CODE:
            self.record(set_op, args)
        elif any(f is context for f in self.contexts):
            self.contexts = [f for f in self.contexts if f is not context]
            self.record(exit_op, ())
        else:
            self.contexts.append(context)
            self.record(enter_op, args)

    def _warn_if_get(self, frame: types.FrameType | None) -> None:
        for _ in range(4):  # get_printoptions > dataclasses.asdict > _asdict_inner > this read
            if frame is None:
                return
            if frame.f_code is _GET_CODE:
                caller = frame.f_back
                if caller is None or caller.f_code is not _CONTEXT_CODE:  # the context's own read is exact
                    warn_unfaithful("torch.get_printoptions() in captured code returns the options of the "
                                    "capture, baked into the program; eager reads those of each call. Read "
                                    "them outside the captured function, or use printoptions(...)", caller)
                return
            frame = frame.f_back


# -- the swap of PRINT_OPTS' class ------------------------------------------------------------------------
_ORIGINAL_CLASS = type(PRINT_OPTS)
_current: Callable[[], Any] = lambda: None  # noqa: E731  (shadow_through's)


def _shadow() -> Shadow | None:
    return getattr(_current(), "options", None)


class _Shadowed(_ORIGINAL_CLASS):  # type: ignore[misc, valid-type]
    """``PRINT_OPTS`` while a capture runs: the capturing thread reads and writes its shadow."""

    def __getattribute__(self, name: str) -> Any:
        if name in FIELDS:
            shadow = _shadow()
            if shadow is not None:
                return shadow.read(name)
        return object.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        shadow = _shadow() if name in FIELDS else None
        if shadow is None:
            return object.__setattr__(self, name, value)
        shadow.write(name, value, sys._getframe(1))


_Shadowed.__name__ = _Shadowed.__qualname__ = _ORIGINAL_CLASS.__name__  # its repr stays torch's


def shadow_through(current: Callable[[], Any]) -> None:
    """``current()`` is the capturing thread's capture (its ``options``: a :class:`Shadow`), None on other
    threads (``python_print``'s)."""
    global _current
    _current = current


interpose(PRINT_OPTS, "__class__", _Shadowed, per_thread=False)  # (its methods choose per thread)
