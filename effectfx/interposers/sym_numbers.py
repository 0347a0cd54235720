"""Symbolic sizes are Python numbers to the user's code: ``isinstance(x.size(0), int)`` holds under symbolic
shapes (Note [Symbolic shapes], "Sizes as ints").

A symbolic size (``torch.SymInt``; ``torch.SymFloat`` and ``torch.SymBool`` for what Python computes from
it) already acts as an ``int`` wherever Python asks for a value: ``int()``, ``range``, ``operator.index``,
``bool`` and comparisons in ``if`` guard it (the ShapeEnv records the fact and the program holds for every
call that satisfies it), and arithmetic, f-strings and ``math`` functions work on it or its guarded value.
What Python cannot ask it is ``isinstance(n, int)``: ``SymInt`` is no subclass of ``int``, so code that
checks its arguments (``assert isinstance(n, int)``, transformers' ``if isinstance(size, int)``) takes
another path than eager.  Dynamo answers ``True`` (its SymNodeVariable's Python type is ``int``) without a
guard: the value stays symbolic.  effectfx runs the real code, so while captures run the three classes
answer ``__class__`` with the Python type (``isinstance`` falls back to ``__class__`` when the type does
not match; a class's ``__class__`` cannot be set, nor its base ``object`` replaced, so it is their
``__getattribute__``) -- to the code being captured only.  torch's own code, effectfx's and the standard
library's keep asking the real class: torch tells sizes from symbols by ``isinstance(s, int)``, and would
take a symbol for a constant.  No guard is added, nothing specializes; ``type(n) is int`` stays False (as
it does not under Dynamo).  ``hash`` and ``divmod`` stay refused, as
torch refuses it (a dict keyed by a size would need the size's value: ``int(n)`` gives it, with a guard).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from typing import Any

import torch

from ..regions.decorator import active_tracer
from .interpose import interpose

_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_INTERNAL = tuple(os.path.realpath(p) + os.sep for p in (
    os.path.dirname(torch.__file__), sysconfig.get_paths()["stdlib"])) + (_OURS,)
_USER_CODE: dict[Any, bool] = {}  # code object -> whether it is the user's (not torch's, ours, stdlib's)


def _asked_by_user(depth: int) -> bool:
    code = sys._getframe(depth + 1).f_code
    user = _USER_CODE.get(code)
    if user is None:
        name = code.co_filename
        user = _USER_CODE[code] = not (os.path.realpath(name) if name.startswith(os.sep) else name
                                       ).startswith(_INTERNAL)
    return user


_get = object.__getattribute__


def _answering(python_type: type) -> Any:
    def getattribute(self: Any, name: str) -> Any:
        # (``isinstance`` looks ``__class__`` up from C: the frame above this one is the code that asked)
        if name == "__class__" and active_tracer() is not None and _asked_by_user(1):
            return python_type
        return _get(self, name)

    return getattribute


for _cls, _type in ((torch.SymInt, int), (torch.SymFloat, float), (torch.SymBool, bool)):
    interpose(_cls, "__getattribute__", _answering(_type), per_thread=False)
