"""The words for keys and guards (Note [Region identity]): what ``efx.explain`` says about why a body or a
compiled signature is new, and what ``efx.compile`` says about a guard that failed.  The key is
``effectfx.guards.identity``; each guard kind describes itself (``Guard.describe``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import TreeSpec

from ..graph.traced import TensorMeta
from .hooks import GLOBAL, HOOKS, TABLES
from .identity import AUTOCAST_DEVICES
from .kinds import Guard, hooks_text


def path_text(path: tuple, leaf_names: Sequence[str] = (), objects: dict[int, str] | None = None) -> str:
    root = path[0]
    if root[0] == "leaf":
        text = leaf_names[root[1]] if root[1] < len(leaf_names) else f"arg{root[1]}"
    else:
        obj = root[1].obj
        text = (objects or {}).get(id(obj))
        if text is None:
            text = "globals" if isinstance(obj, dict) and "__name__" in obj else (
                "a closure cell" if type(obj).__name__ == "cell" else f"a {type(obj).__name__}")
    for s in path[1:]:
        if s == HOOKS:
            is_global = root[0] == "id" and root[1].obj is GLOBAL
            text = "torch's global module hooks" if is_global else f"{text} hooks"
        elif isinstance(s, tuple) and s[0] == "hook":  # (hooks.hook_labels)
            text = f"{text} {'forward pre-hook' if s[1] == '_forward_pre_hooks' else 'forward hook'} {s[2]}"
        elif isinstance(s, tuple) and s[0] in ("cell", "default", "kwdefault"):
            text = f"{text}'s {s[-1]}"  # (the name of the variable, or of the parameter)
        elif isinstance(s, tuple):
            text = s[1] if text == "globals" else f"{text}[{s[1]!r}]"
        elif s == "cell_contents" and text == "a closure cell":
            text = "a closed-over value"
        else:
            text = f"{text}.{s}"
    return text


def guard_text(guard: Guard, found: Any, objects: dict[int, str] | None = None) -> str:
    """One guard that failed: ``Model.h.0.attn.scale: 0.5 -> 0.25``."""
    return f"{path_text(guard.path, (), objects)}: {guard.describe()} -> {guard.found_text(found)}"


_TERM = re.compile(r"L\['t\d+'\]\.(?:size\(\)\[\d+\]|stride\(\)\[\d+\]|storage_offset\(\))")


def shape_guard_text(guard: str, tensors: Sequence[torch.Tensor]) -> str:
    """A symbolic program's shape guard that failed on a call's tensors, with what each size, stride and
    storage offset it reads is now: ``L['t0'].storage_offset() == 1 failed: L['t0'].storage_offset() = 2``
    (``InputSignature.guard_text`` names the tensors)."""
    scope = {"L": {f"t{k}": t for k, t in enumerate(tensors)}}
    now = ", ".join(f"{term} = {eval(term, {}, scope)}" for term in dict.fromkeys(_TERM.findall(guard)))
    return f"{guard} failed: {now}" if now else f"{guard} failed"


def guard_differences(old: Sequence[Guard], new: Sequence[Guard], leaf_names: Sequence[str] = ()
                      ) -> list[str]:
    """Lines naming the reads two bodies disagree on: ``self.config.use_gate: True -> False``."""
    a, b = {g.path: g for g in old}, {g.path: g for g in new}
    out = []
    for path in a:
        if path in b and a[path] != b[path]:
            out.append(f"{path_text(path, leaf_names)}: {a[path].describe()} -> {b[path].describe()}")
    return out


def _ambient_differences(a: tuple, b: tuple) -> list[str]:
    out = []
    if a[0] != b[0]:
        out.append(f"grad mode: {'enabled' if a[0] else 'disabled'} -> {'enabled' if b[0] else 'disabled'}")
    for device, x, y in zip(AUTOCAST_DEVICES, a[1:], b[1:]):
        if x != y:
            x, y = (str(v).replace("torch.", "") if v is not None else "off" for v in (x, y))
            out.append(f"autocast {device}: {x} -> {y}")
    profiler = 1 + len(AUTOCAST_DEVICES)
    if a[profiler:] != b[profiler:]:
        x, y = ("on" if v[profiler:] and v[profiler] else "off" for v in (a, b))
        out.append(f"profiler: {x} -> {y}")
    return out


def _diff_tensor_meta(label: str, a: TensorMeta, b: TensorMeta) -> list[str]:
    out = []
    for f in ("shape", "dtype", "device", "requires_grad", "stride"):
        x, y = getattr(a, f), getattr(b, f)
        if x == y or (f == "stride" and a.shape != b.shape):
            continue
        x, y = (list(x), list(y)) if f in ("shape", "stride") else (x, y)
        x, y = (str(v).replace("torch.", "") for v in (x, y)) if f == "dtype" else (x, y)
        hint = " (a transposed or sliced view?)" if f == "stride" else ""
        out.append(f"{label}: {f} {x} -> {y}{hint}")
    return out


def _diff_structure(label: str, a: tuple, b: tuple) -> list[str]:
    out = []
    ca, cb = dict(a[0]), dict(b[0])
    for prefix in dict.fromkeys([*ca, *cb]):
        where = f"{label}.{prefix}" if prefix else label
        if prefix not in ca or prefix not in cb:
            out.append(f"{where}: submodule {'added' if prefix not in ca else 'removed'}")
        elif ca[prefix] is not cb[prefix]:
            out.append(f"{where}: class {ca[prefix].__name__} -> {cb[prefix].__name__}")
    (ha, ga), (hb, gb) = a[2] or ((), ()), b[2] or ((), ())  # (per-submodule hooks, global hooks)
    ha, hb = dict(ha), dict(hb)
    for prefix in dict.fromkeys([*ha, *hb]):
        x, y = ha.get(prefix, ()), hb.get(prefix, ())
        if x != y:
            where = f"{label}.{prefix}" if prefix else label
            if (x or _NONE)[:TABLES] == (y or _NONE)[:TABLES]:  # (so the instance forward differs)
                before, after = _forward_text(x), _forward_text(y)
                same = " (other values it closes over or names, or bound to another object)"
                out.append(f"{where}: instance forward {before} -> {after}{same if before == after else ''}")
            else:
                out.append(f"{where}: hooks {hooks_text(x)} -> {hooks_text(y)} (other functions, or other "
                           "values they close over or name)")
    if ga != gb:
        out.append(f"{label}: torch's global module hooks changed")
    ta, tb = dict(a[1]), dict(b[1])
    for name in dict.fromkeys([*ta, *tb]):
        if name not in ta or name not in tb:
            out.append(f"{label}.{name}: parameter/buffer {'added' if name not in ta else 'removed'}")
        else:
            out.extend(_diff_tensor_meta(f"{label}.{name}", ta[name], tb[name]))
    return out or [f"{label}: module differs"]


_NONE = ((),) * TABLES + (None,)  # a module's hook key without hooks or instance forward


def _forward_text(key: tuple) -> str:
    """An instance forward in a body's key (``hooks._forward``): ``method new_forward``, or ``none``."""
    forward = key[TABLES] if len(key) > TABLES else None
    if forward is None:
        return "none"
    what = forward[1]  # a function's (code, defaults, ...) or a Ref
    fn = what[0].obj if isinstance(what, tuple) else what.obj
    return f"{forward[0]} {getattr(fn, 'co_name', None) or getattr(fn, '__name__', type(fn).__name__)}"


