"""Python state a captured function writes, replayed after every call.

Note [Python state]
~~~~~~~~~~~~~~~~~~~
A capture runs the user's code once, on fake tensors.  What that code writes into Python state its caller
can reach -- ``self.last = h.detach()``, ``self.buffer = self.buffer.half()``, ``del self.x``, a hook's
``acts.append(out.detach())`` or ``stats[name] = out.mean()``, a counter ``self.calls += 1`` -- would
otherwise happen once, at capture, and with fakes: later eager code on them quietly returns more fakes.
So no fake escapes a capture, and every such write happens at every call, with the call's values:

  * *what is seen.*  Before a trace runs, its :class:`Journal` snapshots the state it can reach
    (``capture.leaks.reachable``: the modules it is handed or reaches -- each one's ``__dict__``,
    parameters, buffers, submodules, and what its hooks hold --, the other objects among its arguments,
    its closure cells and named globals, two levels into lists, dicts and plain objects); a watched object
    (``guards.reads``) reports its attribute writes, and is snapshotted before the first.  When the code
    returns, the journal compares, puts the state back as it found it, and keeps each change as a
    ``program.python_writes.PythonWrite``: a ``dict`` item set or deleted (an attribute is an item of its
    object's ``__dict__``, a buffer of its module's ``_buffers``), a list extended, dropped from the front,
    assigned an item, or replaced.
  * *values.*  The tensors written are the graph's extra outputs -- the result is ``(out, tensors)`` --,
    plain values are constants, objects that existed before are written as they are, and lists, dicts and
    other pytrees the code made are made anew at each call from their leaves.  An object the code made
    that holds a tensor, or a symbolic size, cannot be made again: refused (``PythonStateError``).
  * *replay.*  The root's caller applies the writes after each run, before the call returns
    (``Program.finish``).  A region body is traced once for its call sites: its writes are returned with
    its outputs, and each call site makes them during the capture, into its own objects (a path from its
    arguments where the body reached them from there) and with its own results -- so a hook in a body
    appends once per call site per call, and the enclosing trace sees those writes as its own.
  * *guards.*  What the trace read of an object's attributes is guarded already (Note [Region
    identity]); what it may have read of a list's or dict's contents (in C: ``len(acts)``, ``k in d``) is
    not, so the root guards the state each such write starts from when it is plain data -- a counter's
    value, a key's absence, an empty list: appending to a list the code also empties looks the same as
    appending when it was empty --, and a program captured anew for the state its own writes made is
    the program from then on.  A plain value a program changes again at every new capture (a counter) would
    make a program per call: efx.compile refuses it at its second capture; a program of ``efx.capture``
    checks these guards before each run.  A region body guards none of this (its call sites fill one
    list in turn).
  * *refused.*  A write during the joint trace's backward (a backward hook) or in a branch of control flow
    runs a number of times no program replays: refused.  At the end of every capture a *leak check*
    (``capture.leaks.check_leaks``) walks the state a user can reach and refuses any fake still there.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten

from ..errors import PythonStateError
from ..graph.source import user_location
from ..guards.kinds import guard_on
from ..guards.labels import Label
from ..guards.reads import Reads, observing
from ..guards.values import MISSING, Path, Ref, freeze, plain_value
from ..program.python_writes import Kept, Op, Out, PythonState, PythonWrite, Tree, apply_writes
from ..threads import ThreadStack
from .leaks import MODULE_INTERNALS, MODULE_TABLES, Found, name_of, reachable

_JOURNALS = ThreadStack()


def active_journals() -> list[Journal]:
    """The journals of the traces running on this thread, outermost first."""
    return _JOURNALS.items


class Journal:
    """The Python state one trace (the root, or one region body) writes (Note [Python state])."""

    def __init__(self, tracer: Any, reads: Reads | None, where: str, root: bool) -> None:
        self.tracer, self.reads, self.where, self.root = tracer, reads, where, root
        self.snaps: dict[int, tuple[Found, Any]] = {}  # id(container) -> (what it is, its copy)
        self.known: set[int] = set()  # objects that existed before the trace: written as they are
        self.lines: dict[tuple[int, Any], str] = {}  # (id(object), attribute) -> the line that wrote it
        self.writes: tuple[PythonWrite, ...] = ()
        self.changes: list[tuple] = []
        self.values: list[Any] = []
        self.done = False

    # -- before and during the trace --------------------------------------------------------------------
    def start(self, roots: Iterable[tuple[Any, str, Path | None]]) -> None:
        for found in reachable(roots):
            self._snap(found)

    def _snap(self, found: Found) -> None:
        container = found.container
        if id(container) not in self.snaps:
            self.snaps[id(container)] = (found, list(container) if found.kind == "list" else dict(container))
            self.known.add(id(container))
            if found.holder is not None:
                self.known.add(id(found.holder))

    def found(self) -> list[Found]:
        """What the journal watched over: the containers it snapshotted."""
        return [found for found, _ in self.snaps.values()]

    def on_write(self, obj: Any, name: str) -> None:
        """A watched object's attribute is about to be written: its tables as they are now, and the line."""
        if self.done:
            return
        self.lines[(id(obj), name)] = user_location()
        what = type(obj).__name__
        path = None if self.root or self.reads is None else self.reads.path_of(obj)
        d = vars(obj)
        self._snap(Found("attrs", d, obj, "__dict__", what, None if path is None else (*path, "__dict__")))
        if isinstance(obj, torch.nn.Module):
            for slot in MODULE_TABLES:
                if isinstance(d.get(slot), dict):
                    where = None if path is None else (*path, slot)
                    self._snap(Found("attrs", d[slot], obj, slot, what, where))

    def ensure(self, container: Any, write: PythonWrite) -> None:
        """A region's call site is about to apply ``write`` to ``container``."""
        if not self.done and id(container) not in self.snaps:
            self._snap(Found("list" if isinstance(container, list) else "dict", container, None, "",
                             write.what, None))

    def __enter__(self) -> Journal:
        _JOURNALS.items.append(self)
        self._observing = observing(self.on_write)
        self._observing.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._observing.__exit__(None, None, None)
        active_journals().pop()
        if not self.done:  # the trace failed: nothing it wrote stays
            self.done = True
            self._restore()

    def wrap(self, run: Callable[[], Any]) -> Callable[[], Any]:
        """``run`` returning ``(out, tensors written)`` when the code wrote Python state."""
        def journaled() -> Any:
            out = run()
            self.finish()
            return (out, self.values) if self.writes else out

        return journaled

    # -- after the code ran ----------------------------------------------------------------------------
    def finish(self) -> None:
        """The writes, their values and guards; the state put back as the trace found it."""
        writes: list[PythonWrite] = []
        changed = [(found, before) for found, before in self.snaps.values() if not _same(found, before)]
        try:
            for found, before in changed:
                if found.kind == "list":
                    writes += self._list_writes(found, before)
                else:
                    writes += self._dict_writes(found, before)
        finally:
            self.done = True
            self._restore(changed)
        self.writes = tuple(writes)

    def _restore(self, changed: list[tuple[Found, Any]] | None = None) -> None:
        for found, before in self.snaps.values() if changed is None else changed:
            if changed is None and _same(found, before):
                continue
            container = found.container
            if found.kind == "list":
                container[:] = before
                continue
            for key in [k for k in container if k not in before]:
                del container[key]
            for key, value in before.items():
                if container.get(key, MISSING) is not value:
                    container[key] = value

    def check_unchanged(self, when: str) -> None:
        """After the code's trace: it wrote nothing more (``when``: while its backward was derived, where
        a backward hook writes at every backward; in a branch of control flow)."""
        for found, before in self.snaps.values():
            if not _same(found, before):
                self._restore()
                raise PythonStateError(
                    f"{self.where} writes {name_of(found.what)} {when}: such a write is made once at "
                    "capture, where eager makes it a number of times a program does not replay (Note "
                    "[Python state]). Write it in the forward, outside control flow, or keep the value in a "
                    "tensor the code returns."
                )

    def state(self) -> PythonState | None:
        """The root's writes as a program holds them: with the guards on each plain value it changes."""
        if not self.writes:
            return None
        guards = tuple(dict.fromkeys(self.reads.guards[change[0]] for change in self.changes))
        return PythonState(self.writes, guards, tuple(self.changes))

    # -- the changes ------------------------------------------------------------------------------------
    def _dict_writes(self, found: Found, before: dict) -> list[PythonWrite]:
        now = found.container
        internal = found.slot == "__dict__" and isinstance(found.holder, torch.nn.Module)
        writes = []
        for key in before:
            if key not in now and not (internal and key in MODULE_INTERNALS):
                self._depends(found, key, before[key], MISSING)
                writes.append(PythonWrite(Op.DELETE, self._target(found), key, None, self._what(found, key)))
        for key, value in now.items():
            old = before.get(key, MISSING)
            if old is value or internal and key in MODULE_INTERNALS:
                continue
            if found.slot == "_parameters" and isinstance(value, FakeTensor):
                self._refuse(found, key, "replaces a parameter with a tensor it computes")
            self._depends(found, key, old, value)
            writes.append(PythonWrite(Op.SET, self._target(found), key, self._template(value, found, key),
                                      self._what(found, key)))
        return writes

    def _list_writes(self, found: Found, before: list) -> list[PythonWrite]:
        now, n = found.container, len(before)
        target, what = self._target(found), self._what(found, None)
        self._depends(found, None, before, now)
        # the most of the old items the new list starts with: items dropped from the front, then new ones
        # appended (``append``, ``extend``, ``pop(0)``: a window)
        drop = next(r for r in range(n + 1) if len(now) >= n - r and all(map(operator.is_, now, before[r:])))
        window = drop < n or n == 0  # (a list empty before is appended to: Note [Python state])
        if window:
            new = now[n - drop:]
        elif len(now) == n:  # items assigned
            new = [v for v, was in zip(now, before) if v is not was]
        else:  # emptied, then filled
            new = now
        old = {id(v) for v in before if not plain_value(v)}
        if any(id(v) in old for v in new):  # (an old item a program would hold as it was at capture)
            self._refuse(found, None, "inserts into or reorders a list of objects")
        if window:
            writes = [PythonWrite(Op.DROP, target, drop, None, what)] if drop else []
            return writes + [PythonWrite(Op.EXTEND, target, None, self._template(now[n - drop:], found, None),
                                         what)]
        if len(now) == n:
            return [PythonWrite(Op.SET, target, i, self._template(v, found, i), what)
                    for i, (v, was) in enumerate(zip(now, before)) if v is not was]
        return [PythonWrite(Op.REPLACE, target, None, self._template(list(now), found, None), what)]

    def _depends(self, found: Found, key: Any, old: Any, new: Any) -> None:
        """The root guards the plain state a write starts from where its reads were not seen (a list's or
        dict's contents, an object no trace watched), and notes a guarded plain value it changes."""
        if not self.root:
            return
        holder = found.holder if found.kind == "attrs" else found.container
        path = self.reads.path_of(holder)
        if key is not None:
            path = (*path, key if found.kind == "attrs" else ("item", key) if plain_value(key) else
                    ("key", Ref(key)))
        frozen = old if old is MISSING or plain_value(old) else freeze(old)
        seen = found.kind == "attrs" and hasattr(type(holder), "__efx_watched__")
        if frozen is not MISSING or old is MISSING:
            if not seen:
                self.reads.guards.setdefault(path, guard_on(path, old, structural=False))
        after = new if new is MISSING or plain_value(new) else freeze(new)
        if (path in self.reads.guards and (after is not MISSING or new is MISSING)
                and (frozen is not MISSING or old is MISSING) and frozen != after):
            line = self.lines.get((id(holder), key), "")
            self.changes.append((path, frozen, after, self._what(found, key), line))

    def _template(self, value: Any, found: Found, key: Any) -> Any:
        """How each call makes ``value`` again: a tensor is an output, plain data a constant, an object
        that existed before itself, a list/dict/pytree the code made is made anew from its leaves."""
        if isinstance(value, torch.Tensor):
            if not isinstance(value, FakeTensor) and self.root:
                return Kept(value)  # (a parameter: that very tensor)
            self.values.append(self.tracer.to_fake(value))  # (in a body, each call site's own)
            return Out(len(self.values) - 1)
        if isinstance(value, Label):
            Label.mark_used(value)  # the body bakes its value in
            return str.__str__(value)
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            self._refuse(found, key, f"stores a symbolic size ({value})")
        if plain_value(value):
            return value
        if id(value) in self.known:
            return Kept(value)
        leaves, spec = tree_flatten(value, is_leaf=lambda v: v is not value and id(v) in self.known)
        if spec.is_leaf():
            if _holds_fake(value):
                self._refuse(found, key, f"stores a {type(value).__name__} it made that holds a tensor it "
                             "computed (pytree does not know how to make one again)")
            return Kept(value)
        return Tree(spec, tuple(self._template(leaf, found, key) for leaf in leaves))

    def _target(self, found: Found) -> Path:
        if found.path is not None and not self.root:
            return found.path
        return (("id", Ref(found.container)),)

    def _what(self, found: Found, key: Any) -> str:
        what = name_of(found.what)
        if key is None:
            return what
        if found.kind == "attrs":
            return f"{what}.{key}"
        return f"{what}[{key!r}]"

    def _refuse(self, found: Found, key: Any, why: str) -> None:
        holder = found.holder if found.kind == "attrs" else found.container
        line = self.lines.get((id(holder), key)) or "a line effectfx does not see (a list or dict write)"
        raise PythonStateError(
            f"{self.where} {why} in {self._what(found, key)} (at {line}): effectfx writes Python state "
            "again after each call with the call's values (Note [Python state]), and cannot make this one.\n"
            "Store tensors, plain values, or lists, dicts and tuples of them (a class registered with "
            "torch.utils._pytree works too), or return the value and store it outside the compiled code."
        )


