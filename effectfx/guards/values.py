"""What guards hold of Python values (Note [Region identity]): plain data by value (:func:`freeze`),
objects by identity (:class:`Ref`), and the paths that say where a value was read."""

from __future__ import annotations

import enum
import functools
import types
from typing import Any

import torch

from .labels import Label

MISSING: Any = type("Missing", (), {"__repr__": lambda self: "<missing>"})()

# (root, *steps): root ("leaf", i) -- the i-th argument of a call site -- or ("id", Ref); a step is an
# attribute name, ("item", key) of a dict, ("key", Ref(obj)) of a dict keyed by objects, or hooks.HOOKS
Path = tuple

_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, enum.Enum)
# functions compared by identity inside a frozen value: their code is the same object
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, torch._ops.OpOverload,
              torch._ops.OpOverloadPacket)


class Ref(int):
    """A path root that is one particular object: equal and hashed by identity (as the int ``id(obj)``,
    so in C: guards hold thousands of these), holding the object alive.  Paths never hold a plain int
    where a Ref stands."""

    obj: Any

    def __new__(cls, obj: Any) -> Ref:
        ref = super().__new__(cls, id(obj))
        ref.obj = obj
        return ref

    def __repr__(self) -> str:
        return f"<{type(self.obj).__name__}>"

    def __copy__(self) -> Ref:
        return self

    def __deepcopy__(self, memo: dict) -> Ref:  # a copy refers to the very object
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a guard's reference to a live object cannot be pickled")


def plain_value(value: Any) -> bool:
    """Hashable plain data (numbers, strings, dtypes, enums...): values a trace can bake in."""
    if isinstance(value, tuple):
        return all(plain_value(v) for v in value)
    return isinstance(value, _PLAIN)


def freeze(value: Any, depth: int = 0) -> Any:
    """A hashable snapshot of plain data in lists, dicts and sets, or MISSING if it holds anything else."""
    if plain_value(value):
        return str.__str__(value) if isinstance(value, Label) else value
    if depth > 4:
        return MISSING
    if isinstance(value, (list, tuple)):
        items = tuple(freeze(v, depth + 1) for v in value)
    elif isinstance(value, dict):
        items = tuple((freeze(k, depth + 1), freeze(v, depth + 1)) for k, v in value.items())
    elif isinstance(value, (set, frozenset)):
        items = tuple(sorted((freeze(v, depth + 1) for v in value), key=repr))
    elif type(value) is types.SimpleNamespace:  # a config object: its attributes are all it is
        items = tuple((k, freeze(v, depth + 1)) for k, v in vars(value).items())
    elif type(value) is functools.partial and isinstance(value.func, _FUNCTIONS):
        # an activation such as ``partial(F.gelu, approximate="tanh")``, one per layer: equal when it
        # calls the same function with equal arguments
        items = (value.func, freeze(value.args, depth + 1), freeze(value.keywords, depth + 1),
                 freeze(vars(value), depth + 1))
    else:
        return MISSING
    if MISSING in items or any(isinstance(i, tuple) and MISSING in i for i in items):
        return MISSING
    return (type(value).__name__, items)


def class_of(value: Any) -> type:
    """The object's own class, also while it is watched (its class swapped for a recording subclass); a
    compiled module's is its model's, which is what a capture runs of it (Note [Nested compiles] in
    ``effectfx.drivers.compile``)."""
    cls = type(value)
    cls = getattr(cls, "__efx_watched__", cls)
    return getattr(cls, "__efx_compiled__", cls)


def watchable(obj: Any) -> bool:
    """Objects whose attribute reads can be recorded (``effectfx.guards.reads``): instances of ordinary
    Python classes."""
    cls = type(obj)
    if isinstance(obj, (type, torch.Tensor, enum.Enum)) or callable(obj) and not isinstance(
            obj, torch.nn.Module):
        return False
    return bool(cls.__flags__ & (1 << 9)) and hasattr(obj, "__dict__")  # a heap type with a __dict__
