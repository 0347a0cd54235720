"""The region cache of one capture (Note [Region identity]): every body traced so far, found by its
region's function and call key and then by its guards, the identifiers in order of first trace, and the
counts ``efx.explain`` reports (traces and call sites per identifier).

A promoted trace that turns out unable to serve its calls is dropped: :meth:`RegionCache.snapshot` and
:meth:`RegionCache.restore` put the cache back as it was before that trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..graph.traced import TensorMeta, TracedGraph
from ..guards.check import guards_hold
from ..guards.kinds import Guard
from .decorator import Region


@dataclass
class PartialBackward:
    """A body's backward for some of its outputs only (Note [Partial backward])."""

    backward: fx.GraphModule
    saved: tuple[int, ...]  # which of the forward's saved values it reads, in its order
    grad_meta: list[TensorMeta | None]
    attr: str


@dataclass
class RegionBody:
    """One traced body of a region: the region cache entry behind an identifier."""

    identifier: str
    region: Region
    key: Any  # guards.identity.call_key of the call that traced it
    guards: tuple[Guard, ...]  # what the trace read (effectfx.guards.reads)
    traced: TracedGraph
    attr: str  # attribute name of its forward subgraph in calling graphs
    key_labels: tuple[str, ...] = ()  # what each part of ``key`` is, for explanations
    trace_seconds: float = 0.0
    partial: dict[tuple[bool, ...], PartialBackward] = field(default_factory=dict)  # by outputs with grads
    # a backward without the gradients of promoted operands: (its attr, which it keeps) -> (module, metas)
    restricted: dict[tuple[str, tuple[bool, ...]], tuple[fx.GraphModule, list]] = field(default_factory=dict)
    unpromotable: str | None = None  # why it cannot serve calls promoted to require grad, if it cannot
    # its trace (or a region it calls) looked at autograd state or ran an autograd.Function of the code's
    grad_sensitive: bool = False
    _saved_values: list[torch.Tensor] | None = None

    def saved_values(self, new_fake: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        """Fakes (made by ``new_fake(meta, requires_grad=False)``) with the metadata of the saved values the
        forward returns, shared by every call site's saved nodes."""
        if self._saved_values is None:
            metas = self.traced.saved_meta
            self._saved_values = [new_fake(metas[k], requires_grad=False) for k in self.traced.returned_saved]
        return self._saved_values

    @property
    def backward_attr(self) -> str:
        return self.attr + "_backward"

    @property
    def cache_key(self) -> tuple:
        """The body's whole identity: its call key and its guards (Note [Region identity])."""
        return (self.key, self.guards)


class RegionCache:
    """The bodies of one capture and their counts."""

    def __init__(self) -> None:
        self._bodies: dict[Any, RegionBody] = {}  # (region function, cache key) -> body
        self._candidates: dict[Any, list[RegionBody]] = {}  # (region function, key) -> bodies, first first
        self.trace_counts: dict[str, int] = {}  # identifier -> times traced
        self.calls: dict[str, int] = {}  # identifier -> call sites
        self._identifiers = 0
        # region function -> why its body cannot serve calls promoted to require grad (Note [Region identity])
        self.unpromotable: dict[Any, str] = {}

    def next_identifier(self) -> str:
        """Identifiers are given in order of first trace (Note [Region identity])."""
        self._identifiers += 1
        return f"subgraph_{self._identifiers - 1}"

    def find(self, region: Region, key: tuple, leaves: Sequence[Any]) -> RegionBody | None:
        """The first body with this key whose guards hold on these arguments."""
        found = self._candidates.get((region.fn, key), ())
        return next((b for b in found if guards_hold(b.guards, leaves)), None)

    def add(self, body: RegionBody) -> None:
        self._bodies[(body.region.fn, body.cache_key)] = body
        self._candidates.setdefault((body.region.fn, body.key), []).append(body)
        self.trace_counts[body.identifier] = self.trace_counts.get(body.identifier, 0) + 1

    def called(self, body: RegionBody) -> None:
        """One more call site of ``body``."""
        self.calls[body.identifier] = self.calls.get(body.identifier, 0) + 1

    @contextlib.contextmanager
    def uncounted_calls(self) -> Iterator[None]:
        """Region calls made meanwhile are not call sites of the program (a partial backward's retrace)."""
        counts = dict(self.calls)
        try:
            yield
        finally:
            self.calls = counts

    def bodies(self) -> list[RegionBody]:
        """Every body, in order of first trace."""
        return sorted(self._bodies.values(), key=lambda b: int(b.identifier.rsplit("_", 1)[1]))

    def snapshot(self) -> tuple:
        """The cache and its counts, to go back to when a trace is dropped."""
        return (self._identifiers, dict(self._bodies), {k: list(v) for k, v in self._candidates.items()},
                dict(self.trace_counts), dict(self.calls))

    def restore(self, state: tuple) -> None:
        self._identifiers, self._bodies, self._candidates, self.trace_counts, self.calls = state
