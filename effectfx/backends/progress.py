"""What a long first call is doing: one log record per Inductor segment as it is compiled, loaded from
disk, found in the process cache or falls back (``effectfx.backends.inductor_segments`` reports them).

The records go to the logger ``effectfx.inductor`` at INFO.  It is quiet by default -- a NullHandler, and
records propagate to whatever logging the program configured -- so a library never prints unasked.
:func:`log_compiles` (or ``EFFECTFX_LOG_COMPILES=1`` in the environment) attaches a handler printing to
stderr: on a terminal one progress line updated in place (tqdm's, when tqdm is installed), else plain lines.

The count ``n/m``: ``m`` is every segment lowered in this process that has not run yet, plus those that
ran since the count last completed (``n``); it completes when every lowered segment has run, and the next
segment lowered starts a new count.  A root segment deferred on its first run counts again when it compiles
on its second (``effectfx.backends.inductor_segments``), with the siblings that compile in the same call.
A segment that never runs (the full backward of a program whose callers backpropagate some outputs only)
keeps the count open while its program is alive.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from typing import Any

LOGGER = logging.getLogger("effectfx.inductor")
LOGGER.addHandler(logging.NullHandler())  # no "lastResort" printing to stderr when nothing is configured

_LOCK = threading.Lock()  # segments of two threads may finish at once
# weak: the segments of a program that was dropped before they ran stop counting
_PENDING: weakref.WeakSet[Any] = weakref.WeakSet()
_count = {"done": 0, "seconds": 0.0}  # since the count last completed


_THREAD = threading.local()


class uncounted:  # noqa: N801 -- a context manager, used as a function
    """Segments lowered in this thread inside it are not counted (tier 2, built to see whether its artifacts
    are saved: ``effectfx.backends.tiers``, which counts them when it compiles them)."""

    def __enter__(self) -> None:
        _THREAD.uncounted = True

    def __exit__(self, *exc: Any) -> None:
        _THREAD.uncounted = False


def lowered(segment: Any) -> None:
    """Count a segment made (by the lowering, or a new variant of a symbolic one) that has not run yet."""
    if getattr(_THREAD, "uncounted", False):
        return
    with _LOCK:
        if not _PENDING:  # every segment lowered before ran, or was dropped unrun: a new count
            _count["done"], _count["seconds"] = 0, 0.0
        _PENDING.add(segment)


def finished(segment: Any, where: str, nodes: int, outcome: str, seconds: float,
             why: str | None = None) -> None:
    """Log that ``segment`` (of ``where``, ``nodes`` nodes) was made runnable: ``outcome`` is "compiled",
    "loaded", "cache hit", "fell back" (``why``) or "deferred" (a root segment's first run), in
    ``seconds``."""
    with _LOCK:
        _PENDING.discard(segment)
        _count["done"] += 1
        _count["seconds"] += seconds
        n, total = _count["done"], _count["seconds"]
        m = n + len(_PENDING)
        if m == n:
            _count["done"], _count["seconds"] = 0, 0.0
    if not LOGGER.isEnabledFor(logging.INFO):
        return
    said = (f"fell back ({why})" if outcome == "fell back" and why else
            "deferred (runs un-compiled; compiles on its second run)" if outcome == "deferred" else outcome)
    LOGGER.info("segment %d/%d of %s (%d nodes): %s in %.2f s", n, m, where, nodes, said, seconds,
                extra={"efx_n": n, "efx_m": m, "efx_where": where, "efx_nodes": nodes,
                       "efx_outcome": outcome, "efx_why": why, "efx_seconds": seconds,
                       "efx_total": total})


def _tqdm() -> Any:
    """tqdm's bar class, or None: tqdm is not a dependency of effectfx (the bar is a nicety)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


_BAR = "effectfx inductor [{bar:20}] {n}/{total} segments{postfix}"  # tqdm writes ", " before the postfix


class ProgressHandler(logging.Handler):
    """Prints ``effectfx.inductor``'s records to stderr (the one current when a record comes, so a test's
    capture or a redirected stream is seen): a progress bar updated in place on a terminal, else lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.setFormatter(logging.Formatter("effectfx inductor: %(message)s"))
        self.bar: Any = None
        self.stream: Any = None  # the bar's (tqdm wraps it)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            n, m = getattr(record, "efx_n", None), getattr(record, "efx_m", None)
            bar = _tqdm() if n is not None and stream.isatty() else None
            if bar is None:
                self.close_bar()
                stream.write(self.format(record) + "\n")
                stream.flush()
                return
            self.show(bar, stream, record, n, m)
        except Exception:  # noqa: BLE001 -- logging must never break the program (logging's own rule)
            self.handleError(record)

    def show(self, bar: Any, stream: Any, record: logging.LogRecord, n: int, m: int) -> None:
        said = (f"{getattr(record, 'efx_total', 0.0):.1f} s  {getattr(record, 'efx_where', '')} "
                f"{getattr(record, 'efx_outcome', '')}")
        if self.bar is None or self.stream is not stream:
            self.close_bar()
            self.stream = stream
            self.bar = bar(total=m, initial=n, file=stream, ascii=" =", leave=True, mininterval=0,
                           dynamic_ncols=True, bar_format=_BAR, postfix=said)
        self.bar.total, self.bar.n = m, n
        self.bar.set_postfix_str(said, refresh=False)
        self.bar.refresh()
        if n == m:  # the count completed: leave the line, end it with a newline
            self.close_bar()

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.close_bar()
        super().close()


_HANDLER: ProgressHandler | None = None
_SET_LEVEL = False  # whether log_compiles set the logger's level (and so restores it)


def log_compiles(enabled: bool = True) -> None:
    """Print each Inductor segment's compile to stderr as it happens (a progress bar on a terminal), or
    stop printing.  The same as ``EFFECTFX_LOG_COMPILES=1`` in the environment."""
    global _HANDLER, _SET_LEVEL
    with _LOCK:
        if enabled and _HANDLER is None:
            _HANDLER = ProgressHandler()
            LOGGER.addHandler(_HANDLER)
            if not LOGGER.isEnabledFor(logging.INFO):  # the default level (the root's WARNING) drops them
                LOGGER.setLevel(logging.INFO)
                _SET_LEVEL = True
        elif not enabled and _HANDLER is not None:
            LOGGER.removeHandler(_HANDLER)
            _HANDLER.close()
            _HANDLER = None
            if _SET_LEVEL:
                LOGGER.setLevel(logging.NOTSET)
                _SET_LEVEL = False


if os.environ.get("EFFECTFX_LOG_COMPILES", "").strip() not in ("", "0"):
    log_compiles(True)


__all__ = ["LOGGER", "ProgressHandler", "finished", "log_compiles", "lowered"]
