"""What a trace reads from Python objects: the facts its guards hold (Note [Region identity]).

During a capture, every object a trace reaches through attributes -- the modules passed to regions, their
submodules, config objects hanging off them, objects held in closures and globals -- is *watched*: its
class is swapped, for the capture only and on the capturing thread only, for a subclass whose attribute
lookups report ``(object, name, value)`` to every active :class:`Reads`.  A read of a ``str`` inside a
region body hands the body a :class:`Label` instead, a ``str`` that notices when its value is looked at
(compared, hashed, formatted, sliced...).  A label that is only ever passed to effectful ops becomes an
operand of the body (``effectfx.guards.labels``); any other use specializes the body on its value.
Its attribute writes (``__setattr__``, ``__delattr__``) are reported too: the trace's own values are not
guarded, and the Python state a trace writes is replayed after each call (Note [Python state]).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from ..threads import ThreadStack
from .floats import active_floats, floats_or_tuple
from .kinds import Equals, Guard, IsStr, ObjectState, OfType, SameObject, guard_on
from .labels import Label
from .values import MISSING, Path, Ref, class_of, plain_value, watchable

# nn.Module's own bookkeeping: read on every call, never part of what a layer computes; but its tables of
# parameters, buffers and submodules, read only to iterate them: their key order (``kinds.Keys``)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module())) - {"training", "_parameters", "_buffers", "_modules"}

_READS = ThreadStack()  # the recorders of this thread
_OBSERVERS = ThreadStack()  # the write observers of this thread


def active_reads() -> list[Reads]:
    """The recorders of this thread, outermost first (the root's, then one per region body being traced)."""
    return _READS.items


def recording(reads: Reads) -> AbstractContextManager[Reads]:
    return _READS.pushed(reads)


def unrecorded() -> AbstractContextManager[None]:
    """effectfx's own reads (a walk of a module's submodules or parameters during a capture): no guards."""
    return _READS.emptied()


def _fresh_each_read(owner: Any, step: Any, value: Any) -> bool:
    """Whether reading attribute ``step`` of ``owner`` again gives another object (read unrecorded)."""
    if not isinstance(step, str):
        return False
    with unrecorded():
        try:
            return getattr(owner, step) is not value
        except Exception:  # noqa: BLE001 -- a property that fails the second time: keep the identity guard
            return False


# -- watching objects -------------------------------------------------------------------------------------


_WATCHED_CLASSES: dict[type, type] = {}
_CLASS_LOCK = threading.Lock()


def report_read(obj: Any, name: Any, value: Any, watch: bool = True) -> Any:
    """Tell every active recorder that ``name`` (an attribute, or ``("item", key)``) of ``obj`` was read
    as ``value``; returns what the reader gets (a Label, for a string a body reads).  With ``watch``, the
    object read is watched from now on; a reader that reports each of its reads itself (a guard's path)
    need not pay for that."""
    stack = _READS.items
    if not stack or name[:2] == "__" or (name in _MODULE_INTERNALS and isinstance(obj, torch.nn.Module)):
        return value
    if isinstance(value, torch.Tensor):
        for reads in stack:
            reads.tensor_read(obj, name, value)
        return value  # tensors are lifted operands
    if callable(value) and not isinstance(value, torch.nn.Module) and getattr(value, "__self__", None) is obj:
        return value  # methods come with the (keyed) class
    value = stack[-1].read(obj, name, value, innermost=True, watch=watch)  # first: it may hand out a Label
    for reads in stack[:-1]:
        reads.read(obj, name, value, watch=watch)
    return value


def report_write(obj: Any, name: str) -> None:
    """Attribute ``name`` of ``obj`` is about to be set or deleted by the code being traced (a watched
    object's ``__setattr__``/``__delattr__``): a later read of it is the trace's own value, not a fact to
    guard, and every write observer (``effectfx.capture.python_state``) sees the object before the write."""
    for reads in _READS.items:
        reads.written.add((id(obj), name))
    for observer in _OBSERVERS.items:
        observer(obj, name)


def observing(observer: Callable[[Any, str], None]) -> AbstractContextManager[Any]:
    """``observer(obj, name)`` is told of every attribute write :func:`report_write` sees on this thread."""
    return _OBSERVERS.pushed(observer)


def same_class(cls: type, namespace: dict[str, Any]) -> type:
    """A subclass of ``cls`` with only ``namespace`` of its own, standing in for ``cls`` itself (a recording
    subclass, a compiled module's class): what a base's ``__init_subclass__`` added to it is taken away
    (transformers' checkpointing layers wrap ``forward`` again there), so it inherits everything as it is."""
    sub = type(cls.__name__, (cls,), namespace)
    for name in set(vars(sub)) - set(namespace) - {"__doc__", "__dict__", "__weakref__"}:
        delattr(sub, name)
    return sub


def _watched_class(cls: type) -> type:
    with _CLASS_LOCK:
        sub = _WATCHED_CLASSES.get(cls)
        if sub is not None:
            return sub
        base_getattribute = cls.__getattribute__
        base_getattr = getattr(cls, "__getattr__", None)

        def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
            if name == "__class__":
                return cls
            try:
                value = base_getattribute(self, name)
            except AttributeError:
                if base_getattr is None:
                    report_read(self, name, MISSING)
                raise
            return report_read(self, name, value)

        def __setattr__(self: Any, name: str, value: Any) -> None:  # noqa: N807
            report_write(self, name)
            cls.__setattr__(self, name, value)

        def __delattr__(self: Any, name: str) -> None:  # noqa: N807
            report_write(self, name)
            cls.__delattr__(self, name)

        namespace: dict[str, Any] = {"__getattribute__": __getattribute__, "__efx_watched__": cls,
                                     "__setattr__": __setattr__, "__delattr__": __delattr__,
                                     "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        if base_getattr is not None:
            def __getattr__(self: Any, name: str) -> Any:  # noqa: N807
                try:
                    value = base_getattr(self, name)
                except AttributeError:
                    report_read(self, name, MISSING)
                    raise
                return report_read(self, name, value)

            namespace["__getattr__"] = __getattr__
        if "__slots__" in cls.__dict__:
            namespace["__slots__"] = ()
        sub = _WATCHED_CLASSES[cls] = same_class(cls, namespace)
        return sub


class Watcher:
    """The objects one capture watches; ``restore()`` gives every one its class back."""

    def __init__(self) -> None:
        self.watched: dict[int, tuple[Any, type]] = {}

    def watch(self, obj: Any) -> bool:
        if id(obj) in self.watched:
            return True
        if not watchable(obj) or hasattr(type(obj), "__efx_watched__"):
            return False
        cls = type(obj)
        try:
            obj.__class__ = _watched_class(cls)
        except TypeError:  # an incompatible layout: read by identity instead
            return False
        self.watched[id(obj)] = (obj, cls)
        return True

    def restore(self) -> None:
        for obj, cls in self.watched.values():
            object.__setattr__(obj, "__class__", cls)
        self.watched.clear()


# -- recorders ------------------------------------------------------------------------------------------


class Reads:
    """The reads of one trace, as guards: ``path -> Guard`` (the first read of a path wins).

    A body's recorder (``structural``) names objects by their path from the body's arguments, so a guard
    can be checked against another call site's arguments; objects it cannot reach from them are named by
    identity.  The root's recorder names everything by identity: a compiled program runs on these very
    objects.
    """

    def __init__(self, watcher: Watcher, structural: bool,
                 on_label: Callable[..., Any] | None = None) -> None:
        self.watcher = watcher
        self.structural = structural
        self.paths: dict[int, Path] = {}
        self.named: list[Any] = []
        self.guards: dict[Path, Guard] = {}
        self.on_label = on_label  # makes a Label for a str the body read (bodies only)
        # id(tensor) -> (object, step) it was first read from (the root's: a compiled program reads it
        # there again at each call, so a replaced tensor attribute is seen)
        self.tensor_sources: dict[int, tuple[Any, Any]] = {}
        # (id(object), attribute) the trace wrote: reading it back reads the trace's own value
        self.written: set[tuple[int, str]] = set()

    def root(self, obj: Any, path: Path) -> None:
        """``obj`` is reachable at ``path`` (an argument of the body); watch what is read from it."""
        self.paths.setdefault(id(obj), path)
        self.watcher.watch(obj)

    def path_of(self, obj: Any) -> Path:
        path = self.paths.get(id(obj))
        return path if path is not None else (("id", Ref(obj)),)

    def read(self, owner: Any, step: Any, value: Any, innermost: bool = False, watch: bool = True) -> Any:
        path = (*self.path_of(owner), step)
        if (id(owner), step) in self.written:
            pass  # what the trace itself wrote (Note [Python state]): nothing the call must hold
        elif isinstance(value, Label) and not self.structural:
            self.specialize(path, str.__str__(value))  # the root passes the value itself: guard it
        elif isinstance(value, Label):
            value.watch(self, path)
        elif isinstance(value, str) and innermost and self.on_label is not None and isinstance(
                self.guards.get(path), (IsStr, type(None))):
            return self.on_label(path, value)
        elif floats_or_tuple(value) and not self.structural and innermost and (floats := active_floats()):
            cell = floats.cell(path, value)  # a float that changed: an input (Note [Float inputs])
            if cell is not None:
                for guard in floats.guards(path, value):
                    self.guards.setdefault(guard.path, guard)
                return cell
            self.guards.setdefault(path, guard_on(path, value, self.structural))
        elif path not in self.guards:
            guard = guard_on(path, value, self.structural)
            if isinstance(guard, (SameObject, ObjectState)) and _fresh_each_read(owner, step, value):
                # a property that makes a new object per read (transformers' config.per_layer_config): by
                # identity it would fail at every call; its class, and the reads through it, say it all
                guard = OfType(path, class_of(value))
            self.guards[path] = guard
        if not plain_value(value) and value is not MISSING and (not watch or self.watcher.watch(value)):
            if id(value) not in self.paths:
                self.paths[id(value)] = path
                self.named.append(value)  # its id names it only while it lives
        elif step == "_modules" and type(value) is dict and isinstance(owner, torch.nn.Module):
            self._children(path[:-1], value, watch)
        return value

    def _children(self, path: Path, modules: dict, watch: bool) -> None:
        """A module's submodules reached through its table (``nn.Sequential`` and ``ModuleList`` iterate
        ``_modules.values()``): each is watched as ``path.<name>`` -- its reads are guards as a ``self.a``
        read's are -- and is that module (by class, in a body)."""
        for name, child in modules.items():
            if isinstance(child, torch.nn.Module) and id(child) not in self.paths and (
                    not watch or self.watcher.watch(child)):
                at = (*path, name)
                self.paths[id(child)] = at
                self.named.append(child)
                self.guards.setdefault(at, guard_on(at, child, self.structural))

    def tensor_read(self, owner: Any, step: Any, value: torch.Tensor) -> None:
        if not self.structural:
            self.tensor_sources.setdefault(id(value), (owner, step))

    def operand(self, path: Path) -> None:
        """A label was read at ``path``: while it is an operand, any str will do."""
        self.guards.setdefault(path, IsStr(path))

    def specialize(self, path: Path, value: str) -> None:
        """The label read at ``path`` was used: the body holds its value."""
        self.guards[path] = Equals(path, str, value)
