"""A compiled program's guards in the form checked before every call: a tree of C++ guards, and generated
Python code for the rest.

``identity.object_guards`` splits guards for the hot path; checked one by one in a loop, GPT-2's 600 chains
of attribute reads (a layer's submodules, config values) cost about half a millisecond a call, most of it
re-reading the same prefixes (``model.transformer.h``) and the loop itself.  Here the chains become a trie,
each distinct prefix read once:

* as a tree of torch's own C++ guard managers (``torch._C._dynamo.guards``, what torch.compile checks its
  guards with): an accessor per prefix -- an attribute, a dict item by a plain key, a submodule read from its
  module's ``_modules`` as ``nn.Module.__getattr__`` would find it -- and at its end an identity or an
  equality check, with Python's semantics (the same type, then ``==``).  GPT-2's 785 guards cost about
  70 us a call this way (with the Python below), against 290 us as generated Python alone;
* what the tree cannot express (an attribute found missing, an object's state, a dict keyed by objects,
  hooks, general paths) as straight-line Python code returning False at the first guard that fails, the
  reads and comparisons ``object_guards_hold`` makes without the interpretation; and what that cannot
  express is checked as before, after it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

from .identity import object_guards, object_guards_hold
from .reads import MISSING, freeze, plain_value


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names: dict[str, Any] = {"MISSING": MISSING}
        self.of_object: dict[int, str] = {}
        self.reads: dict[tuple, str] = {}  # (variable it reads from, step) -> the variable holding it

    def constant(self, value: Any) -> str:
        name = self.of_object.get(id(value))
        if name is None:
            name = self.of_object[id(value)] = f"c{len(self.of_object)}"
            self.names[name] = value
        return name

    def read(self, holder: Any, steps: tuple) -> str:
        """The variable holding what ``steps`` read from ``holder`` (each prefix read once): an attribute,
        ``("item", key)`` of a dict or ``("key", Ref(obj))`` (``identity.step``)."""
        var = self.constant(holder)
        for name in steps:
            key = (var, name)
            nxt = self.reads.get(key)
            if nxt is None:
                nxt = self.reads[key] = f"v{len(self.reads)}"
                if isinstance(name, str):
                    self.lines.append(f"{nxt} = getattr({var}, {name!r}, MISSING)")
                else:
                    c = self.constant(name[1].obj if name[0] == "key" else name[1])
                    self.lines.append(f"{nxt} = {var}.get({c}, MISSING) if isinstance({var}, dict) "
                                      "else MISSING")
            var = nxt
        return var

    def same(self, var: str, value: Any) -> None:
        self.lines.append(f"if {var} is not {self.constant(value)}: return False")

    def equal(self, var: str, value: Any) -> None:
        c = self.constant(value)
        self.lines.append(f"if {var} is not {c} and (type({var}) is not type({c}) or {var} != {c}): "
                          "return False")


def _state(value: Any, obj: Any, frozen: Any) -> bool:
    return value is obj and freeze(vars(value)) == frozen


class GuardChecker:
    """Whether every guard holds now, called with no arguments.  Its first calls check the guards in a loop
    (``object_guards_hold``); from the third it runs their tree and generated code: making those for a
    48-layer model's 3,000 guards costs about 0.1 s, more than a first call should pay for a program that
    may run once."""

    __slots__ = ("guards", "split", "calls", "run")

    def __init__(self, guards: tuple) -> None:
        self.guards = guards
        self.split = object_guards(guards)
        self.calls = 0
        self.run: Callable[[], bool] | None = None

    def __call__(self) -> bool:
        run = self.run
        if run is not None:
            return run()
        self.calls += 1
        if self.calls > 2:
            # made only where every guard holds: torch's accessors assume the guards held when they were
            # made, and skip a dict that has not changed since (a stale program's tree would pass)
            if not object_guards_hold(*self.split):
                return False
            self.run = _compiled(self.split)
            return True
        return object_guards_hold(*self.split)


# dicts whose ``get`` is dict's: torch's item accessor looks up as ``get`` does (a defaultdict's
# ``__missing__`` is not called), so it says what the generated code says (an optimizer's ``state``)
_DICTS = (dict, collections.defaultdict, collections.OrderedDict)


class _Tree:
    """The C++ guard tree (the module docstring): ``read`` gives the manager of a path's value (each
    prefix's made once), None where a step is not an attribute or a dict item."""

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

    def holder(self, obj: Any) -> tuple:
        name = self.of_object.get(id(obj))
        if name is None:
            name = self.of_object[id(obj)] = f"c{len(self.of_object)}"
            self.roots[name] = obj
            self.managers[(name,)] = (self.root.dict_getitem_manager(name, name, obj, self.kind), obj, name)
        return (name,)

    def read(self, holder: Any, steps: tuple, table: bool = False) -> Any:
        path = self.holder(holder)
        for k, step in enumerate(steps):
            manager, value, text = self.managers[path]
            if table and k == 0:
                step = ("item", step)
            nxt = (*path, step)
            if nxt not in self.managers:
                if isinstance(step, str):
                    self.managers[nxt] = self._attribute(path, step)
                elif step[0] == "item" and plain_value(step[1]) and type(value) in _DICTS:
                    key = step[1]  # (not an object key: torch's accessor compares keys with ==)
                    if path not in self.typed:  # a dict item only of what is that kind of dict still
                        manager.add_type_match_guard(id(type(value)), [f"type({text})"], None)
                        self.typed.add(path)
                    got = value.get(key, MISSING)
                    said = f"{text}[{key!r}]"
                    self.managers[nxt] = (manager.dict_getitem_manager(key, said, got, self.kind), got, said)
                else:
                    return None
            path = nxt
        return (*self.managers[path], path)

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

    def same(self, read: Any, value: Any) -> None:
        read[0].add_id_match_guard(id(value), [f"{read[2]} is {type(value).__name__}"], None)
        self.checks.setdefault(read[3], []).append("is None" if value is None else
                                                   f"is <{type(value).__name__} object>")

    def equal(self, read: Any, value: Any) -> None:
        if value is None:
            return self.same(read, value)
        read[0].add_equals_match_guard(value, [f"{read[2]} == {value!r}"], None)
        self.checks.setdefault(read[3], []).append(f"== {value!r}")
        return None

    def text(self) -> str:
        """The tree, an accessor a line (indented under the one it reads from), with its checks."""
        children: dict[tuple, list[tuple]] = {}
        for path in self.managers:
            children.setdefault(path[:-1], []).append(path)
        lines: list[str] = []

        def show(path: tuple) -> None:
            step = path[-1]
            said = step if len(path) == 1 else f".{step}" if isinstance(step, str) else f"[{step[1]!r}]"
            lines.append("  " * (len(path) - 1) + " ".join([said, *self.checks.get(path, ())]))
            for child in children.get(path, ()):
                show(child)

        for top in children.get((), ()):
            show(top)
        return "\n".join(lines)


