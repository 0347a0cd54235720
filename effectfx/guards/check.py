"""Checking guards (Note [Region identity]): the one evaluator, for region bodies and compiled programs.

Its slow path is the interpretation: each guard's path read from its root -- a call site's argument or an
object -- and ``Guard.holds`` asked of the value found (:func:`guards_hold`; :func:`failed_guards` for the
words of ``efx.compile``).  A region body's guards are checked this way, on every call site's own
arguments, as are a compiled program's first calls.

A compiled program's guards are checked before every call (:class:`GuardChecker`).  Checked one by one,
GPT-2's 800 guards (12 layers, training; chains of attribute reads: submodules, config values) cost 1.5 ms a
call, most of it re-reading the same prefixes (``model.transformer.h``) and the loop itself.  From its
third call they are compiled (``effectfx.guards.emit``), each kind adding itself (``Guard.tree_check``,
``Guard.python_check``): as a tree of torch's C++ guard managers, each distinct prefix read once, then
straight-line Python for what the tree cannot express (an attribute found missing, an object's state, a
dict keyed by objects, hooks), then the interpretation for what neither can.  GPT-2's guards cost about
50 us a call this way (12 layers: 35 in the tree, 15 in the code, 3 of which say that none of its 176
modules got an instance ``forward``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .emit import Tree, Writer
from .hooks import HOOK_STEPS, HOOKS, hook_step, hooks_of
from .kinds import Guard
from .reads import active_reads, report_read
from .values import MISSING, Path


def step(value: Any, s: Any) -> Any:
    """What one step of a path reads from ``value`` (MISSING where there is nothing)."""
    if s == HOOKS:  # a module's hooks (or torch's global ones, from the GLOBAL root): guards.hooks
        found = hooks_of(value)
        return MISSING if found is None else found
    if isinstance(s, tuple) and s[0] == "index":  # an element of a tuple (Note [Float inputs])
        return value[s[1]] if type(value) is tuple and s[1] < len(value) else MISSING
    if isinstance(s, tuple) and s[0] in HOOK_STEPS:  # a string a hook closes over (hooks.hook_labels)
        return hook_step(value, s)
    if isinstance(s, tuple):  # ("item", key) of a dict; ("key", Ref(obj)): keyed by an object (a tensor)
        key = s[1].obj if s[0] == "key" else s[1]
        return value.get(key, MISSING) if isinstance(value, dict) else MISSING
    try:
        return getattr(value, s)
    except AttributeError:
        return MISSING


def resolve(path: Path, leaves: Sequence[Any], reported: dict | None = None) -> Any:
    """The value at ``path`` from a call site's arguments.  Every step is a read its caller depends on
    (the caller's recorders see it: Note [Region identity]), also from an object no trace watches -- a
    module whose call reuses a body.  ``reported``: the reads made so far for one call site (guards share
    their first steps), reported once each."""
    root = path[0]
    value = leaves[root[1]] if root[0] == "leaf" else root[1].obj
    recorded = bool(active_reads())
    for s in path[1:]:
        if value is MISSING:
            return MISSING
        owner, value = value, step(value, s)
        reports = not hasattr(type(owner), "__efx_watched__") or isinstance(s, tuple) and s[0] == "hook"
        if recorded and reports and not isinstance(owner, torch.Tensor):
            # (a watched object reports its own attribute reads; a tensor's autograd state is its caller's)
            key = (id(owner), s)
            if reported is not None and key in reported:
                value = reported[key]
            else:
                value = report_read(owner, s, value, watch=False)
                if reported is not None:
                    reported[key] = value
    return value


def set_at(path: Path, value: Any) -> None:
    """Write ``value`` where ``path`` (from an object) ends: a compiled training step's writes of the
    state it set (Note [Training step])."""
    obj = path[0][1].obj
    for s in path[1:-1]:
        obj = getattr(obj, s) if isinstance(s, str) else obj[s[1].obj if s[0] == "key" else s[1]]
    last = path[-1]
    if isinstance(last, str):
        setattr(obj, last, value)
    else:
        obj[last[1].obj if last[0] == "key" else last[1]] = value


def _failing(guards: Sequence[Guard], leaves: Sequence[Any]) -> Iterator[tuple[Guard, Any]]:
    """The interpretation: each guard that does not hold now, with the value found at its path."""
    reported: dict = {}
    for guard in guards:
        value = resolve(guard.path, leaves, reported)
        if not guard.holds(value):
            yield guard, value


def guards_hold(guards: Sequence[Guard], leaves: Sequence[Any] = ()) -> bool:
    """Whether every guard holds on a call site's arguments ``leaves`` (none: a compiled program's)."""
    return next(_failing(guards, leaves), None) is None


def failed_guards(guards: Sequence[Guard], leaves: Sequence[Any] = ()) -> list[tuple[Guard, Any]]:
    """``(guard, found)`` for each guard that does not hold now."""
    return list(_failing(guards, leaves))


class GuardChecker:
    """Whether every guard of a compiled program holds now, called with no arguments.  Its first calls
    interpret the guards; from the third it runs their tree and code: making those for a 48-layer model's
    3,000 guards costs about 0.1 s, more than a first call should pay for a program that may run once."""

    __slots__ = ("guards", "calls", "run")

    def __init__(self, guards: tuple[Guard, ...]) -> None:
        self.guards = guards
        self.calls = 0
        self.run: Callable[[], bool] | None = None

    def __call__(self) -> bool:
        run = self.run
        if run is not None:
            return run()
        self.calls += 1
        if not guards_hold(self.guards):
            return False
        if self.calls > 2:
            # made only where every guard holds: torch's accessors assume the guards held when they were
            # made, and skip a dict that has not changed since (a stale program's tree would pass)
            self.run = _compiled(self.guards)
        return True

    def failed(self) -> list[tuple[Guard, Any]]:
        """``(guard, found)`` for each guard that does not hold now."""
        return failed_guards(self.guards)


def _compiled(guards: tuple[Guard, ...]) -> Callable[[], bool]:
    """The guards as a C++ tree, then Python code, then the interpretation of the rest (the module
    docstring)."""
    tree, out = Tree(), Writer()
    rest = [g for g in guards if not g.tree_check(tree)]
    interpreted = tuple(g for g in rest if not g.python_check(out))
    code = out.function((lambda: guards_hold(interpreted)) if interpreted else None)
    root, roots = tree.root, tree.roots
    if code.source == _EMPTY:  # type: ignore[attr-defined]
        check = lambda: root.check(roots)  # noqa: E731
    else:
        check = lambda: root.check(roots) and code()  # noqa: E731
    check.source = f"# C++ guards\n{tree.text()}\n# then\n{code.source}"  # type: ignore[attr-defined]
    return check


_EMPTY = "def check():\n    return True\n"
