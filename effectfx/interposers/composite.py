"""Effect ops whose kernel is CompositeImplicitAutograd stay one node (Note [Effect tokens]).

Such an op (``lib.impl("log", fn, "CompositeImplicitAutograd")``, or ``aten::absolute_``) is *decomposed*
by the dispatcher at the Autograd key, which sits above the Python key where :class:`Tracer` listens: the
tracer would only ever see the op's pieces, and the effect would run once, at capture, and never again.

Why a torch-function mode.  torch's own tracers keep CIA ops through the Python dispatcher (export's
``_override_composite_implicit_decomp`` puts a ``py_impl`` on the CIA key; ``make_fx(pre_dispatch=True)``
listens at the PreDispatch key).  Enabling the Python dispatcher for a whole capture routes *every* op
through Python (10-15% slower captures, measured here) and switches on torch's Python decompositions
(``dropout``, ``native_batch_norm``, the upsamplers have ``py_impl`` kernels), so graphs and RNG use would
change for programs that have no such op at all.  A :class:`~torch.overrides.TorchFunctionMode` sees the
user's call -- ``torch.ops.demo.log(x, "a")``, ``y.absolute_()``, ``torch.absolute(y)`` -- before any
dispatch key, costs a dict lookup per call, and changes nothing else; it stays active inside Python-level
torch functions (``F.*``) and inside the CIA kernels of other custom ops, so calls made there are seen
too.  What it cannot see is a CIA effect op called from C++ (inside an aten op's composite kernel);
SUPPORT.md says so.

What happens to a call of such an op:

1. the op's kernel runs on the fake arguments (``op.decompose``), as torch.compile traces CIA kernels:
   that is the only way to learn its results (torch refuses a fake implementation for CIA ops).  The ops
   it calls are not recorded: effects (nested effect ops, Python ``print``) are part of the one node and
   run when it runs.  Under autograd (an argument requires grad) its pure ops *are* recorded, forward
   phase: they are the op's backward, which eager autograd also derives from the decomposition; the
   partitioner keeps the ones the backward reads and dead-code elimination drops the rest;
2. the op itself is recorded once, with the kernel's results as its outputs: the call is replayed below
   autograd, so the tracer sees it undecomposed and resolves labels and effect keys as for any op.

At run time the node calls the op, which runs its kernel with run-time values, exactly as eager.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..effects import effect_of
from ..errors import (
    CaptureError,
    CaptureSideEffectWarning,
    DataDependentControlFlowError,
    EffectfxError,
    UnsupportedMutationError,
    UnsupportedOperatorError,
)
from ..graph.source import user_frame, user_location
from ..guards.labels import Label, raw
from ..program.containers import map_structure
from .kernel_effects import frame_effect, kernel_frames
from .python_print import silenced

_has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
_BUILTINS = (types.BuiltinFunctionType, types.MethodDescriptorType)
# torch function or Tensor method -> the aten packet of that name if one of its overloads has a CIA kernel
_ATEN_CANDIDATES: dict[Any, torch._ops.OpOverloadPacket | None] = {}
_DEFAULT = torch.Tensor.__torch_function__.__func__  # type: ignore[attr-defined]


def _aten_candidate(func: Any) -> torch._ops.OpOverloadPacket | None:
    found = _ATEN_CANDIDATES.get(func, False)
    if found is False:
        name = getattr(func, "__name__", "")
        packet = getattr(torch.ops.aten, name, None) if name and not name.startswith("__") else None
        if not isinstance(packet, torch._ops.OpOverloadPacket) or not any(
                _has_cia(f"aten::{name}" + (f".{o}" if o != "default" else "")) for o in packet.overloads()):
            packet = None
        found = _ATEN_CANDIDATES[func] = packet
    return found


def _has_cia(name: str) -> bool:
    try:
        return _has_kernel(name, "CompositeImplicitAutograd")
    except RuntimeError:  # a TorchScript builtin overload (aten::add.t): not a dispatcher op
        return False


def _overload(func: Any, args: tuple, kwargs: dict) -> torch._ops.OpOverload | None:
    """The operator overload a torch-level call will dispatch, or None when it is not an op call."""
    if isinstance(func, torch._ops.OpOverload):
        return func
    if isinstance(func, torch._ops.OpOverloadPacket):
        packet = func
    elif isinstance(func, _BUILTINS):
        packet = _aten_candidate(func)
        # only an effect matters for a Tensor method or torch function (an aten op runs no Python of its
        # own): skip resolving the overload, the costly part, for the many calls (stride, size) of none
        if packet is None or not any(effect_of(getattr(packet, o)) is not None for o in packet.overloads()):
            return None
    else:
        return None
    try:
        name = torch._C._jit_resolve_packet(packet._qualified_op_name, *args, **kwargs)
    except Exception:  # no overload matches: the call fails in eager as well, let it
        return None
    return getattr(packet, name or "default", None)


def _runs_python(func: Any, op: torch._ops.OpOverload | None) -> bool:
    """Whether calling ``func`` runs the user's (or torch's Python-level) code before any dispatch: a Python
    function, or a custom op's CIA kernel.  Builtins and aten ops go straight to the dispatcher, whose
    Python (fake kernels, the tracer) must not see this mode."""
    if op is not None:
        return op.namespace != "aten" and decomposes(op)
    # (not torch.Tensor's own Python methods, ``unflatten``: their C half asks for the same function again,
    # so staying active would redispatch it forever; they call no effect op)
    return isinstance(func, types.FunctionType) and func.__module__ != "torch._tensor"


def _plain(cls: type) -> bool:
    handler = getattr(cls, "__torch_function__", None)
    return handler is torch._C._disabled_torch_function_impl or getattr(handler, "__func__", None) is _DEFAULT


def _device_type(leaves: list[Any]) -> str:
    return next((t.device.type for t in leaves if isinstance(t, torch.Tensor)), "cpu")


def decomposes(op: torch._ops.OpOverload, device_type: str = "cpu") -> bool:
    """Whether eager autograd runs ``op``'s CompositeImplicitAutograd kernel on ``device_type`` (there is no
    kernel of its own for the device or its autograd key), so that no dispatch mode ever sees the op."""
    name = op.name()
    if not _has_kernel(name, "CompositeImplicitAutograd"):
        return False
    backend = torch._C._dispatch_key_for_device(device_type)
    return not (_has_kernel(name, backend) or _has_kernel(name, "Autograd" + backend))


class CompositeEffects(TorchFunctionMode):
    """The tracer's torch-function half: calls of effect ops with a CIA kernel become one node (module
    docstring).  ``kernels`` is a stack with one entry per kernel running on fakes (True when its pure ops
    are recorded for the backward); ``pending`` holds the kernel's results until the op is recorded."""

    def __init__(self, tracer: Any) -> None:  # the Tracer whose torch-function half this is
        super().__init__()
        self.tracer = tracer
        self.kernels: list[tuple[torch._ops.OpOverload, bool, str]] = []
        self.pending: tuple[Any] | None = None
        self.calls = 0  # torch-level calls seen so far: the tracer tells C++'s own detach from the user's
        # Python side effects of kernels (kernel_effects): what each kernel code does, per op the first found
        self._examined: dict[types.CodeType, str | None] = {}
        self._side_effects: dict[torch._ops.OpOverload, tuple[str, types.CodeType]] = {}
        self._warned: set[torch._ops.OpOverload] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tracer = self.tracer
        self.calls += 1
        if self.kernels or not (tracer.recording and tracer.builders):
            return func(*args, **kwargs)
        op = _overload(func, args, kwargs)
        if op is not None and effect_of(op) is not None and decomposes(
                op, _device_type(tree_flatten((args, kwargs))[0])):
            return self._call(op, args, kwargs)
        if _runs_python(func, op) and torch._C._len_torch_function_stack() == 0 and all(map(_plain, types)):
            # stay active while ``func`` runs, so that an effect op called inside it -- by a Python-level
            # torch function (F.*) or by the CIA kernel of another custom op -- is seen too.  Skipping this
            # one hop of __torch_function__ skips nothing else: no mode is below this one and no argument is
            # a tensor subclass with its own handler
            with self:
                return torch.overrides.redispatch_function(func, types, args, kwargs)
        return func(*args, **kwargs)

    # -- one call ---------------------------------------------------------------------------------------
    def _call(self, op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
        tracer = self.tracer
        # a label that reaches this mode unswapped is baked in (and the body keyed on it): safe, if narrower
        args, kwargs = _bake_labels((args, kwargs))
        where = user_location()
        if op._schema.is_mutable:
            arg = next((a.name for a in op._schema.arguments if a.alias_info and a.alias_info.is_write), "?")
            raise UnsupportedMutationError(
                f"{tracer.where()} contains an effectful op that mutates its arguments ({op}, argument "
                f"{arg!r}) at {where}.\neffectfx keeps an effect as one node and cannot write its changes "
                "back. Use the out-of-place op (y = y.abs() instead of y.absolute_()), or do not register "
                "the in-place op as an effect."
            )
        leaves = [tracer.to_fake(t) for t in tree_flatten((args, kwargs))[0]]
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in leaves if isinstance(t, torch.Tensor))
        run_args, run_kwargs = map_structure(self._run_value, (args, kwargs))
        with self._kernel(op, grad, where):
            try:
                out = op.decompose(*run_args, **run_kwargs)
            except DataDependentControlFlowError as exc:
                why = str(exc).splitlines()[0]
                raise DataDependentControlFlowError(_cannot_run(op, where, why)) from None
            except EffectfxError:
                raise
            except Exception as exc:
                raise CaptureError(_cannot_run(op, where, f"{type(exc).__name__}: {exc}")) from None
        _refuse_aliases(op, where, leaves, out)
        self._warn_side_effects(op, where)
        # record the op as one node whose outputs are the kernel's: the call is replayed below autograd,
        # where no CIA kernel is registered, so the tracer's dispatch sees the op itself
        self.pending = (out,)
        try:
            with torch._C._AutoDispatchBelowADInplaceOrView():
                return op(*args, **kwargs)
        finally:
            self.pending = None

    def _run_value(self, value: Any) -> Any:
        """What the kernel runs on: a label's value for its sentinel, fakes for real tensors."""
        if isinstance(value, str):
            label = self.tracer.label_mode.sentinels.get(value)
            return raw(label) if label is not None else value
        return self.tracer.to_fake(value)

    @contextlib.contextmanager
    def _kernel(self, op: torch._ops.OpOverload, record: bool, where: str) -> Iterator[None]:
        self.kernels.append((op, record, where))
        try:
            with silenced():  # the kernel's prints are the op's: they print when it runs
                yield
        finally:
            self.kernels.pop()

    # -- the tracer's questions ------------------------------------------------------------------------
    def skips(self, func: Any, key: str | None) -> bool:
        """Whether the tracer runs ``func`` (called by a kernel running on fakes) without recording it."""
        op, record, where = self.kernels[-1]
        if op not in self._side_effects:
            self._examine(op)
        if not record:
            return True
        if key is not None:
            if func._schema.returns:
                raise self._no_backward(op, where, f"calls {func}, an effect that returns tensors",
                                        "cannot use that effect's results without performing it twice")
            return True  # part of the one effect node
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            raise self._no_backward(op, where, f"draws random numbers ({func})",
                                    "a second draw would differ from the one the op made")
        return False

    def _examine(self, op: torch._ops.OpOverload) -> None:
        """Look at the Python of ``op``'s kernel the op being dispatched was called from (kernel_effects)."""
        for frame in kernel_frames(sys._getframe(1)):
            code = frame.f_code
            if code not in self._examined:
                self._examined[code] = frame_effect(frame)
            if self._examined[code] is not None:
                self._side_effects[op] = (self._examined[code], code)
                return

    def _warn_side_effects(self, op: torch._ops.OpOverload, where: str) -> None:
        found = self._side_effects.get(op)
        if found is None or op in self._warned:
            return
        self._warned.add(op)
        why, code = found
        frame, _ = user_frame()
        filename, lineno = (frame[0], frame[1]) if frame is not None else ("<unknown>", 0)
        warnings.warn_explicit(
            f"the CompositeImplicitAutograd kernel of the effect {op} (called at {where}) is Python that "
            f"may have side effects of its own: {code.co_name} ({code.co_filename}:{code.co_firstlineno}) "
            f"{why}. effectfx ran it once at capture, on fake tensors, to learn the op's results, and the "
            "program runs it again on every call with real values, as eager does: its ops and prints happen "
            "at run time only, but anything else it does happened once more, at capture. Make such a side "
            "effect an op of its own (torch.library.custom_op, then efx.register_effect) to keep it exact.",
            CaptureSideEffectWarning, filename, lineno)

    def _no_backward(self, op: torch._ops.OpOverload, where: str, what: str, why: str) -> EffectfxError:
        return UnsupportedOperatorError(
            f"{self.tracer.where()} calls {op} at {where} with inputs that require grad; its "
            f"CompositeImplicitAutograd kernel {what}.\neffectfx keeps the op as one effect and derives its "
            f"backward from the kernel's other ops, and {why}. Give the op an autograd formula "
            "(torch.library.custom_op + register_autograd), or call it under torch.no_grad()."
        )

    def take(self) -> Any:
        """The results of the op being recorded: its kernel's (set by :meth:`_call`)."""
        assert self.pending is not None
        return self.pending[0]


def _bake_labels(value: Any) -> Any:
    def bake(v: Any) -> Any:
        if isinstance(v, Label):
            Label.mark_used(v)
            return raw(v)
        return v

    return map_structure(bake, value)


def _cannot_run(op: torch._ops.OpOverload, where: str, why: str) -> str:
    return (
        f"effectfx could not run the CompositeImplicitAutograd kernel of the effect {op} (called at {where}) "
        f"on fake tensors: {why}\nCapture runs such a kernel on fake tensors to learn its results (torch "
        "allows no fake implementation for it). Keep it free of data-dependent Python, or define the op with "
        "torch.library.custom_op and register_fake."
    )


def _refuse_aliases(op: torch._ops.OpOverload, where: str, leaves: list[Any], out: Any) -> None:
    inputs = {StorageWeakRef(t.untyped_storage()) for t in leaves if isinstance(t, torch.Tensor)}
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and StorageWeakRef(t.untyped_storage()) in inputs:
            raise UnsupportedOperatorError(
                f"the effect {op} (called at {where}) returns a tensor that aliases its argument (its "
                "CompositeImplicitAutograd kernel returns an input or a view of one).\neffectfx keeps an "
                "effect as one node with results of its own. Return a new tensor from the kernel (x.clone())."
            )