def _compiled(split: tuple) -> Callable[[], bool]:
    """The guards ``object_guards`` split as a C++ tree and Python code for the rest (the module
    docstring)."""
    fast, same, chains, rest, hooks = split
    tree = _Tree()
    for obj, name, value in fast:  # the guards on attribute chains: most of them
        tree.equal(tree.read(obj, (name,)), value)
    for holder, first, steps, value in same:
        tree.same(tree.read(holder, (first, *steps), table=type(holder) is dict), value)
    for holder, first, steps, value in chains:
        tree.equal(tree.read(holder, (first, *steps), table=type(holder) is dict), value)
    python = []
    for path, expect in rest:
        # an attribute found missing or an object's state stay Python (a tree's read of a missing
        # attribute fails: it must not be made for a guard that expects it missing)
        plain = expect[0] == "is" or expect[0] == "=" and (
            expect[1] in (bool, int, float, type(None)) or (expect[1] is tuple and plain_value(expect[2])))
        read = tree.read(path[0][1].obj, path[1:]) if plain and path[0][0] == "id" and path[1:] else None
        if read is None:
            python.append((path, expect))
        elif expect[0] == "is":
            tree.same(read, expect[1].obj)
        else:
            tree.equal(read, expect[2])
    code = _generated(tuple(python), hooks)
    root, roots = tree.root, tree.roots
    if code.source == _EMPTY:
        check = lambda: root.check(roots)  # noqa: E731
    else:
        check = lambda: root.check(roots) and code()  # noqa: E731
    check.source = f"# C++ guards\n{tree.text()}\n# then\n{code.source}"  # type: ignore[attr-defined]
    return check


_EMPTY = "def check():\n    return True\n"


def _generated(rest: tuple, hooks: tuple) -> Callable[[], bool]:
    """Straight-line code checking the guards the tree cannot (``rest`` and ``hooks`` of what
    ``object_guards`` splits; the module docstring)."""
    empty, hooked = hooks
    out = _Writer()
    general = []
    for path, expect in rest:
        steps = path[1:]
        if path[0][0] != "id" or not steps or not all(
                isinstance(step, str) or step[0] in ("item", "key") for step in steps):
            general.append((path, expect))
            continue
        var = out.read(path[0][1].obj, steps)
        if expect[0] == "missing":  # an attribute the trace found absent (``getattr(cfg, "x", None)``)
            out.lines.append(f"if {var} is not MISSING: return False")
        elif expect[0] == "=" and expect[1] is tuple and plain_value(expect[2]):  # ``normalized_shape``
            out.lines.append(f"if type({var}) is not tuple or {var} != {out.constant(expect[2])}: "
                             "return False")
        elif expect[0] == "is":  # (a training step's state: a path through dicts)
            out.same(var, expect[1].obj)
        elif expect[0] == "=" and expect[1] in (bool, int, float, type(None)):
            out.equal(var, expect[2])
        elif expect[0] == "state":  # an object guarded by identity and its plain state
            out.names["_state"] = _state
            out.lines.append(f"if not _state({var}, {out.constant(expect[1].obj)}, "
                             f"{out.constant(expect[2])}): return False")
        else:
            general.append((path, expect))
    if empty or hooked or general:  # hook tables and other paths: as object_guards_hold checks them
        out.names["_rest"] = lambda: object_guards_hold((), (), (), tuple(general), (empty, hooked))
        out.lines.append("return _rest()")
    else:
        out.lines.append("return True")
    source = "def check():\n" + "".join(f"    {line}\n" for line in out.lines)
    namespace = dict(out.names)
    exec(compile(source, "<effectfx guards>", "exec"), namespace)  # noqa: S102 -- our own generated code
    check = namespace["check"]
    check.source = source  # type: ignore[attr-defined]  (for debugging: print(entry.check.run.source))
    return check
