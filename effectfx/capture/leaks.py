"""The Python state a user can reach after a capture, and the check that no fake tensor of the capture is
left in it (Note [Python state], ``capture.python_state``; in the spirit of JAX's ``checking_leaks``).

:func:`reachable` walks what the captured code could have written and its caller can see: the modules it
is handed or reaches (every submodule: its ``__dict__``, parameters, buffers and submodules, and the
closures and globals of its hooks), the other objects among its arguments, the values its closure cells
and named globals hold, and from each of those lists, dicts and plain objects up to two levels deep.  The
journal of a trace snapshots what it yields; :func:`check_leaks` scans it after the capture.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import FakeTensorLeakError
from ..graph.source import in_library
from ..guards.hooks import HOOK_DICTS, global_tables
from ..guards.identity import code_reads
from ..guards.values import Path, watchable

DEPTH = 2  # how far from a module, an argument or a closure's value into lists, dicts and plain objects
# nn.Module's bookkeeping in its ``__dict__``; its tables of tensors and submodules are walked themselves
MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training"}
MODULE_TABLES = ("_parameters", "_buffers", "_modules")
# state the capture owns elsewhere (an optimizer's: Note [Training step]) or that is not the model's
_OWNED = (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, logging.Logger, logging.Handler)


class Found:
    """One mutable container of user-visible state: a ``list``, a ``dict``, or the attribute table
    (``slot``: ``"__dict__"``, ``"_parameters"``, ``"_buffers"``, ``"_modules"``) of ``holder``."""

    __slots__ = ("kind", "container", "holder", "slot", "what", "path")

    def __init__(self, kind: str, container: Any, holder: Any, slot: str, what: Any,
                 path: Path | None) -> None:
        self.kind = kind  # "attrs", "dict" or "list"
        self.container = container
        self.holder = holder  # the object whose attributes the table holds ("attrs")
        self.slot = slot
        self.what = what  # how messages name it (``name_of``): "Model.blocks.0", "acts"
        self.path = path  # where it is from a region body's arguments (None: by identity)


def name_of(what: Any) -> str:
    """A name :func:`reachable` made: ``(parent, separator, key)`` chains, joined when asked for."""
    parts = []
    while isinstance(what, tuple):
        what, sep, key = what
        parts.append(f"{sep}{key}" if sep != "[" else f"[{key!r}]")
    return str(what) + "".join(reversed(parts))


# values no walk goes into: skipped before the (costlier) test of :func:`_walkable`
_LEAVES = (torch.Tensor, bool, int, float, str, type(None), torch.dtype, torch.device)


def _walkable(value: Any) -> bool:
    return isinstance(value, (list, dict, torch.nn.Module)) or (watchable(value) and not isinstance(
        value, _OWNED))


def reachable(roots: Iterable[tuple[Any, str, Path | None]], owned: bool = False,
              seen: set[int] | None = None) -> Iterator[Found]:
    """Each container reachable from ``roots`` (``(object, name, path)``), once; ``owned``: also into
    optimizers (their ``state``), which a trace's journal leaves to the training step; ``seen``: ids of
    objects not to walk again (and the walk's own).  (On every capture: kept lean.)"""
    seen = set() if seen is None else seen
    stack: list[tuple[Any, Any, Path | None, int]] = [(obj, what, path, 0) for obj, what, path in roots]
    stack.reverse()
    module, internals, leaves = torch.nn.Module, MODULE_INTERNALS, _LEAVES
    while stack:
        obj, what, path, depth = stack.pop()
        # (a plain value -- a label a body's hook holds among them: looking at it would use it)
        if isinstance(obj, leaves) or id(obj) in seen or not (
                _walkable(obj) or owned and isinstance(obj, torch.optim.Optimizer)):
            continue
        seen.add(id(obj))
        nested: list[tuple[Any, Any, Path | None, int]] = []
        deeper = depth < DEPTH
        if isinstance(obj, module):
            d = vars(obj)
            yield Found("attrs", d, obj, "__dict__", what, None if path is None else (*path, "__dict__"))
            for slot in MODULE_TABLES:
                table = d.get(slot)
                if isinstance(table, dict):
                    yield Found("attrs", table, obj, slot, what, None if path is None else (*path, slot))
            for name, sub in (d.get("_modules") or {}).items():
                if sub is not None:  # (a submodule is not a level deeper)
                    nested.append((sub, (what, ".", name), None if path is None else (*path, name), depth))
            if deeper:
                nested += [(v, (what, ".", k), None if path is None else (*path, k), depth + 1)
                           for k, v in d.items() if k not in internals and not isinstance(v, leaves)
                           and _walkable(v)]
                if d.get("_forward_hooks") or d.get("_forward_pre_hooks") or d.get("_backward_hooks") or \
                        d.get("_backward_pre_hooks"):
                    nested += [(v, k, None, depth + 1) for table in HOOK_DICTS
                               for hook in (d.get(table) or {}).values()
                               for k, v in _code_values(hook, f"a hook of {name_of(what)}")]
        elif isinstance(obj, list):
            yield Found("list", obj, None, "", what, path)
            if deeper:
                nested += [(v, (what, "[", i), None, depth + 1) for i, v in enumerate(obj)
                           if not isinstance(v, leaves) and _walkable(v)]
        elif isinstance(obj, dict):
            yield Found("dict", obj, None, "", what, path)
            if deeper:
                nested += [(v, (what, "[", k), None if path is None or not isinstance(k, str) else
                            (*path, ("item", k)), depth + 1) for k, v in obj.items()
                           if not isinstance(v, leaves) and _walkable(v)]
        else:
            d = vars(obj)
            yield Found("attrs", d, obj, "__dict__", what, None if path is None else (*path, "__dict__"))
            if deeper:
                nested += [(v, (what, ".", k), None if path is None else (*path, k), depth + 1)
                           for k, v in d.items() if not isinstance(v, leaves) and _walkable(v)]
        stack.extend(reversed(nested))


def _code_values(fn: Any, what: str) -> Iterator[tuple[str, Any]]:
    """What a function (a hook, the captured one) holds, named: the values of its closure cells, the
    globals its code names (of the user's code only: a library's module state is not the model's), the
    object of a bound method."""
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType):
        yield f"the object of {what}", owner
    func = getattr(fn, "__func__", fn)
    code = getattr(func, "__code__", None)
    if code is None:
        return
    for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
        try:
            yield f"{name} (closed over by {what})", cell.cell_contents
        except ValueError:  # an empty cell
            continue
    if not in_library(func):
        for _, step, value in code_reads(func):
            if not isinstance(step, str):
                yield f"global {step[1]}", value


