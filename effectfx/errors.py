"""The exceptions effectfx raises: every one names the region/op, what is wrong and what to do."""

from __future__ import annotations

import os


def debug_enabled() -> bool:
    """``EFFECTFX_DEBUG=1`` (any value but empty or ``0``): errors keep every frame of torch and effectfx in
    their tracebacks, and the pipeline verifies the program after every pass."""
    return os.environ.get("EFFECTFX_DEBUG", "") not in ("", "0")


class EffectfxError(Exception):
    """Base class of every error effectfx raises on purpose."""


class RegistryError(EffectfxError, ValueError):
    """``register_effect`` was given an unknown op or a bad key."""


class CaptureError(EffectfxError):
    """A program could not be captured."""


class OpError(CaptureError):
    """An op raised an error while being captured, one eager PyTorch raises too (a shape check, a view of a
    tensor that is not contiguous): :func:`op_error` makes it an instance of eager's class as well, so
    ``except RuntimeError:`` catches it as it catches eager's (Note [Errors are eager's])."""

    eager_class: type[BaseException] = Exception
    eager_message = ""
    where = ""  # the op, the graph and the user's line

    def __str__(self) -> str:
        return BaseException.__str__(self)  # (not KeyError's quotes, nor OSError's errno)

    def __reduce__(self) -> tuple:
        return op_error, (self.eager_class, self.eager_message, self.where)


_OP_ERRORS: dict[type, type[OpError]] = {}


def op_error(eager: type[BaseException], message: str, where: str) -> OpError:
    """An :class:`OpError` saying eager's ``message``, then ``where`` it was raised, that is also an instance
    of ``eager`` (``CaptureRuntimeError`` for ``RuntimeError``: one class per eager class), or of its nearest
    base that can be both (a class that cannot be subclassed, or made from a message alone)."""
    text = f"{message}\n(effectfx: {where})"
    error = None
    for base in eager.__mro__ if issubclass(eager, Exception) else ():
        cls = _OP_ERRORS.get(base)
        try:
            if cls is None:
                cls = type(f"Capture{base.__name__}", (OpError, base), {"__module__": __name__,
                                                                        "eager_class": base})
            error = cls(text)
        except TypeError:
            continue
        _OP_ERRORS[base] = cls
        break
    error = error or OpError(text)
    error.eager_message, error.where = message, where
    return error


class DataDependentControlFlowError(CaptureError):
    """Python control flow (``if``, ``int()``, ``.item()``) on a tensor's value during capture."""


class MissingFakeImplError(CaptureError):
    """An effectful (or custom) op has no fake implementation, so it cannot be traced without running it."""


class UnsupportedMutationError(CaptureError):
    """An in-place op that effectfx cannot functionalize (input mutation, mutation of an aliased tensor)."""


class UnsupportedReturnError(CaptureError):
    """A captured function or region returned an object effectfx cannot represent in a graph."""


class UnsupportedOperatorError(CaptureError):
    """An operator effectfx cannot capture yet (higher-order ops: ``torch.cond``, ``while_loop``, ...)."""


class UnsupportedParallelWrapperError(CaptureError):
    """A module wrapped by ``DistributedDataParallel`` or ``fully_shard``: its logic lives outside forward."""


class RegionRecursionError(CaptureError):
    """A region called itself while being traced."""


class FreeTensorError(CaptureError):
    """A region read an intermediate tensor of its caller that is not one of its arguments."""


class RegionEffectsChangedError(CaptureError):
    """A region showed a different effect set on a later trace of the same cache key."""


class PythonStateError(CaptureError):
    """Captured code writes Python state a compiled program cannot replay after each call (an object it
    made that holds its tensors, a value that changes on every call, a write in a backward or a branch):
    Note [Python state] (``effectfx.capture.python_state``)."""


class FakeTensorLeakError(CaptureError):
    """A fake tensor of a capture is still reachable from the user's objects after it (Note [Python
    state])."""


class PartialBackwardError(EffectfxError):
    """A loaded training program's backward was asked for some of its outputs only."""


class SignatureMismatchError(EffectfxError, TypeError):
    """A Program was called with inputs that do not match what it was captured for."""


class VerificationError(EffectfxError):
    """A graph broke an invariant of Note [Effect tokens]."""


class BackendError(EffectfxError):
    """A program cannot be handed to the requested backend."""


class SerializationError(EffectfxError):
    """A program cannot be saved in (or loaded from) the effectfx program format."""


class CallbackError(EffectfxError):
    """``efx.callback`` cannot run its function the same way compiled and eager: an argument that is neither a
    tensor nor a plain value, a function closing over a traced tensor, a result unlike ``result_shape``, a
    function a program file or this process cannot find by its name."""


class EffectfxWarning(UserWarning):
    """Base class of every warning effectfx issues: something was captured, but not as eager runs it."""


class UnfaithfulPrintWarning(EffectfxWarning):
    """A Python ``print`` in captured code that cannot print at run time exactly what eager would print."""


class EagerFallbackWarning(EffectfxWarning):
    """A compiled call whose capture failed, run eagerly to raise eager's error, ran without one: its result
    is eager's (Note [Errors are eager's])."""


class CaptureSideEffectWarning(EffectfxWarning):
    """Python code capture had to run on fake tensors (the kernel of a CompositeImplicitAutograd effect op)
    may have side effects of its own: they happened once at capture, and happen again on every call."""
