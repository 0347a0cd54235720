"""Labels (Note [Region identity]): a ``str`` a region body read, that notices any use of its value.  What a
body does with it decides whether it is an operand of the body or specialized (``effectfx.regions.labels``);
the recorder that handed it out is ``effectfx.regions.reads``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _observed(method: str) -> Callable[..., Any]:
    base = getattr(str, method)

    def observe(self: Label, *args: Any) -> Any:
        Label.mark_used(self)
        args = tuple(str.__str__(a) if isinstance(a, Label) else a for a in args)
        return base(str.__str__(self), *args)

    observe.__name__ = method
    return observe


class Label(str):
    """A ``str`` a body read, that reports the first time anything looks at its value.

    ``owner`` made it (the body's recorder, which may pass it to the body as an operand); ``watchers`` are
    the other recorders that saw the read and must guard on its value once it is used.
    """

    def __new__(cls, value: str, owner: Any, path: tuple, on_use: Callable[[Label], None]) -> Label:
        self = super().__new__(cls, value)
        object.__setattr__(self, "_efx", {"owner": owner, "path": path, "used": False,
                                          "on_use": on_use, "watchers": [(owner, path)]})
        owner.guards[path] = ("str",)
        return self

    def state(self) -> dict:
        return object.__getattribute__(self, "_efx")

    def watch(self, reads: Any, path: tuple) -> None:  # reads: a regions.reads.Reads
        st = Label.state(self)
        if st["used"]:
            reads.specialize(path, str.__str__(self))
        else:
            st["watchers"].append((reads, path))
            reads.guards.setdefault(path, ("str",))

    def mark_used(self) -> None:
        st = Label.state(self)
        if st["used"]:
            return
        st["used"] = True
        value = str.__str__(self)
        for reads, path in st["watchers"]:
            reads.specialize(path, value)
        st["on_use"](self)

    def __getattribute__(self, name: str) -> Any:
        # isinstance() asks for __class__, torch's argument parser probes for __torch_function__
        if name in ("state", "watch", "mark_used", "__class__") or name.startswith("__torch"):
            return object.__getattribute__(self, name)
        Label.mark_used(self)
        return getattr(str.__str__(self), name)

    def __str__(self) -> str:
        Label.mark_used(self)
        return str.__str__(self)

    def __repr__(self) -> str:
        Label.mark_used(self)
        return repr(str.__str__(self))

    def __hash__(self) -> int:
        Label.mark_used(self)
        return hash(str.__str__(self))

    def __reduce__(self) -> Any:
        Label.mark_used(self)
        return (str, (str.__str__(self),))

    for _m in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__len__", "__getitem__",
               "__iter__", "__contains__", "__add__", "__mul__", "__rmul__", "__mod__", "__rmod__",
               "__format__", "__sizeof__", "__getnewargs__"):
        locals()[_m] = _observed(_m)
    del _m

    def __radd__(self, other: Any) -> Any:
        Label.mark_used(self)
        return other + str.__str__(self)


def raw(value: Any) -> Any:
    """The plain ``str`` behind a Label, without counting as a use; anything else unchanged."""
    return str.__str__(value) if isinstance(value, Label) else value
