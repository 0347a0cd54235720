"""Where in the user's code a traced call came from, for error messages."""

from __future__ import annotations

import os
import traceback

import torch

_SKIP = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    "<frozen ",
)


def user_location() -> str:
    """``file:line (function): code`` of the innermost frame outside torch and effectfx."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(_SKIP) or "/contextlib.py" in frame.filename:
            continue
        code = (frame.line or "").strip()
        return f"{frame.filename}:{frame.lineno} (in {frame.name}): {code}"
    return "<unknown location>"
