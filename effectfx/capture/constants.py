"""The values of tensors a capture computes from Python constants only: known, so used as eager.

``torch.div(1024, 256, rounding_mode="trunc")`` used as a size (``torch.ones(64, d)``, ``x.view(b, d)``) asks
for the value of a tensor -- ``aten._local_scalar_dense`` -- which a fake tensor does not have.  When every
input of the tensor is a Python constant, its value is the same on every call and eager's Python sees it:
the tracer keeps a *real twin* beside each such fake, computed by running the same op on the twins of its
inputs (on the CPU, with no mode seeing it), and answers a value query from the twin.  The value is baked
into the graph as eager's Python would see it (``torch.ones(64, 4)``); the ops that made the tensor are
recorded as usual.

A fake gets a twin only when it is exact and cheap:

* the op is an aten op with no effect, draws no random numbers and is not an ``empty`` (whose values are
  whatever the memory held), and its results are CPU tensors of at most :data:`LIMIT` elements;
* every tensor it reads has a twin: factory ops with plain arguments (``ones``, ``arange``, ``full``), a
  ``torch.tensor(...)`` literal (``lift_fresh`` of the data torch just made), pure ops and views of such
  tensors, and in-place ops on them (run in place on the twins, so the twins' own aliasing follows eager's).
  An input, a parameter, a buffer, a region's operand or a random op is never a constant.

A twin remembers the node its fake was bound to when it was computed; any other rebinding of the fake (a
write the twins did not follow: an in-place op reading an unknown tensor, a region or a collective writing
it, a write into an alias) leaves the twin stale, and a stale twin is never used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from ..graph.symbols import SYM_TYPES, has_symbols

aten = torch.ops.aten

LIMIT = 1024  # elements: a constant bigger than this is data, not a size or a flag
_RANDOM = torch.Tag.nondeterministic_seeded
_UNDEFINED = {aten.empty.memory_format, aten.empty_like.default, aten.empty_strided.default,
              aten.new_empty.default, aten.new_empty_strided.default, aten.empty_permuted.default}
_LITERALS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_CPU = torch.device("cpu")
UNKNOWN = object()  # what :meth:`Constants.value` returns for a tensor whose value capture cannot know


@contextlib.contextmanager
def _unseen() -> Iterator[None]:
    """Real computation no mode sees (the tracer, the torch-function modes), without autograd: a twin is a
    value."""
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch(), torch.no_grad():
        yield


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an op's result or arguments (a tensor, or tuples and lists of them), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


class Constants:
    """The real twins of one capture's constant fakes (module docstring).  ``tracer`` is the Tracer: its
    current builder says which node each fake is bound to, and ``real_of`` what a lifted fake stands for."""

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer
        self.twins: dict[int, tuple[torch.Tensor, torch.Tensor, fx.Node | None]] = {}  # id(fake) -> ...

    def _twin(self, value: Any) -> torch.Tensor | None:
        entry = self.twins.get(id(value))
        if entry is None or self.tracer.builder.values.get(id(value)) is not entry[2]:
            return None  # never a constant, or rebound since (stale)
        return entry[1]

    def _known(self, args: tuple, kwargs: dict) -> bool:
        # on every recorded op: a miss on the first tensor (any activation) answers at once
        for group in (args, kwargs.values()):
            for a in group:
                if isinstance(a, torch.Tensor):
                    if self._twin(a) is None:
                        return False
                elif isinstance(a, (list, tuple)):
                    for b in a:
                        if isinstance(b, SYM_TYPES) or isinstance(b, torch.Tensor) and self._twin(b) is None:
                            return False
                elif isinstance(a, SYM_TYPES):  # a symbolic size: no value (Note [Symbolic shapes])
                    return False
        return True

    def _real(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, list[torch.Tensor]]:
        """``func`` on the twins of its arguments, and those twins."""
        reals: list[torch.Tensor] = []

        def swap(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                reals.append(self._twin(v))  # type: ignore[arg-type]  (known: every tensor has one)
                return reals[-1]
            if isinstance(v, (list, tuple)):
                return type(v)(swap(x) for x in v)
            return v

        real_args, real_kwargs = swap(args), {k: swap(v) for k, v in kwargs.items()}
        with _unseen():
            return func(*real_args, **real_kwargs), reals

    def value(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """The result of the value query ``func`` (``_local_scalar_dense``, ``item``, ``is_nonzero``,
        ``equal``) when its tensors are constants, else :data:`UNKNOWN`."""
        if not _tensors((args, tuple(kwargs.values()))) or not self._known(args, kwargs):
            return UNKNOWN
        return self._real(func, args, kwargs)[0]

    def prepare(self, func: Any, args: tuple, kwargs: dict, out: Any, written: list[torch.Tensor]
                ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Called once ``func`` (an op with no effect) ran on fakes, before the tracer binds its results:
        the twins of its results when its inputs have them (``written``: the tensors it writes in place,
        updated through their twins), for :meth:`commit`; None when they stay unknown."""
        if func in _LITERALS:  # torch.tensor(data): its data was made by torch, for this call alone
            real = self.tracer.real_of.get(id(args[0]))
            if (real is None or real.device != _CPU or real.numel() > LIMIT
                    or not isinstance(out, torch.Tensor)):
                return None
            with _unseen():  # the program's lifted copy must never be written through a twin
                return [(out, real.clone())]
        if (not self._known(args, kwargs) or _RANDOM in func.tags or func in _UNDEFINED
                or func.namespace != "aten"):
            return None
        fakes = _tensors(out)
        if not (fakes or written) or any(t.device != _CPU or has_symbols(t.shape) or t.numel() > LIMIT
                                         for t in (*fakes, *written)):
            return None
        try:
            result, inputs = self._real(func, args, kwargs)
        except Exception:  # whatever torch refuses here, the fake went through: the value stays unknown
            return None
        reals = _tensors(result)
        if len(reals) != len(fakes):
            return None
        if not (written or getattr(func, "is_view", False)):
            # twins alias where the fakes do, no more: an op the tracer takes as fresh (``_unsafe_view``)
            # may hand back its input's memory
            try:
                storages = {t.untyped_storage().data_ptr() for t in inputs}
                aliased = any(r.untyped_storage().data_ptr() in storages for r in reals)
            except RuntimeError:  # a tensor without a Python storage (a torch.func wrapper's): unknown
                return None
            if aliased:
                with _unseen():
                    reals = [r.clone() if r.untyped_storage().data_ptr() in storages else r for r in reals]
        return list(zip(fakes, reals))

    def commit(self, pending: list[tuple[torch.Tensor, torch.Tensor]], written: list[torch.Tensor]) -> None:
        """Keep the twins :meth:`prepare` computed, now that the tracer bound their fakes to their nodes."""
        for fake, real in pending:
            self._bind(fake, real)
        for fake in written:  # written in place, through the twin: its aliases among the twins see it too
            self._refresh(fake)

    def _bind(self, fake: Any, real: torch.Tensor) -> None:
        if isinstance(fake, torch.Tensor):
            self.twins[id(fake)] = (fake, real, self.tracer.builder.values.get(id(fake)))

    def _refresh(self, fake: torch.Tensor) -> None:
        """``fake``'s twin was updated in place: it and the tensors the tracer knows alias it (rebound by the
        write) are current again when their twins share its memory."""
        tracer = self.tracer
        entry = self.twins.get(id(fake))
        if entry is None:
            return
        storage = entry[1].untyped_storage().data_ptr()
        root = tracer.base_of.get(id(fake), fake)
        for t in (root, *tracer.views_of.get(id(root), ())):
            other = self.twins.get(id(t))
            if other is not None and other[1].untyped_storage().data_ptr() == storage:
                self._bind(t, other[1])
