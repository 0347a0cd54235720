"""What a compiled program's guards are compiled to (``effectfx.guards.check``): a tree of torch's own C++
guard managers (:class:`Tree`), and straight-line Python for what the tree cannot express (:class:`Writer`).
Each guard kind says what it adds to either (``effectfx.guards.kinds``); both read every distinct prefix of
the guards' paths once.

* The tree (``torch._C._dynamo.guards``, what torch.compile checks its guards with): an accessor per
  prefix -- an attribute, a dict item by a plain key, a submodule read from its module's ``_modules`` as
  ``nn.Module.__getattr__`` would find it -- and at its end an identity or an equality check, with
  Python's semantics (the same type, then ``==``);
* the code: a variable per prefix (``getattr(v, name, MISSING)``, a dict's ``get``), and a line per check
  returning False at the first that fails.
"""

from __future__ import annotations

import collections
import itertools
import types
from collections.abc import Callable
from typing import Any

import torch

from .hooks import HOOK_STEPS, hook_step
from .values import MISSING, Path, plain_value

# dicts whose ``get`` is dict's: torch's item accessor looks up as ``get`` does (a defaultdict's
# ``__missing__`` is not called), so it says what the generated code says (an optimizer's ``state``)
_DICTS = (dict, collections.defaultdict, collections.OrderedDict)


