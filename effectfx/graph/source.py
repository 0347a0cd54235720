"""Where in the user's code a traced call came from, for error messages."""

from __future__ import annotations

import linecache
import os
import sys
import types
from collections.abc import Iterator

import torch

from ..errors import debug_enabled

_SKIP = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    "<frozen ",
)
# installed libraries (transformers, ...): their decorators and wrappers sit between the user's call and
# the op, so a location prefers the user's own frame and names the library's only as context
_LIBRARY_DIRS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")

Frame = tuple[str, int, str]  # file, line, function


def _internal(filename: str) -> bool:
    return filename.startswith(_SKIP) or filename.endswith(f"{os.sep}contextlib.py")


def _library(filename: str) -> bool:
    return any(d in filename for d in _LIBRARY_DIRS)


def _stack_frames() -> Iterator[Frame]:
    """(file, line, function) of the current stack, innermost first, without reading any source."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        yield frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back


def _tb_frames(exc: BaseException) -> list[Frame]:
    """(file, line, function) of where ``exc`` was raised, innermost first."""
    found = []
    tb = exc.__traceback__
    while tb is not None:
        found.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name))
        tb = tb.tb_next
    return found[::-1]


def user_frame(exc: BaseException | None = None) -> tuple[Frame | None, Frame | None]:
    """``(user, library)``: the innermost frame outside torch, effectfx and installed libraries, and the
    innermost frame outside torch and effectfx when that one is inside a library (else None).  With
    ``exc``: where it was raised; without: the current stack."""
    frames = _tb_frames(exc) if exc is not None else _stack_frames()
    library = None
    for frame in frames:
        if _internal(frame[0]):
            continue
        if not _library(frame[0]):
            return frame, library
        if library is None:
            library = frame
    return library, None  # only library frames: the innermost of them is the best there is


def user_location(exc: BaseException | None = None) -> str:
    """``file:line (function): code`` of the user's innermost frame (outside torch, effectfx and installed
    libraries; ``[inside <library frame>]`` is added when the call went on into one): of the current
    stack, or of where ``exc`` was raised."""
    frame, library = user_frame(exc)
    if frame is None:
        return "<unknown location>"
    filename, lineno, name = frame
    code = linecache.getline(filename, lineno).strip()
    where = f"{filename}:{lineno} (in {name}): {code}"
    if library is not None:
        where += f" [inside {_short(library[0])}:{library[1]} (in {library[2]})]"
    return where


def _short(filename: str) -> str:
    for d in _LIBRARY_DIRS:
        if d in filename:
            return filename.split(d, 1)[1]
    return filename


def in_library(fn: object) -> bool:
    """Whether ``fn`` is defined in an installed library (site-packages), not in the user's code."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return code is not None and _library(code.co_filename)


def trim_traceback(exc: BaseException) -> BaseException:
    """``exc`` with the frames of torch and effectfx dropped from its traceback: its message already
    names the user's line, and dozens of dispatcher frames only hide it.  ``EFFECTFX_DEBUG=1`` keeps
    them all."""
    if debug_enabled() or exc.__traceback__ is None:
        return exc
    kept = []
    tb = exc.__traceback__
    while tb is not None:
        if not _internal(tb.tb_frame.f_code.co_filename):
            kept.append(tb)
        tb = tb.tb_next
    if not kept:
        return exc
    new: types.TracebackType | None = None
    for tb in reversed(kept):
        new = types.TracebackType(new, tb.tb_frame, tb.tb_lasti, tb.tb_lineno)
    return exc.with_traceback(new)


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
