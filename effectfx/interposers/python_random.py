"""Python's ``random`` module in captured code: a draw from its global generator is refused, naming the line
(Note [Callbacks] says why it is not drawn per call instead).

Capture runs the code once; a draw there (``random.random()``, ``random.uniform(a, b)``, ``random.choice``,
``random.shuffle``...) would be baked into the program, the same number on every call, where eager draws a
new one each time.  Every function of the module draws through its hidden ``random.Random`` instance's
``random`` or ``getrandbits``: those two are interposed on ``random.Random`` (for the module's functions
written in Python, which call them through the instance) and on the module itself (``random.random`` and
``random.getrandbits`` are the instance's methods, bound in C).  Seeding it in captured code is refused
too: a program would not seed it again at each call.  A ``random.Random`` of the code's own
(seeded by it, so the same numbers at each call) draws as it likes; torch's own code and effectfx's are
left alone.
"""

from __future__ import annotations

import linecache
import os
import random
import sys
import types
from typing import Any

import torch

from ..errors import UnsupportedOperatorError
from ..regions.decorator import active_tracer
from .interpose import interpose

_GLOBAL = random._inst  # the generator behind the module's functions
_RANDOM_FILE = random.__file__
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep


def _caller() -> types.FrameType | None:
    """The frame that called into the random module: past the interposer's and the module's own."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == _RANDOM_FILE
                                 or frame.f_code.co_filename.startswith(_OURS)):
        frame = frame.f_back
    return frame


def _check(what: str) -> None:
    """Refuse ``what`` when the captured code does it (torch's bookkeeping, and any call between graphs,
    keeps the module as it is)."""
    tracer = active_tracer()
    frame = _caller()
    if not tracer.builders or frame is None or frame.f_code.co_filename.startswith(_TORCH):
        return
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    code = linecache.getline(filename, lineno).strip()
    raise UnsupportedOperatorError(
        f"{tracer.where()} {what} Python's random module at {filename}:{lineno} (in {frame.f_code.co_name}): "
        f"{code}\nA compiled program would bake in what it did during capture and repeat it on every call, "
        "where eager draws anew (Note [Callbacks]). Draw with torch (torch.rand, torch.randint: effectfx "
        "keeps torch's generator as eager does), draw outside the compiled function and pass the value in as "
        "a tensor, or return the draw as a tensor from efx.callback(..., result_shape=efx.TensorSpec(()))."
    )


def _drawing(name: str) -> None:
    method = getattr(random.Random, name)

    def draw(self: random.Random, *args: Any) -> Any:
        if self is _GLOBAL:
            _check("draws from the global generator of")
        return method(self, *args)

    def draw_global(*args: Any) -> Any:
        _check("draws from the global generator of")
        return method(_GLOBAL, *args)

    interpose(random.Random, name, draw)
    interpose(random, name, draw_global)


def _setting(name: str) -> None:
    original = getattr(random, name)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        _check(f"seeds the global generator (random.{name}) of")
        return original(*args, **kwargs)

    interpose(random, name, refuse)


for _name in ("random", "getrandbits"):
    _drawing(_name)
_setting("seed")  # (not setstate: Dynamo restores the state from C around a torch.compile'd frame)