class Tree:
    """The C++ guard tree: :meth:`read` gives the manager of a path's value (each prefix's made once)."""

    def __init__(self) -> None:
        from torch._C._dynamo import guards
        from torch._dynamo.guards import GuardManagerType

        self.root = guards.RootGuardManager()
        self.kind = GuardManagerType.GUARD_MANAGER
        self.roots: dict[str, Any] = {}  # what the root reads its holders from, passed at every check
        self.of_object: dict[int, str] = {}
        self.managers: dict[tuple, tuple[Any, Any, str]] = {}  # path -> (manager, value now, its text)
        self.typed: set[tuple] = set()
        self.checks: dict[tuple, list[str]] = {}  # path -> its checks, readable (``text``)
        self.identities: set[tuple] = set()  # (path, id) of the identity checks made
        self.inner: dict[tuple, tuple[Any, Any, str]] = {}  # managers between steps (``_inner``)

    def _holder(self, obj: Any) -> tuple:
        name = self.of_object.get(id(obj))
        if name is None:
            name = self.of_object[id(obj)] = f"c{len(self.of_object)}"
            self.roots[name] = obj
            self.managers[(name,)] = (self.root.dict_getitem_manager(name, name, obj, self.kind), obj, name)
        return (name,)

    def read(self, path: Path) -> tuple | None:
        """The manager of the value at ``path``, or None where the tree cannot read it: a path from a call
        site's arguments, or a step that is not an attribute, a dict item by a plain key or one into a
        module's hooks."""
        if path[0][0] != "id" or len(path) < 2:
            return None
        at = self._holder(path[0][1].obj)
        for step in path[1:]:
            manager, value, text = self.managers[at]
            nxt = (*at, step)
            if nxt not in self.managers:
                if isinstance(step, str):
                    self.managers[nxt] = self._attribute(at, step)
                elif step[0] == "item" and plain_value(step[1]) and type(value) in _DICTS:
                    key = step[1]  # (not an object key: torch's accessor compares keys with ==)
                    self._typed(at, manager, value, text)  # a dict item only of that kind of dict still
                    got = value.get(key, MISSING)
                    said = f"{text}[{key!r}]"
                    self.managers[nxt] = (manager.dict_getitem_manager(key, said, got, self.kind), got, said)
                elif step[0] in HOOK_STEPS:
                    made = self._hook_step(at, step)
                    if made is None:
                        return None
                    self.managers[nxt] = made
                else:
                    return None
            at = nxt
        return (*self.managers[at], at)

    def _typed(self, at: tuple, manager: Any, value: Any, text: str) -> None:
        """What is read from the value at ``at`` is read only of a value of its type still (torch's
        accessors of a dict's item or a function's closure would crash on another)."""
        if at not in self.typed:
            manager.add_type_match_guard(id(type(value)), [f"type({text})"], None)
            self.typed.add(at)

    def _hook_step(self, at: tuple, step: tuple) -> tuple[Any, Any, str] | None:
        """A step into a module's hooks (``hooks.hook_step``): its table's item by the hook's id (that at
        the position now, the table's keys unchanged), then the function's cell, default or keyword default,
        through its ``__closure__``, ``__defaults__`` or ``__kwdefaults__``.  (Stricter than the
        interpretation only where a hook table changed, which the module's ``Hooks`` guard fails on.)"""
        manager, value, text = self.managers[at]
        if step[0] == "hook":
            table = vars(value).get(step[1]) if isinstance(value, torch.nn.Module) else None
            if type(table) not in _DICTS or step[2] >= len(table):
                return None
            tmanager, _, ttext = self._inner((*at, step[1]), lambda: (
                manager.getattr_manager(step[1], f"{text}.{step[1]}", table, self.kind), table,
                f"{text}.{step[1]}"))
            if (*at, step[1]) not in self.typed:  # (the hook by its id, at its position: the keys in order,
                # as the module's Hooks guard requires anyway)
                self._typed((*at, step[1]), tmanager, table, ttext)
                keys = list(table)
                tmanager.add_mapping_keys_guard(dict.fromkeys(keys), [f"list({ttext}) == {keys}"], None)
            key = list(table)[step[2]]
            got, said = table[key], f"{ttext}[{key!r}]"
            return tmanager.dict_getitem_manager(key, said, got, self.kind), got, said
        if type(value) is not types.FunctionType:
            return None
        self._typed(at, manager, value, text)
        if step[0] == "kwdefault":
            kwdefaults, ktext = value.__kwdefaults__ or {}, f"{text}.__kwdefaults__"
            kmanager, _, _ = self._inner((*at, "__kwdefaults__"), lambda: (
                manager.func_kwdefaults_manager(ktext, kwdefaults, self.kind), kwdefaults, ktext))
            got, said = kwdefaults.get(step[1], MISSING), f"{ktext}[{step[1]!r}]"
            return kmanager.dict_getitem_manager(step[1], said, got, self.kind), got, said
        held = value.__closure__ if step[0] == "cell" else value.__defaults__
        name = "__closure__" if step[0] == "cell" else "__defaults__"
        if held is None or step[1] >= len(held):
            return None
        make = manager.closure_manager if step[0] == "cell" else manager.func_defaults_manager
        hmanager, _, htext = self._inner((*at, name), lambda: (make(f"{text}.{name}", held, self.kind), held,
                                                             f"{text}.{name}"))
        got, said = held[step[1]], f"{htext}[{step[1]}]"
        item = hmanager.tuple_getitem_manager(step[1], said, got, self.kind)
        if step[0] == "default":
            return item, got, said
        contents, said = got.cell_contents, f"{said}.cell_contents"
        return item.getattr_manager("cell_contents", said, contents, self.kind), contents, said

    def _inner(self, at: tuple, make: Callable[[], tuple[Any, Any, str]]) -> tuple[Any, Any, str]:
        """A manager between a path's steps (a hook table, a closure), made once and not shown."""
        found = self.inner.get(at)
        if found is None:
            found = self.inner[at] = make()
        return found

    def _attribute(self, path: tuple, name: str) -> tuple[Any, Any, str]:
        manager, value, text = self.managers[path]
        if (isinstance(value, torch.nn.Module) and name in value._modules and name not in vars(value)
                and not hasattr(type(value), name)):  # where nn.Module.__getattr__ finds it
            modules = (*path, "_modules")
            if modules not in self.managers:
                self.managers[modules] = self._attribute(path, "_modules")
            got, said = value._modules[name], f"{text}.{name}"
            return self.managers[modules][0].dict_getitem_manager(name, said, got, self.kind), got, said
        got, said = getattr(value, name, MISSING), f"{text}.{name}"
        return manager.getattr_manager(name, said, got, self.kind), got, said

    def same(self, read: tuple, value: Any) -> None:
        if (read[3], id(value)) in self.identities:  # (hooks naming one global: checked once)
            return
        self.identities.add((read[3], id(value)))
        read[0].add_id_match_guard(id(value), [f"{read[2]} is {type(value).__name__}"], None)
        self.checks.setdefault(read[3], []).append("is None" if value is None else
                                                   f"is <{type(value).__name__} object>")

    def equal(self, read: tuple, value: Any) -> None:
        if value is None:
            return self.same(read, value)
        read[0].add_equals_match_guard(value, [f"{read[2]} == {value!r}"], None)
        self.checks.setdefault(read[3], []).append(f"== {value!r}")
        return None

    def keys(self, read: tuple, keys: tuple) -> None:
        """The dict read has ``keys``, in that order (its type tested first: torch's check of the keys of
        what is not a mapping would crash)."""
        self._typed(read[3], read[0], read[1], read[2])
        read[0].add_mapping_keys_guard(dict.fromkeys(keys), [f"list({read[2]}) == {list(keys)!r}"], None)
        self.checks.setdefault(read[3], []).append(f"keys {list(keys)!r}")

    def text(self) -> str:
        """The tree, an accessor a line (indented under the one it reads from), with its checks."""
        children: dict[tuple, list[tuple]] = {}
        for path in self.managers:
            children.setdefault(path[:-1], []).append(path)
        lines: list[str] = []

        def show(path: tuple) -> None:
            step = path[-1]
            said = step if len(path) == 1 else f".{step}" if isinstance(step, str) else f"[{step[1]!r}]" \
                if step[0] in ("item", "key") else f"<{step[0]} {step[-1]!r}>"  # (hooks.hook_step)
            lines.append("  " * (len(path) - 1) + " ".join([said, *self.checks.get(path, ())]))
            for child in children.get(path, ()):
                show(child)

        for top in children.get((), ()):
            show(top)
        return "\n".join(lines)


