"""Tensor hooks captured code registers on its inputs: registered on the caller's tensors at every call.

Eager code that calls ``x.register_hook(fn)`` or ``w.register_post_accumulate_grad_hook(fn)`` on an
argument (or on a parameter it reads) registers ``fn`` on the caller's tensor, once per call: the hooks
pile up, and each runs when a later backward reaches that tensor.  During a capture the code holds a
fake standing for the tensor, so a hook registered there would act on the fake only: run while the capture
derives the backward (baking ``g * 2`` into the backward graph, or making a Python write at capture
only), and never on the caller's tensor.

While a capture runs, :func:`recording_hooks` notes each such registration on the capturing thread (an
interposer, ``effectfx.interposers.interpose``); after the code ran, those on tensors that stand for
graph inputs are taken off the fakes -- the capture's backward is the code's without them -- and the
program registers each on the input it names after every run (``Program.input_hooks``), where eager
would have.  A hook the code removed again (``handle.remove()``) is not registered.  A backward the code
runs itself (a training step) still sees the hooks it registered before, as the capture traces it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import CaptureError
from ..threads import ThreadStack
from .interpose import interpose

HOOK_METHODS = ("register_hook", "register_post_accumulate_grad_hook")
_RECORDERS = ThreadStack()  # the active recorders of this thread
_LOCAL = threading.local()  # .inside: in a registration


class HookRecorder:
    """The hook registrations one capture's code made: ``(tensor, method name, hook, handle)``."""

    def __init__(self) -> None:
        self.made: list[tuple[torch.Tensor, str, Callable[..., Any], Any]] = []

    def take(self, index_of: Callable[[torch.Tensor], int | None], where: str
             ) -> tuple[tuple[int, str, Callable[..., Any]], ...]:
        """``(input index, method, hook)`` per registration still in place on a tensor standing for a graph
        input (``index_of``), each taken off its fake: the program makes it at every run."""
        found = []
        for tensor, name, hook, handle in self.made:
            index = index_of(tensor)
            table = handle.hooks_dict_ref()
            if index is None or table is None or handle.id not in table:
                continue  # an intermediate's hook (traced as autograd runs it), or one removed again
            cells = getattr(hook, "__closure__", None) or ()
            if any(isinstance(getattr(c, "cell_contents", None), FakeTensor) for c in cells):
                raise CaptureError(
                    f"{where} registers {name}({getattr(hook, '__qualname__', hook)!r}) on an input, a hook "
                    "closing over a tensor of the trace: the program registers the hook on the caller's "
                    "tensor at every call, where that tensor does not exist. Read the tensor in the hook "
                    "from where it lives (a module's attribute), or register the hook outside."
                )
            handle.remove()
            found.append((index, name, hook))
        return tuple(found)


@contextlib.contextmanager
def recording_hooks() -> Iterator[HookRecorder]:
    """Note the tensor hooks the code registers on this thread while the block runs."""
    with _RECORDERS.pushed(HookRecorder()) as recorder:
        yield recorder


def _replacement(name: str) -> Callable[..., Any]:
    def register(self: torch.Tensor, hook: Callable[..., Any]) -> Any:
        stack = _RECORDERS.items
        original = _INTERPOSERS[name].original
        if not stack or getattr(_LOCAL, "inside", False):  # (torch-function modes call it again)
            return original(self, hook)
        _LOCAL.inside = True
        try:
            handle = original(self, hook)
        finally:
            _LOCAL.inside = False
        stack[-1].made.append((self, name, hook, handle))
        return handle

    register.__name__ = name
    return register


_INTERPOSERS = {name: interpose(torch.Tensor, name, _replacement(name)) for name in HOOK_METHODS}

