"""Per-thread stacks: what the captures running on this thread have open (recorders, journals, print
captures), innermost last.  A capture runs on one thread; another thread calling the same code sees its own
stack, empty unless it captures too."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class ThreadStack(threading.local):
    """``items``: this thread's stack (a list, innermost last); :meth:`pushed` holds one item on it."""

    def __init__(self) -> None:  # (threading.local runs it once per thread)
        self.items: list[Any] = []

    @property
    def top(self) -> Any:
        """The innermost item, or None when the stack is empty."""
        return self.items[-1] if self.items else None

    @contextmanager
    def pushed(self, item: Any) -> Iterator[Any]:
        self.items.append(item)
        try:
            yield item
        finally:
            self.items.pop()

    @contextmanager
    def emptied(self) -> Iterator[None]:
        """Nothing on the stack while the block runs (the same stack after it)."""
        saved, self.items = self.items, []
        try:
            yield
        finally:
            self.items = saved
