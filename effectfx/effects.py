"""The effect registry: the one source of truth for "is this op effectful, and on which key?".

See Note [Effect tokens] in ``effectfx.notes``.  Every pass (functionalization, DCE, the verifier, token
removal) asks :func:`effect_of`, through ``effectfx.graph.walk`` for graph nodes; nothing else decides.
Ops that PyTorch itself marks ORDERED (for example ``aten::_print``) are effectful with key ``"ordered"``
unless registered here with another key, and so is a custom op that returns nothing and mutates nothing:
it exists only for its side effect.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch._library.custom_ops import CustomOpDef

from .errors import RegistryError

DEFAULT_KEY = "ordered"
_KEY_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:\-]*$")

OpLike = torch._ops.OpOverload | torch._ops.OpOverloadPacket | CustomOpDef | str

# qualified op name ("ns::name") -> effect key.  Keyed by packet name: all overloads share the key.
_REGISTRY: dict[str, str] = {}


@dataclass
class EffectHandle:
    """Returned by :func:`register_effect`; ``remove()`` restores what was there before."""

    qualname: str
    previous: str | None
    _removed: bool = False

    def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        if self.previous is None:
            _REGISTRY.pop(self.qualname, None)
        else:
            _REGISTRY[self.qualname] = self.previous


def _qualname(op: Any) -> str:
    if isinstance(op, CustomOpDef):
        return op._qualname
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    if isinstance(op, str):
        name = op.split(".")[0] if "::" in op else op
        if "::" not in name:
            raise RegistryError(f"register_effect({op!r}): op names are written 'namespace::name'.")
        return name
    raise RegistryError(
        f"register_effect({op!r}): expected an OpOverload, OpOverloadPacket, CustomOpDef or 'ns::name', "
        f"got {type(op).__name__}. Define the op with torch.library.custom_op first."
    )


def _op_exists(qualname: str) -> bool:
    ns, name = qualname.split("::", 1)
    try:
        getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def check_key(key: Any, who: str) -> None:
    """Refuse ``key`` unless it is an effect key (``who``: the call that was given it, for the message)."""
    if not isinstance(key, str) or not _KEY_PATTERN.match(key):
        raise RegistryError(
            f"{who}: bad effect key {key!r}. A key is a non-empty string such as "
            "'ordered', 'memory' or 'collective:tp' (letters, digits, '_', '.', ':', '-')."
        )


def register_effect(op: OpLike, key: str = DEFAULT_KEY) -> EffectHandle:
    """Mark ``op`` as effectful on ``key``: effectfx keeps its calls in order with the others of that key."""
    qualname = _qualname(op)
    check_key(key, f"register_effect({qualname!r})")
    if not _op_exists(qualname):
        raise RegistryError(
            f"register_effect: no operator {qualname!r} is defined. Define it with "
            "torch.library.custom_op (or import the module that does) before registering its effect."
        )
    handle = EffectHandle(qualname, _REGISTRY.get(qualname))
    _REGISTRY[qualname] = key
    return handle


# Namespaces of torch's own ops: an op there that returns nothing is not thereby an effect (profiler exits,
# say, are explicitly pure to torch); only torch's registry decides for them.
_TORCH_NAMESPACES = frozenset({"aten", "prim", "prims", "profiler", "debugprims", "rngprims"})


@dataclass
class _OpFacts:
    """What effect_of learned about one operator overload, computed once (Note [Effect tokens])."""

    holder: Any  # torch's EffectHolder for the overload (read live: registrations there change it)
    implicit: bool  # returns nothing and mutates nothing: it exists only for its side effect


# operator overload -> its facts.  Keyed by the OpOverload object, not by name, so an op defined again
# (a Library destroyed and re-created with another schema) is looked at afresh.
_FACTS: dict[Any, _OpFacts] = {}
# qualified names effect_of treated as effects because of their schema (for efx.explain), in first-seen order
_IMPLICIT: dict[str, None] = {}


def _torch_holder(op: torch._ops.OpOverload) -> Any:
    import torch._higher_order_ops.effects  # noqa: F401  (registers torch's ORDERED ops, aten::_print)

    try:
        return torch._library.simple_registry.singleton.find(op._name).effect
    except Exception:  # ops torch's registry cannot resolve are not effectful to torch
        return None


def _only_side_effect(op: torch._ops.OpOverload) -> bool:
    schema = op._schema
    if op.namespace in _TORCH_NAMESPACES or schema.returns:
        return False
    return not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _facts(op: torch._ops.OpOverload) -> _OpFacts:
    facts = _FACTS.get(op)
    if facts is None:
        facts = _FACTS[op] = _OpFacts(_torch_holder(op), _only_side_effect(op))
    return facts


def _overload_of(op: Any, qualname: str) -> torch._ops.OpOverload | None:
    """The overload a packet, CustomOpDef or name stands for (its default, as torch's registry does)."""
    if isinstance(op, str) and "." in op.split("::", 1)[-1]:
        qualname, overload = op.rsplit(".", 1)
    else:
        overload = "default"
    ns, name = qualname.split("::", 1)
    try:
        found = getattr(getattr(getattr(torch.ops, ns), name), overload)
    except (AttributeError, RuntimeError):
        return None
    return found if isinstance(found, torch._ops.OpOverload) else None


def effect_of(op: Any) -> str | None:
    """The effect key of ``op``, or ``None`` if it is pure.  Non-op callables are pure.

    In order: an explicit :func:`register_effect`; PyTorch's own effect registry (``aten::_print``, ops
    taking script objects), read live so later registrations there count; and a custom op that returns
    nothing and mutates nothing -- it exists only for its side effect -- is an effect on ``"ordered"``.
    """
    if isinstance(op, torch._ops.OpOverload):
        qualname = op._schema.name
        overload: torch._ops.OpOverload | None = op
    elif isinstance(op, (torch._ops.OpOverloadPacket, CustomOpDef, str)):
        try:
            qualname = _qualname(op)
        except RegistryError:
            return None
        overload = _overload_of(op, qualname)
    else:
        return None
    key = _REGISTRY.get(qualname)
    if key is not None:
        return key
    if overload is None:
        return None
    facts = _facts(overload)
    if facts.holder is not None and facts.holder.effect is not None:
        return DEFAULT_KEY
    if facts.implicit:
        _IMPLICIT.setdefault(qualname)
        return DEFAULT_KEY
    return None


def implicit_effects() -> tuple[str, ...]:
    """Ops (qualified names) that :func:`effect_of` has treated as effects on ``"ordered"`` only because
    they return nothing and mutate nothing, in the order first seen; ``register_effect`` overrides."""
    return tuple(q for q in _IMPLICIT if q not in _REGISTRY)


def registered_effects() -> dict[str, str]:
    """A copy of the explicit registrations (qualified name -> key)."""
    return dict(_REGISTRY)