def code_roots(fn: Any, what: str) -> list[tuple[Any, str, Path | None]]:
    """The values ``fn``'s closure cells and named globals hold, as roots of :func:`reachable`."""
    return [(v, k, None) for k, v in _code_values(fn, what)]


def global_hook_roots() -> list[tuple[Any, str, Path | None]]:
    """What torch's global module hooks hold."""
    return [(v, k, None) for table in global_tables() for hook in table.values()
            for k, v in _code_values(hook, "a global module hook")]


def check_leaks(found: Iterable[Found]) -> None:
    """Refuse a capture after which a fake tensor is still in one of the containers ``found`` (what
    :func:`reachable` yields: the user can reach them), or is the ``.grad`` of a parameter there: a later
    eager call would compute on it and quietly return more fakes (Note [Python state])."""
    for f in found:
        container = f.container
        values = container if f.kind == "list" else container.values()
        kinds = set(map(type, values))  # (in C: every container of the model, at every capture)
        if FakeTensor in kinds or tuple in kinds:
            for value in values:
                if isinstance(value, FakeTensor) or type(value) is tuple and any(
                        isinstance(v, FakeTensor) for v in value):
                    _leaked(f, value)
        if f.slot == "_parameters":
            for p in container.values():
                if p is not None and isinstance(p.grad, FakeTensor):
                    _leaked(f, p, grad=True)


def _leaked(found: Found, value: Any, grad: bool = False) -> None:
    items = enumerate(found.container) if found.kind == "list" else found.container.items()
    key = next(k for k, v in items if v is value)
    what = name_of(found.what)
    where = (f"the .grad of {what}.{key}" if grad else f"{what}.{key}" if found.kind == "attrs" and
             found.slot == "__dict__" else f"{what}.{found.slot}[{key!r}]" if found.kind == "attrs" else
             f"{what}[{key!r}]")
    fake = value.grad if grad else value
    fake = next(v for v in fake if isinstance(v, FakeTensor)) if isinstance(fake, tuple) else fake
    raise FakeTensorLeakError(
        f"after the capture, {where} holds a fake tensor of the trace ({fake.dtype} {list(fake.shape)}): "
        "the captured code stored it where effectfx does not write Python state back (Note [Python state]: "
        f"attributes of modules and objects, lists and dicts, within {DEPTH} levels of the model, its "
        "arguments, closures and globals).\nStore the tensor nearer (an attribute of the module, a list it "
        "holds), or return it and store it outside the compiled code. The object still holds the fake: set "
        "it again before eager code reads it."
    )
