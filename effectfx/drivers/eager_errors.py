"""A compiled call whose capture fails with the user's error raises it as eager does, after eager's effects.

Note [Errors are eager's]
~~~~~~~~~~~~~~~~~~~~~~~~~
An error the user's code makes -- a ``.view(-1)`` of a tensor that is not contiguous, shapes that cannot
be multiplied, an index out of range -- is found while capturing, by the op's fake kernel or by Python
itself.  Eager PyTorch raises it too, so effectfx raises it as eager does:

* Of eager's class.  An op failing on fakes is run once more on real tensors like them (zeros: a shape or
  dtype check fails alike on any values; ``capture.unsupported``); when that fails too, the error is the
  user's, and it is raised as ``errors.op_error`` makes it: an ``OpError`` (a ``CaptureError``) that is
  also an instance of eager's class, with eager's message first, then the op and the user's line.  An op
  that runs on real tensors failed in its fake kernel alone: effectfx's failure, a plain ``CaptureError``.
* After eager's effects.  Eager runs the code before the failing line, effects included (a print, a
  collective, an ``efx.callback``); a capture runs nothing.  So efx.compile then runs the call eagerly
  (:func:`eager_instead`): its effects run as eager's, once, and eager's own error ends the call.  An error
  Python raised during the capture outside effectfx's and torch's tracing machinery (the user's ``raise``,
  ``x[5]`` of a 3-row tensor, ``F.cross_entropy``'s size check) is the user's too, and goes the same way.
  Errors effectfx raises on purpose (a data-dependent branch, an op it cannot capture) run nothing.
* Within a capture (a compiled function called by captured code) nothing runs eagerly: the outer
  compiled call does.

Should the eager run not fail (a capture that failed where eager does not: effectfx's limitation), its
effects have run and cannot be taken back: the call returns eager's result, with an
``EagerFallbackWarning`` naming the capture's error.  An error a *program* raises when it runs (a value
check: an embedding's index out of range) is the kernel's own, eager's class already.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..errors import EagerFallbackWarning, EffectfxError, OpError, op_error
from ..regions.decorator import active_tracer

_EFFECTFX = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_INTERPOSERS = _EFFECTFX + "interposers" + os.sep
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# torch's tracing machinery: an error raised in there is about fakes or symbols, not the user's code
_MACHINERY = tuple(_TORCH + p for p in ("fx" + os.sep, "_subclasses", "_dynamo", "_functorch", "_prims",
                                        "_refs", "_decomp", "_meta_registrations", "_higher_order_ops",
                                        "_library", "_guards", "utils" + os.sep + "_python_dispatch"))


def _raised_by_user_code(error: BaseException) -> bool:
    """Whether ``error`` is not effectfx's and was raised outside effectfx and torch's tracing machinery
    (an interposer passing a call on is neither): Python running the user's code raised it, as it will in
    eager."""
    if isinstance(error, EffectfxError):
        return False
    files = []
    tb = error.__traceback__
    while tb is not None:
        files.append(os.path.abspath(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    where = next((f for f in reversed(files) if not f.startswith(_INTERPOSERS)), _EFFECTFX)
    return not where.startswith(_EFFECTFX) and not where.startswith(_MACHINERY)


def eager_instead(fn: Callable[..., Any], args: tuple, kwargs: dict, error: Exception, name: str) -> Any:
    """After ``error`` ended the capture of a compiled call ``fn(*args, **kwargs)``: raise it, or, when it
    is the user's error, run the call eagerly and raise eager's (Note [Errors are eager's])."""
    if not (isinstance(error, OpError) or _raised_by_user_code(error)) or active_tracer() is not None:
        raise error
    try:
        result = fn(*args, **kwargs)
    except Exception as eager:
        if isinstance(error, OpError) and isinstance(eager, error.eager_class):
            raise op_error(type(eager), str(eager), error.where) from eager
        raise  # eager's own error, raised where eager raised it
    warnings.warn(EagerFallbackWarning(
        f"efx.compile'd {name!r} could not be captured ({type(error).__name__}: {error}), and the call ran "
        "eagerly without error: this call's result is eager's (Note [Errors are eager's])."), stacklevel=3)
    return result
