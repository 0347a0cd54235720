"""The key a call is matched by (Note [Region identity]), and what a function's code names: its closure
cells and globals, read like attributes.  The words ``efx.explain`` and ``efx.compile`` use for them are
``effectfx.guards.words``.

A program (a region's body, a compiled signature) is found in two steps.  The *key* (:func:`call_key`) is
what every call shows without running anything: ambient state (grad mode, autocast), the argument
structure, tensor metadata, non-string values and the structure of modules passed in (classes and tensor
metadata, not attributes).  The *guards* are what its trace read (``effectfx.guards.reads``): attributes of
the modules and objects reached from the arguments at any depth, closure cells and named globals.  A call
reuses the first program with its key whose guards hold (``effectfx.guards.check``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..graph.traced import TensorMeta
from .hooks import global_hook_key, has_hooks, hook_key, named_modules, named_values
from .labels import raw
from .values import MISSING, Ref, class_of, freeze, plain_value

AUTOCAST_DEVICES = ("cpu", "cuda")


def ambient() -> tuple:
    """Grad mode, autocast (its dtype, or None) per device type, then whether a profiler is on: state that
    changes every op's meaning, or that code reads to decide what to run
    (``torch.autograd._profiler_enabled()``: a trace under ``torch.profiler.profile()`` may have taken
    another branch)."""
    return (torch.is_grad_enabled(), *[
        (torch.get_autocast_dtype(d) if torch.is_autocast_enabled(d) else None) for d in AUTOCAST_DEVICES],
        torch.autograd._profiler_enabled())


def autocasting() -> bool:
    """Whether autocast is on for any device type (the autocast part of :func:`ambient`)."""
    return any(ambient()[1:1 + len(AUTOCAST_DEVICES)])


class ambient_context:  # noqa: N801  (used like torch.no_grad)
    """Re-enter the grad mode and autocast state of when it was made: a body retraced from a backward
    (Note [Partial backward]) is traced as its forward call was."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in AUTOCAST_DEVICES if d == "cpu" or torch.is_autocast_enabled(d)]

    def __enter__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(torch.set_grad_enabled(self.grad))
        for device, enabled, dtype in self.autocast:
            self.stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


def module_tensors(module: torch.nn.Module, subs: list[tuple[str, torch.nn.Module]] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a module holds, by name: parameters, buffers, and plain tensor attributes (a mask
    stored as ``self.mask = ...``), which differ between instances just as parameters do.  ``subs`` is
    :func:`named_modules` when the caller walked it already."""
    seen: set[int] = set()
    for prefix, sub in named_modules(module) if subs is None else subs:
        state = vars(sub)
        for table in (state["_parameters"], state["_buffers"], state):
            for k, v in table.items():
                if isinstance(v, torch.Tensor) and not k.startswith("_") and id(v) not in seen:
                    seen.add(id(v))
                    yield (f"{prefix}.{k}" if prefix else k), v


class ModuleWalk:
    """One walk of a module a region is called with: its submodules, and its tensors by name (the
    call site's operands).  A call site walks each module once, for its key and its operands."""

    __slots__ = ("subs", "tensors")

    def __init__(self, module: torch.nn.Module) -> None:
        self.subs = named_modules(module)
        self.tensors = dict(module_tensors(module, self.subs))

    def structure(self) -> tuple:
        """A module as a body's key holds it: classes, tensor metadata by name and the hooks of every
        submodule (``guards.hooks``, with torch's global ones); attributes are guards."""
        hooks = tuple((prefix, hook_key(sub, True)) for prefix, sub in self.subs if has_hooks(sub))
        global_hooks = global_hook_key(True)
        return (tuple((prefix, class_of(sub)) for prefix, sub in self.subs),
                tuple((name, TensorMeta.of(t)) for name, t in self.tensors.items()),
                (hooks, global_hooks) if hooks or global_hooks else ())


def leaf_key(value: Any, labels: bool = True, walk: ModuleWalk | None = None) -> Any:
    """How a key holds one argument.  Strings are keyed by type only when ``labels`` (region calls): a
    body decides by its guards whether it uses their value or takes them as operands."""
    if isinstance(value, torch.Tensor):
        return TensorMeta.of(value)
    if isinstance(value, torch.nn.Module):
        return ("module", (walk or ModuleWalk(value)).structure())
    if isinstance(value, str) and labels:
        return ("str",)
    value = raw(value)
    if plain_value(value):
        return (type(value), value)
    frozen = freeze(value)
    if frozen is not MISSING:
        return ("frozen", frozen)
    return ("object", Ref(value))


def call_key(leaves: Sequence[Any], spec: Any, labels: bool = True,
             walks: dict[int, ModuleWalk] | None = None) -> tuple:
    """``walks``: the call site's walk of each module argument, by leaf position."""
    get = (walks or {}).get
    return (ambient(), spec, *[leaf_key(v, labels, get(i)) for i, v in enumerate(leaves)])


def leaf_of_key(key: tuple, i: int) -> Any:
    """What :func:`call_key` holds for leaf ``i`` (a tensor's: its TensorMeta at the call)."""
    return key[2 + i]


def key_labels(names: Sequence[str]) -> tuple[str, ...]:
    """Human names for the parts of :func:`call_key`, in the same order."""
    return ("ambient", "argument structure", *names)


# -- what a body's code names: closures and globals --------------------------------------------------------


def code_reads(fn: Any) -> Iterator[tuple[Any, Any, Any]]:
    """``(holder, step, value)`` for every closure cell and global ``fn``'s code names (nested functions
    included; ``hooks.named_values``), but code: Python state the trace may bake in, guarded like attribute
    reads."""
    for holder, step, value in named_values(fn):
        if not _code_like(value):
            yield holder, step, value


def _code_like(value: Any) -> bool:
    # functions, classes and modules: their code is not guarded (a redefinition is not seen)
    return isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
                              types.ModuleType, torch.Tensor)) or (callable(value) and not isinstance(
                                  value, torch.nn.Module) and not hasattr(value, "__dict__"))


__all__ = ["ambient", "autocasting", "call_key", "code_reads", "key_labels", "leaf_key"]