def _same(found: Found, before: Any) -> bool:
    """Whether a container holds what its snapshot holds, by identity (in C: this runs over every
    container of the model, at every capture)."""
    now = found.container
    if len(now) != len(before):
        return False
    if found.kind == "list":
        return all(map(operator.is_, now, before))
    return all(map(operator.is_, now.values(), before.values())) and now.keys() == before.keys()


def _holds_fake(value: Any, depth: int = 2) -> bool:
    if isinstance(value, FakeTensor):
        return True
    if depth == 0:
        return False
    if isinstance(value, (list, tuple)):
        items: Iterable[Any] = value
    elif isinstance(value, dict):
        items = value.values()
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        items = vars(value).values()
    else:
        return False
    return any(_holds_fake(v, depth - 1) for v in items)


def replay(writes: tuple[PythonWrite, ...], values: list[Any], leaves: list[Any]) -> None:
    """A region's call site makes its body's writes, into its own objects, with its own results; every
    enclosing trace's journal sees the state before each."""
    journals = active_journals()

    def before(container: Any, write: PythonWrite) -> None:
        for journal in journals:
            journal.ensure(container, write)

    apply_writes(writes, values, leaves, before)


def refuse_writes(run: Callable[[], Any], tracer: Any, where: str) -> Any:
    """Run ``run`` (a branch of control flow: traced though only one branch runs, or a loop's body,
    traced once for any number of iterations) refusing any Python state it writes."""
    journal = Journal(tracer, None, where, root=False)
    for outer in active_journals():  # (a branch reaches what its enclosing traces reach)
        for found, _ in outer.snaps.values():
            journal._snap(found)
    with journal:
        out = run()
        journal.check_unchanged("inside a branch or loop of control flow")
        journal.done = True
    return out


__all__ = ["Journal", "active_journals", "refuse_writes", "replay"]
