"""Training programs: a forward and a backward :class:`~effectfx.program.program.Program` run as one autograd
node per call (Note [Joint trace]), and ``efx.load``, which reads either kind back."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..errors import PartialBackwardError
from ..graph.torch_func import FUNCTORCH
from ..graph.traced import TensorMeta, same_forward, saved_positions, tangents_of
from . import serialize
from .program import Program, refuse_under_torch_func
from .records import Form


class _RunTraining(torch.autograd.Function):
    """One autograd node per call of a compiled training program (see TrainingProgram)."""

    @staticmethod
    def forward(ctx: Any, prog: TrainingProgram, aside: _Aside | None,  # type: ignore[override]
                *inputs: torch.Tensor) -> tuple:
        ctx.aside = aside
        results = prog.forward.run_flat(aside.merge(inputs) if aside is not None else list(inputs))
        n_outs = len(results) - prog.forward.n_extra_outputs
        outs, saved = results[:n_outs], results[n_outs:]
        ctx.prog = prog
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*[o for o, m in zip(outs, prog.tangent_mask) if not m])
        ctx.set_materialize_grads(False)  # an output nothing used gets no gradient: Note [Partial backward]
        if prog.covered_by:  # several differentiable outputs: a backward may get some gradients only
            ctx.zeros = [(o.shape, o.dtype, o.device) for o, m in zip(outs, prog.tangent_mask) if m]
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:  # type: ignore[override]
        prog: TrainingProgram = ctx.prog
        tangents = tangents_of(grads, prog.tangent_mask)
        live = tuple(g is not None for g in tangents)
        if not all(live) and prog.covers(live):  # the full backward runs the same formulas: zeros are exact
            tangents = [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                        for g, (shape, dtype, device) in zip(tangents, ctx.zeros)]
            live = (True,) * len(live)
        if all(live):
            results = iter(prog.backward.run_flat([*ctx.saved_tensors, *tangents]))
        else:
            backward, positions = prog.partial_backward(live)
            saved = ctx.saved_tensors
            results = iter(backward.run_flat([*[saved[i] for i in positions],
                                              *[g for g in tangents if g is not None]]))
        grads_in = [next(results) if m else None for m in prog.grad_mask]
        if ctx.aside is not None:  # no gradient (and no edge) for the inputs set aside
            grads_in = [g for g, u in zip(grads_in, ctx.aside.unreached) if not u]
        return (None, None, *grads_in)


class _Aside:
    """The inputs of a training program no output depends on, handed to its autograd node outside the
    tensors ``Function.apply`` makes edges to (one object: a pytree leaf), as eager's graph has no edge to
    them; the forward still runs on the very tensors."""

    __slots__ = ("unreached", "tensors")

    def __init__(self, unreached: tuple[bool, ...], inputs: list[torch.Tensor]) -> None:
        self.unreached = unreached
        self.tensors = [t for t, u in zip(inputs, unreached) if u]

    def merge(self, reached: tuple) -> list[torch.Tensor]:
        kept, aside = iter(reached), iter(self.tensors)
        return [next(aside) if u else next(kept) for u in self.unreached]


@dataclass(frozen=True)
class TrainingProgram:
    """A forward Program returning ``(*outs, *saved)`` and a backward Program ``(*saved, *tangents) ->
    grads``, run as one ``torch.autograd.Function`` so results carry ``grad_fn`` (Note [Joint trace])."""

    forward: Program
    backward: Program
    tangent_mask: tuple[bool, ...]
    grad_mask: tuple[bool, ...]
    saved: tuple[tuple[str, TensorMeta], ...] = ()  # the forward's saved values: (node name, metadata)
    # traces the program anew for a backward of some outputs only (None: a loaded program)
    retrace: Callable[[tuple[bool, ...]], TrainingProgram] | None = field(default=None, compare=False,
                                                                          repr=False)
    covered_by: tuple[frozenset[int], ...] = ()  # per differentiable output (TracedGraph.covered_by)
    partial: dict = field(default_factory=dict, init=False, compare=False, repr=False)
    _unreached_inputs: list = field(default_factory=list, init=False, compare=False, repr=False)

    def covers(self, live: tuple[bool, ...]) -> bool:
        """Whether the backward of the outputs in ``live`` reaches every other one's (a model's logits,
        from its loss): the full backward with zero tangents for the others is then autograd's own."""
        present = {j for j, m in enumerate(live) if m}
        return len(self.covered_by) == len(live) and all(
            m or self.covered_by[i] & present for i, m in enumerate(live))

    def partial_backward(self, live: tuple[bool, ...]) -> tuple[Program, tuple[int, ...]]:
        """The backward for the differentiable outputs ``live`` selects, and which saved values it reads
        (Note [Partial backward]); traced once per selection."""
        found = self.partial.get(live)
        if found is None:
            if self.retrace is None:
                raise PartialBackwardError(
                    f"{self.forward.name.removesuffix(' (forward)')!r}: its backward was asked for some of "
                    f"its outputs only (differentiable outputs {[i for i, m in enumerate(live) if m]} got "
                    "a gradient), "
                    "which effectfx traces anew (Note [Partial backward]); a loaded program cannot be "
                    "traced.\nUse every output in the loss (out.sum() * 0 adds one), or compile the "
                    "function itself."
                )
            part = self.retrace(live)
            name = self.forward.name.removesuffix(" (forward)")
            # both forwards went through the same passes: the new trace must have run the same forward
            same_forward(self.forward.graph_module, part.forward.graph_module, name)
            found = (part.backward, saved_positions(self.saved, part.saved, name))
            self.partial[live] = found
        return found

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.forward.graph_module

    @property
    def form(self) -> Form:
        return self.forward.form

    @property
    def region_traces(self) -> dict[str, int]:
        return self.forward.region_traces

    @property
    def region_effects(self) -> dict[str, frozenset[str] | None]:
        """Effect keys per identifier, forward and backward bodies together."""
        merged = dict(self.forward.region_effects)
        for ident, keys in self.backward.region_effects.items():
            prev = merged.get(ident)
            merged[ident] = keys if prev is None else prev | (keys or frozenset())
        return merged

    def code(self) -> str:
        return f"{self.forward.code()}\n\n{self.backward.code()}"

    def save(self, path: Any) -> None:
        """Write both token-free halves to ``path``; read them back with ``efx.load``."""
        serialize.save(self, path)

    def map(self, fn: Any) -> TrainingProgram:
        """Apply a ``Program -> Program`` pass to both halves."""
        retrace = None if self.retrace is None else (lambda live, r=self.retrace: r(live).map(fn))
        return dataclasses.replace(self, forward=fn(self.forward), backward=fn(self.backward),
                                   retrace=retrace)

    def __str__(self) -> str:
        return f"{self.forward}\n\n{self.backward}"

    __repr__ = __str__

    def run_autograd(self, inputs: list[torch.Tensor]) -> tuple:
        # an input no output depends on gets no edge, as in eager's graph: its grad_fn (a backward hook's,
        # a tensor hook) must not run with an undefined gradient
        unreached = self._unreached()
        if unreached is not None:
            aside = _Aside(unreached, inputs)
            return _RunTraining.apply(self, aside, *[t for t, u in zip(inputs, unreached) if not u])
        return _RunTraining.apply(self, None, *inputs)

    def _unreached(self) -> tuple[bool, ...] | None:
        """Per input: whether it requires grad but the backward gives it none (no output depends on it);
        None when every such input is reached (the usual program).  Found once, from the backward graph."""
        if not self._unreached_inputs:
            outs = next(reversed(self.backward.graph_module.graph.nodes)).args[0]
            graph_outs = iter(outs[len(self.backward.token_keys):])  # (the functionalized form's tokens)
            found = tuple(m and next(graph_outs) is None for m in self.grad_mask)
            self._unreached_inputs.append(found if any(found) else None)
        return self._unreached_inputs[0]

    @torch._disable_dynamo  # opaque to Dynamo: a graph break (drivers/dynamo_backend.py)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.forward.check_state()
        inputs = self.forward.flat_inputs(args, kwargs)
        if FUNCTORCH.peek_interpreter_stack() is not None:
            refuse_under_torch_func(self.forward.name, inputs, training=True)
        forward = self.forward
        outs = forward.write_back(inputs, list(self.run_autograd(inputs)))
        return forward.finish(forward.unflatten(outs, args, kwargs), args, kwargs)


def load(path: Any) -> Program | TrainingProgram:
    """``efx.load``: a program written by ``prog.save(path)``; runs no code from the file
    (``effectfx.program.serialize``)."""
    kind, fields = serialize.load_fields(path)
    if kind == "training":
        forward, backward, training = fields
        return TrainingProgram(Program(**forward), Program(**backward), **training)
    return Program(**fields)
