"""Hyperparameters as inputs once they change (Note [Float inputs]).

A Python float a trace reads from state -- an optimizer's ``param_groups[k]["lr"]``, a module's
``temperature`` -- is guarded by value (``kinds.Equals``): a program holds the value of its capture.  A
learning-rate schedule changes it before every step, and each new value would capture a new program.  So,
as sizes under automatic dynamic (Note [Symbolic shapes]), a float whose value guard failed is an *input*
of the next capture: ``efx.compile`` names the failing paths (:func:`changed_floats`), and while that
capture runs (:func:`float_inputs`) a read of one of them hands the trace a 0-dim tensor of the default
dtype (a *cell*) instead of the float: as a Python float does, it keeps a float32 tensor float32, and a
0-dim result too (a float64 one would promote it).  The trace lifts the cell as it lifts any tensor read
from Python state; the program's guard on the path says only "a float" (``kinds.OfType``), and each call
passes a fresh tensor of the value the path holds now (:func:`current`).  A cell is a tensor, not a
float: code that needs the float itself (``if lr > 0``, ``float(lr)``, an op taking a Python scalar)
cannot trace with one; the capture is made again with that float specialized, as before, and it stays so
(:func:`capture_with_floats`).
An optimizer's hyperparameters are swapped for cells while its ``step`` is traced
(``interposers.training_step``); torch.optim takes a tensor ``lr`` (SGD, Adam, AdamW), not a tensor
``weight_decay`` or ``momentum`` (``!= 0`` in Python).  Integers and bools always specialize; a float read
inside a region body, or held in the compiled function's closure or globals (its signature), too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .kinds import Equals, Guard
from .values import Path

_LOCAL = threading.local()
T = TypeVar("T")


class FloatInputs:
    """The paths one capture reads as inputs, and the cell it handed out for each path read."""

    def __init__(self, paths: frozenset[Path]) -> None:
        self.paths = paths
        self.cells: dict[Path, torch.Tensor] = {}
        self.names: dict[Path, str] = {}  # what efx.explain calls a path, where its reader knows better

    def cell(self, path: Path, value: Any, name: str = "") -> torch.Tensor | None:
        """The tensor standing for the float ``value`` read at ``path``, or None if it is no input."""
        if type(value) is not float or path not in self.paths:
            return None
        if name:
            self.names[path] = name
        found = self.cells.get(path)
        if found is None:
            with _disable_current_modes():  # a real tensor read from state, not a literal of the trace
                found = self.cells[path] = torch.tensor(value, dtype=torch.get_default_dtype())
        return found


def active_floats() -> FloatInputs | None:
    """The float inputs of the capture running on this thread, if it has any."""
    return getattr(_LOCAL, "floats", None)


@contextmanager
def float_inputs(paths: frozenset[Path]) -> Iterator[FloatInputs]:
    """While a capture runs: reads of ``paths`` hand out cells (none: nothing changes)."""
    before = getattr(_LOCAL, "floats", None)
    floats = _LOCAL.floats = FloatInputs(paths) if paths else None
    try:
        yield floats if floats is not None else FloatInputs(frozenset())
    finally:
        _LOCAL.floats = before


def changed_floats(failed: Sequence[tuple[Guard, Any]]) -> list[Path]:
    """The paths of failed guards that held a float and find another float: hyperparameters that change."""
    return list(dict.fromkeys(g.path for g, found in failed
                              if isinstance(g, Equals) and g.cls is float and type(found) is float))


def capture_with_floats(capture: Callable[[frozenset[Path]], T], good: frozenset[Path], new: Sequence[Path],
                        specialized: set[Path]) -> T:
    """``capture(paths)`` with the paths earlier captures took as inputs (``good``) and the floats that
    changed since (``new``).  A capture fails where code needs a float itself (``if momentum != 0``): then
    each new path is tried alone, and one that fails is ``specialized`` from now on -- its value guarded,
    as before -- so a float the code cannot take as a tensor costs captures once, not at every call."""
    if not new:
        return capture(good)
    try:
        return capture(good | frozenset(new))
    except Exception:  # noqa: BLE001 -- which float was to blame is found below
        if len(new) == 1:
            specialized.add(new[0])
            return capture(good)
    found, kept = None, good
    for path in new:
        try:
            found, kept = capture(kept | {path}), kept | {path}
        except Exception:  # noqa: BLE001
            specialized.add(path)
    return found if found is not None else capture(good)


def current(value: Any) -> torch.Tensor:
    """The tensor a call passes for a float input: its value now (a fresh one: a training program may have
    saved the last one for its backward)."""
    return torch.tensor(value, dtype=torch.get_default_dtype())
