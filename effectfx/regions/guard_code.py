"""A compiled program's guards as one generated Python function, checked before every call.

``identity.object_guards`` splits guards for the hot path; checked one by one in a loop, GPT-2's 219 chains
of attribute reads (a layer's submodules, config values) cost about half a millisecond a call, most of it
re-reading the same prefixes (``model.transformer.h``) and the loop itself.  Here the chains become a trie:
each distinct prefix is read once, into a local variable, in straight-line code that returns False at the
first guard that fails -- the reads and comparisons ``object_guards_hold`` makes, in the same order of
prefixes, without the interpretation.  What the code cannot express (general paths, hooks) is checked as
before, after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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

    def read(self, holder: Any, steps: tuple, table: bool = False) -> str:
        """The variable holding what ``steps`` read from ``holder`` (each prefix read once): an attribute,
        ``("item", key)`` of a dict or ``("key", Ref(obj))`` (``identity.step``); with ``table``, the first
        step is a key of the dict ``holder`` (``identity._first_step``: a module's ``_modules``)."""
        var = self.constant(holder)
        for k, name in enumerate(steps):
            key = (var, name, table and k == 0)
            nxt = self.reads.get(key)
            if nxt is None:
                nxt = self.reads[key] = f"v{len(self.reads)}"
                if key[2]:
                    self.lines.append(f"{nxt} = {var}.get({name!r}, MISSING)")
                elif isinstance(name, str):
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
    (``object_guards_hold``); from the third it runs their generated code: compiling a 48-layer model's 3,000
    guards costs about 0.1 s, more than a first call should pay for a program that may run once."""

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
            self.run = _generated(self.split)
            return self.run()
        return object_guards_hold(*self.split)


def _generated(split: tuple) -> Callable[[], bool]:
    """Straight-line code checking the guards ``object_guards`` split (the module docstring)."""
    fast, same, chains, rest, (empty, hooked) = split
    out = _Writer()
    for obj, name, value in fast:
        out.equal(out.read(obj, (name,)), value)
    for holder, first, steps, value in same:
        out.same(out.read(holder, (first, *steps), table=type(holder) is dict), value)
    for holder, first, steps, value in chains:
        out.equal(out.read(holder, (first, *steps), table=type(holder) is dict), value)
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
