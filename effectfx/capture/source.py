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


def user_location(exc: BaseException | None = None) -> str:
    """``file:line (function): code`` of the innermost frame outside torch and effectfx: of the current
    stack, or of where ``exc`` was raised."""
    frames = traceback.extract_tb(exc.__traceback__) if exc is not None else traceback.extract_stack()
    for frame in reversed(frames):
        if frame.filename.startswith(_SKIP) or "/contextlib.py" in frame.filename:
            continue
        code = (frame.line or "").strip()
        return f"{frame.filename}:{frame.lineno} (in {frame.name}): {code}"
    return "<unknown location>"


def definition(fn: object) -> str:
    """``file:line`` where a function is defined, or its repr."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)


def return_lines(fn: object) -> str:
    """``file:line`` of every ``return`` statement of ``fn`` (the one that ran is among them)."""
    import ast
    import inspect
    import textwrap

    try:
        lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
        tree = ast.parse(textwrap.dedent("".join(lines)))
        filename = inspect.getsourcefile(fn)  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return definition(fn)
    found = [f"{filename}:{first + n.lineno - 1}" for n in ast.walk(tree) if isinstance(n, ast.Return)]
    return ", ".join(found) or definition(fn)