class Writer:
    """Straight-line Python, a check a line, returning False at the first that fails."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, Any] = {"MISSING": MISSING}
        self.of_object: dict[int, str] = {}
        self.reads: dict[tuple, str] = {}  # (variable it reads from, step) -> the variable holding it
        self.empty: list[dict] = []  # dicts that must stay empty, tested together at the end
        self.lacking: dict[str, list[dict]] = {}  # key -> dicts that must not get it, tested together too

    def constant(self, value: Any) -> str:
        name = self.of_object.get(id(value))
        if name is None:
            name = self.of_object[id(value)] = f"c{len(self.of_object)}"
            self.names[name] = value
        return name

    def helper(self, name: str, fn: Callable[..., Any]) -> str:
        self.names[name] = fn
        return name

    def read(self, path: Path) -> str | None:
        """The variable holding the value at ``path`` (each prefix read once), or None where the code does
        not read it: a path from a call site's arguments, or a step that is not an attribute, ``("item",
        key)`` of a dict, ``("key", Ref(obj))``, ``("index", i)`` of a tuple or one into a module's hooks
        (``hooks.hook_step``)."""
        steps = path[1:]
        if path[0][0] != "id" or not steps or not all(
                isinstance(step, str) or step[0] in ("item", "key", "index", *HOOK_STEPS) for step in steps):
            return None
        var = self.constant(path[0][1].obj)
        for name in steps:
            key = (var, name)
            nxt = self.reads.get(key)
            if nxt is None:
                nxt = self.reads[key] = f"v{len(self.reads)}"
                if isinstance(name, str):
                    self.lines.append(f"{nxt} = getattr({var}, {name!r}, MISSING)")
                elif name[0] == "index":
                    self.lines.append(f"{nxt} = {var}[{name[1]}] if type({var}) is tuple and len({var}) > "
                                      f"{name[1]} else MISSING")
                elif name[0] in HOOK_STEPS:  # a hook, a string it closes over (hooks.hook_labels)
                    self.lines.append(f"{nxt} = {self.helper('hook_step', hook_step)}({var}, {name!r})")
                else:
                    c = self.constant(name[1].obj if name[0] == "key" else name[1])
                    self.lines.append(f"{nxt} = {var}.get({c}, MISSING) if isinstance({var}, dict) "
                                      "else MISSING")
            var = nxt
        return var

    def fails_if(self, condition: str) -> None:
        self.lines.append(f"if {condition}: return False")

    def same(self, var: str, value: Any) -> None:
        self.fails_if(f"{var} is not {self.constant(value)}")

    def equal(self, var: str, value: Any) -> None:
        c = self.constant(value)
        self.fails_if(f"{var} is not {c} and (type({var}) is not type({c}) or {var} != {c})")

    def stay_empty(self, tables: tuple[dict, ...]) -> None:
        """``tables`` (a module's hook tables) must stay empty: one ``any`` over all of them, at the end."""
        self.empty.extend(tables)

    def lacks(self, state: dict, key: str) -> None:
        """``state`` (a module's ``__dict__``) must not get ``key`` (``"forward"``): one ``any`` over every
        such dict, at the end."""
        self.lacking.setdefault(key, []).append(state)

    def function(self, then: Callable[[], bool] | None = None) -> Callable[[], bool]:
        """The code as a function of no arguments; ``then``: what it returns when every line passed."""
        if self.empty:
            self.fails_if(f"any({self.constant(tuple(self.empty))})")
        for key, dicts in self.lacking.items():  # (a loop in C: GPT-2's 176 modules cost 3 us)
            has, key_c = self.helper("_contains", dict.__contains__), self.constant(itertools.repeat(key))
            self.fails_if(f"any(map({has}, {self.constant(tuple(dicts))}, {key_c}))")
        self.lines.append("return True" if then is None else f"return {self.helper('_then', then)}()")
        source = "def check():\n" + "".join(f"    {line}\n" for line in self.lines)
        namespace = dict(self.names)
        exec(compile(source, "<effectfx guards>", "exec"), namespace)  # noqa: S102 -- our own generated code
        check = namespace["check"]
        check.source = source  # type: ignore[attr-defined]  (for debugging: print(entry.check.run.source))
        return check
