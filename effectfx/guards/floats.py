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
A tuple of floats is a tuple of cells, one per element (its path steps ``("index", i)``), and the program
holds "a tuple of that many floats".
An optimizer's hyperparameters are swapped for cells while its ``step`` is traced
(``interposers.training_step``); torch.optim takes a tensor ``lr`` (SGD, Adam, AdamW), not a tensor
``weight_decay`` or ``momentum`` (``!= 0`` in Python), and Adam's tensor ``betas`` become Python scalars
(``.item()``: the weight of ``_foreach_lerp_``, the value of ``addcmul_``), so those stay values.  Under
``dynamic=True`` the ``lr`` (:data:`TENSOR_HYPERPARAMETERS`) is an input from the first capture, as sizes
are; other floats wait for a change, as a failed capture costs a capture more.  Integers and bools always
specialize; a float read inside a region body, or held in the compiled function's closure or globals (its
signature), too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .kinds import Absent, Equals, Guard, OfType
from .values import Path

_LOCAL = threading.local()
TENSOR_HYPERPARAMETERS = frozenset({"lr"})  # what torch.optim's SGD, Adam and AdamW take as tensors
T = TypeVar("T")


class FloatInputs:
    """The paths one capture reads as inputs, and the cell it handed out for each float read there."""

    def __init__(self, paths: frozenset[Path], hyperparameters: frozenset[str] = frozenset(),
                 specialized: frozenset[Path] = frozenset()) -> None:
        self.paths = paths
        # the optimizer hyperparameters read as inputs at every path, changed or not (``dynamic=True``),
        # but for those found ``specialized``
        self.hyperparameters, self.specialized = hyperparameters, specialized
        self.read: list[Path] = []  # the paths handed out as cells, in order
        self.cells: dict[Path, torch.Tensor] = {}  # a float's path, or a tuple's element's: its cell
        self.names: dict[Path, str] = {}  # what efx.explain calls a path, where its reader knows better

    def wants(self, path: Path, hyperparameter: str = "") -> bool:
        return path in self.paths or (hyperparameter in self.hyperparameters and path not in self.specialized)

    def cell(self, path: Path, value: Any, name: str = "", hyperparameter: str = ""
             ) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
        """What stands for ``value`` read at ``path``: a tensor for a float, a tuple of them for a tuple of
        floats (a scale and a shift); None if it is no input."""
        if not floats_or_tuple(value) or not self.wants(path, hyperparameter):
            return None
        if name:
            self.names[path] = name
        if path not in self.read:
            self.read.append(path)
        if type(value) is tuple:
            return tuple(self._cell((*path, ("index", i)), v) for i, v in enumerate(value))
        return self._cell(path, value)

    def _cell(self, path: Path, value: float) -> torch.Tensor:
        found = self.cells.get(path)
        if found is None:
            with _disable_current_modes():  # a real tensor read from state, not a literal of the trace
                found = self.cells[path] = torch.tensor(value, dtype=torch.get_default_dtype())
        return found

    def guards(self, path: Path, value: Any) -> list[Guard]:
        """What a program whose cells stand for ``value`` holds of the path: a float, or a tuple of as many
        floats."""
        if type(value) is not tuple:
            return [OfType(path, float)]
        return [OfType(path, tuple), *(OfType((*path, ("index", i)), float) for i in range(len(value))),
                Absent((*path, ("index", len(value))))]


def floats_or_tuple(value: Any) -> bool:
    """A float, or a non-empty tuple of floats: what can be an input."""
    return type(value) is float or (
        type(value) is tuple and bool(value) and all(type(v) is float for v in value))


def active_floats() -> FloatInputs | None:
    """The float inputs of the capture running on this thread, if it has any."""
    return getattr(_LOCAL, "floats", None)


@contextmanager
def float_inputs(inputs: FloatInputs) -> Iterator[FloatInputs]:
    """While a capture runs: reads of ``inputs``' paths hand out cells (none: nothing changes)."""
    before = getattr(_LOCAL, "floats", None)
    _LOCAL.floats = inputs if inputs.paths or inputs.hyperparameters else None
    try:
        yield inputs
    finally:
        _LOCAL.floats = before


def changed_floats(failed: Sequence[tuple[Guard, Any]]) -> list[Path]:
    """The paths of failed guards that held a float (or a tuple of floats) and find another of its kind:
    hyperparameters that change."""
    return list(dict.fromkeys(g.path for g, found in failed if isinstance(g, Equals)
                              and floats_or_tuple(found) and _count(_held(g)) == _count(found)))


def _held(guard: Equals) -> Any:
    """The value an ``Equals`` guard holds, a tuple unfrozen (``values.freeze``)."""
    if guard.cls is tuple and type(guard.value) is tuple and guard.value[:1] == ("tuple",):
        return guard.value[1]  # (a tuple of values not plain)
    return guard.value if guard.cls in (float, tuple) else None


def _count(value: Any) -> int | None:
    return len(value) if floats_or_tuple(value) and type(value) is tuple else (
        0 if type(value) is float else None)


def capture_with_floats(capture: Callable[[FloatInputs], T], good: frozenset[Path], new: Sequence[Path],
                        specialized: set[Path], hyperparameters: frozenset[str] = frozenset()) -> T:
    """``capture(inputs)`` with the paths earlier captures took as inputs (``good``), the floats that changed
    since (``new``) and, under ``dynamic=True``, the optimizer ``hyperparameters`` torch.optim takes as
    tensors, changed or not.  A capture fails where code needs a float itself (``if momentum != 0``): then
    the capture runs without the new floats, and only if that succeeds were they to blame -- each is then
    tried alone, and one that fails is ``specialized`` from now on, its value guarded as before, so a float
    the code cannot take as a tensor costs captures once, not at every call.  If the capture fails without
    them too, the error is the code's own: it is raised, and no float is blamed."""
    def attempt(paths: frozenset[Path], names: frozenset[str] = frozenset()) -> T:
        return capture(FloatInputs(paths, names, frozenset(specialized)))

    tried = FloatInputs(good | frozenset(new), hyperparameters, frozenset(specialized))
    if not new and not hyperparameters:
        return capture(tried)
    try:
        return capture(tried)
    except Exception:  # noqa: BLE001 -- whether a float was to blame is found below
        suspects = list(dict.fromkeys([*new, *(p for p in tried.read if p not in good)]))
    found, kept = attempt(good), good  # (raises the code's own error: then no float is blamed)
    if len(suspects) == 1:
        specialized.add(suspects[0])
        return found
    for path in suspects:
        try:
            found, kept = attempt(kept | {path}), kept | {path}
        except Exception:  # noqa: BLE001
            specialized.add(path)
    return found


def current(value: Any) -> torch.Tensor:
    """The tensor a call passes for a float input: its value now (a fresh one: a training program may have
    saved the last one for its backward)."""
    return torch.tensor(value, dtype=torch.get_default_dtype())