def part_differences(label: str, a: Any, b: Any) -> list[str]:
    """One labelled part of two keys, as readable lines (empty if equal)."""
    if a == b:
        return []
    if label == "ambient":
        return _ambient_differences(a, b)
    if label == "argument structure":
        found = _spec_difference(a, b, "") if isinstance(a, TreeSpec) and isinstance(b, TreeSpec) else None
        if found is not None:
            return [f"argument structure: {found}"]
        return [f"argument structure: {' '.join(str(a).split())} -> {' '.join(str(b).split())}"]
    if isinstance(a, TensorMeta) and isinstance(b, TensorMeta):
        return _diff_tensor_meta(label, a, b) or [f"{label}: {a.short()} -> {b.short()}"]
    if isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] == ("module",):
        return _diff_structure(label, a[1], b[1])
    if (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 5
            and isinstance(a[0], torch.Size) and isinstance(b[0], torch.Size)):  # a compile signature's
        return _diff_tensor_meta(label, TensorMeta(*a), TensorMeta(*b))
    return [f"argument '{label}': {_leaf_text(a)} -> {_leaf_text(b)}"]


def _spec_difference(a: TreeSpec, b: TreeSpec, path: str) -> str | None:
    """Where two argument structures first differ, briefly: a cache whose layers got their tensors is one
    line, not two dumps of its pytree context."""
    if a.type is not b.type or a.num_children != b.num_children or (
            a.type in (dict, list, tuple) and a.context != b.context):
        what = getattr(b.type, "__name__", str(b.type))
        return f"{path or 'the arguments'} ({what}): {a.num_leaves} leaves -> {b.num_leaves} leaves"
    if a.type not in (dict, list, tuple) and a.context != b.context:  # an object pytree flattens
        return (f"{path or 'the arguments'} ({a.type.__name__}): its state changed ({a.num_leaves} tensors "
                f"-> {b.num_leaves})")
    keys = a.context if a.type is dict else range(a.num_children)
    for key, ca, cb in zip(keys, a.children(), b.children()):
        step = ("args" if key == 0 else "kwargs") if path == "" and a.type is tuple else f"{path}[{key!r}]"
        found = _spec_difference(ca, cb, step)
        if found is not None:
            return found
    return None


def _leaf_text(part: Any) -> str:
    if isinstance(part, TensorMeta):
        return "tensor " + part.short()
    if isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], type):
        return f"{part[1]!r}" + ("" if part[0] in (int, str) else f" ({part[0].__name__})")
    if isinstance(part, tuple) and part[:1] == ("object",):
        return f"a {type(part[1].obj).__name__} object (compared by identity)"
    if isinstance(part, tuple) and part[:1] == ("str",):
        return "a str"
    if isinstance(part, tuple) and part[:1] == ("module",):
        return "a module"
    return repr(part)


def key_differences(old: tuple, new: tuple, old_labels: Sequence[str],
                    new_labels: Sequence[str]) -> list[str]:
    """The labelled parts of two call keys that differ, as readable lines (empty if the keys are equal)."""
    if len(old) != len(new) or tuple(old_labels) != tuple(new_labels):
        out = part_differences("ambient", old[0], new[0]) if old and new else []
        names_a, names_b = ", ".join(old_labels[2:]) or "-", ", ".join(new_labels[2:]) or "-"
        if names_a != names_b:
            return [*out, f"argument structure: ({names_a}) -> ({names_b})"]
        return [*out, *part_differences("argument structure", old[1], new[1])]
    out = []
    for label, a, b in zip(new_labels, old, new):
        out.extend(part_differences(label, a, b))
    return out


def body_differences(old_key: tuple, old_guards: tuple, new_key: tuple, new_guards: tuple,
                     old_labels: Sequence[str], new_labels: Sequence[str]) -> list[str]:
    """Why a body is not the other: its key, or else the reads the two disagree on."""
    return key_differences(old_key, new_key, old_labels, new_labels) or guard_differences(
        old_guards, new_guards, new_labels[2:])
