"""Programs: captured graphs together with their calling convention (Note [Effect tokens]).

A :class:`Program` is one root graph (with its region subgraphs) plus how user arguments map to graph
inputs and graph outputs to user results (``effectfx.program.training`` pairs a forward and a backward one
for autograd).  Programs are immutable: passes return new ones
(``passes.simplify.simplify_in_place`` excepted: efx.compile runs it on the capture only it holds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import TreeSpec, tree_unflatten

from .. import ops
from ..errors import SignatureMismatchError, UnsupportedMutationError
from ..graph.torch_func import FUNCTORCH, torch_func_kinds, torch_func_refusal, wrapped_or_grad
from ..graph.traced import OutputKind, OutputLeaf, TensorMeta
from ..graph.walk import subgraphs
from . import serialize
from .containers import onto_caller, returned_inputs, same_objects, value_at, view_outputs, write_state
from .python_writes import PythonState
from .records import BodyInfo, Form, InputSignature, PassRecord, RegionEntry
from .returned import unflatten_plan, write_new
from .text import program_text


@dataclass(frozen=True)
class Program:
    graph_module: fx.GraphModule
    signature: InputSignature
    lifted: tuple[torch.Tensor, ...]  # real tensors read by identity, after the user's tensor inputs
    out_spec: TreeSpec
    out_layout: tuple[OutputLeaf, ...]
    form: Form = Form.CAPTURED
    token_keys: tuple[str, ...] = ()  # tokens at the root's boundary (functionalized form only)
    regions: dict[str, RegionEntry] = field(default_factory=dict)
    history: tuple[PassRecord, ...] = ()
    n_extra_outputs: int = 0  # trailing outputs not returned to the user (saved for backward)
    name: str = "program"
    bodies: tuple[BodyInfo, ...] = ()  # every body traced by the capture, in order of first trace
    guards: tuple = ()  # what the capture read from Python objects, by identity: a compiled program's guards
    # inputs (by position in run_flat's list) written in place: their new values follow the user's tensor
    # outputs, and the caller writes them back (Note [Mutations])
    mutations: tuple[int, ...] = ()
    # per lifted tensor: (object, attribute or ("item", key)) the capture read it from, or None: where a
    # compiled program reads it again at each call (not saved: live objects, like the guards)
    lifted_from: tuple = ()
    specialized: tuple[str, ...] = ()  # ops that pinned a symbolic size to a number (Note [Symbolic shapes])
    # top-level arguments whose containers the code changed: the results end with their new states, which
    # ``finish`` writes into the caller's (Note [Mutations], ``program.containers``)
    written_args: tuple = ()
    # Python state a training step set (``.grad``, optimizer state): ``(path, is None)`` per write, the new
    # tensors after everything else in the results (Note [Training step], ``containers.write_state``)
    state_writes: tuple = ()
    # whether the Python state the step starts from is still the state it was captured from (its guards;
    # set by the capture driver for a program with state_writes: efx.capture's program refuses otherwise)
    state_holds: Callable[[], bool] | None = field(default=None, compare=False, repr=False)
    # Python state the code wrote (Note [Python state]): replayed after each run, the tensors written
    # after the user's results (before a training step's)
    python_state: PythonState | None = field(default=None, compare=False, repr=False)
    # (input index, method, hook) per tensor hook the code registers on an input: made after each run, on
    # that run's tensor, as eager registers it at each call (``interposers.tensor_hooks``)
    input_hooks: tuple = field(default=(), compare=False, repr=False)
    # argument objects the result holds itself: the caller's are returned (``containers.returned_objects``)
    returned_args: tuple = field(default=(), compare=False, repr=False)
    _views: list = field(default_factory=list, init=False, compare=False, repr=False)  # (view_outputs)
    _returned: list = field(default_factory=list, init=False, compare=False, repr=False)  # (returned_inputs)
    _plan: tuple = field(default=(), init=False, compare=False, repr=False)  # (containers.unflatten_plan)

    def __post_init__(self) -> None:  # a form, an output's kind, may be given by its name
        layout = tuple(OutputLeaf(OutputKind(kind), v) for kind, v in self.out_layout)
        object.__setattr__(self, "form", Form(self.form))
        object.__setattr__(self, "out_layout", layout)
        object.__setattr__(self, "_plan", unflatten_plan(  # (the states follow the result: ``finish``)
            self.out_spec, layout, self.returned_args, self.written_args, self.signature.spec,
            bool(self.state_writes) + (self.python_state is not None)))

    # -- inspection ------------------------------------------------------------------------------
    @property
    def region_traces(self) -> dict[str, int]:
        return {ident: entry.traces for ident, entry in self.regions.items()}

    @property
    def region_effects(self) -> dict[str, frozenset[str] | None]:
        return {ident: entry.effects for ident, entry in self.regions.items()}

    def subgraphs(self) -> dict[str, fx.GraphModule]:
        """Region subgraphs by attribute name, each shared subgraph once."""
        return {attr: gm for attr, _, gm in subgraphs(self.graph_module)}

    def code(self) -> str:
        return program_text(self.graph_module)

    def __str__(self) -> str:
        made = " -> ".join(f"{r.name} ({r.seconds * 1e3:.1f} ms)" for r in self.history) or "-"
        header = f"# effectfx {self.name}, {self.form} form; made by: {made}"
        if self.token_keys:
            header += f"\n# tokens (in order): {', '.join(self.token_keys)}"
        return header + "\n" + self.code()

    __repr__ = __str__

    def replace(self, **changes: Any) -> Program:
        return dataclasses.replace(self, **changes)

    def save(self, path: Any) -> None:
        """Write this token-free program to ``path``; read it back with ``efx.load`` (program.serialize)."""
        serialize.save(self, path)

    # -- running ---------------------------------------------------------------------------------
    def run_flat(self, tensors: list[Any]) -> list[Any]:
        """Run the root graph on its tensor inputs (no tokens); returns all outputs without tokens."""
        n_tokens = len(self.token_keys)
        token = ops.make_token()
        # graphs are traced below autograd: a TrainingProgram attaches them to autograd as one node, and
        # an inference program's outputs must not require grad, whatever the caller's grad mode
        previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            results = self.graph_module.forward(*([token] * n_tokens), *tensors)
        finally:
            torch._C._set_grad_enabled(previous)
        return list(results[n_tokens:])

    def flat_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        lifted = self.lifted if self.python_state is None else self.python_state.lifted(self.lifted,
                                                                                         self.lifted_from)
        return [*self.signature.bind(args, kwargs, self.name), *lifted]

    def unflatten(self, tensor_outs: list[Any], args: tuple | None = None, kwargs: dict | None = None) -> Any:
        """The result; given the call's arguments, an argument's object the code returned is the caller's
        itself, as in eager (``containers.unflatten_plan``; ``finish`` writes its new state into it)."""
        spec, layout, _ = self._plan if args is not None else (self.out_spec, self.out_layout, ())
        leaves = [tensor_outs[v] if kind is OutputKind.TENSOR else v if kind is OutputKind.CONST
                  else value_at(args, kwargs, v) if kind is None else kind.value(tensor_outs)
                  for kind, v in layout]
        return tree_unflatten(leaves, spec)

    def finish(self, result: Any, args: tuple, kwargs: dict) -> Any:
        """The user's result; the caller's containers and the step's Python state take the states the code
        left them in."""
        if self.state_writes:
            result, values = result
            write_state(self.state_writes, values)
        if self.python_state is not None:
            result, values = result
            self.python_state.apply(values)
        if not self.written_args:
            return result
        result, states = result
        written = [write_new(value_at(args, kwargs, where), new)
                   for where, new in zip(self.written_args, states)]
        mine = [w for where, w in zip(self.written_args, written) if where not in self._plan[2]]  # not in it
        return same_objects(result, mine)

    def write_back(self, inputs: list[Any], outs: list[Any]) -> list[Any]:
        """Write the new values of mutated inputs into the caller's tensors, as eager's in-place ops did;
        ``outs`` holds the user's outputs then those values.  Returns the user's outputs, where an input
        comes back as it came the caller's tensor itself (``containers.returned_inputs``)."""
        if not self._returned:
            self._returned.append(returned_inputs(self.graph_module.graph, len(self.token_keys),
                                                  len(outs) - len(self.mutations), self.mutations))
        for i, name, hook in self.input_hooks:
            getattr(inputs[i], name)(hook)
        if self._returned[0]:
            outs = list(outs)
            for k, i in self._returned[0]:
                outs[k] = inputs[i]
        if not self.mutations:
            return outs
        n_user = len(outs) - len(self.mutations)
        plain: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        grad = torch.is_grad_enabled()
        for i, new in zip(self.mutations, outs[n_user:]):
            target = inputs[i]
            if new is target:  # updated where it lives (passes.reinplace)
                continue
            if new.requires_grad and grad:
                if target.is_leaf and target.requires_grad:
                    raise UnsupportedMutationError(
                        f"{self.name} updates a leaf tensor that requires grad in place (input {i}, "
                        f"{TensorMeta.of(target).short()}); eager PyTorch refuses this too. Pass a clone, or "
                        "update it under torch.no_grad()."
                    )
                target.copy_(new)  # recorded by autograd: gradients reach the value before the update
            else:
                plain[0].append(target)
                plain[1].append(new)
        if plain[0]:  # in one call: a training step writes every parameter and optimizer state tensor
            with torch.no_grad():
                if FUNCTORCH.peek_interpreter_stack() is None:
                    torch._foreach_copy_(*plain)
                else:  # (vmap has no batching rule for _foreach_copy_)
                    for target, new in zip(*plain):
                        target.copy_(new)
        # an output that is the updated input (``x.add_(1); return x``) is the caller's tensor, as in eager,
        # and one that is a view of it (``return x[:2]``) a view of the caller's tensor
        written = {id(new): inputs[i] for i, new in zip(self.mutations, outs[n_user:])}
        result = [written.get(id(o), o) for o in outs[:n_user]]
        if not self._views:  # which outputs may be views of an updated input: once, from the graph
            graph_outs = list(next(reversed(self.graph_module.graph.nodes)).args[0])
            graph_outs = graph_outs[len(self.token_keys):len(graph_outs) - self.n_extra_outputs]
            self._views.append(view_outputs(graph_outs, outs, len(self.mutations)))
        for k, j in self._views[0]:
            result[k] = onto_caller(result[k], inputs[self.mutations[j]], outs[n_user + j])
        return result

    def check_state(self) -> None:
        """Refuse to run a captured training step on Python state other than the state it was captured
        from (its first step made the optimizer's state: running it again would make it anew), or Python
        state it computed its writes from (Note [Python state])."""
        if self.python_state is not None:
            self.python_state.check(self.name)
        if self.state_holds is not None and not self.state_holds():
            raise SignatureMismatchError(
                f"{self.name!r} is a training step captured when its gradients and optimizer state were "
                "different (Note [Training step]): the first step of an optimizer makes its state, the "
                "next ones update it. Use efx.compile(step), which captures the program for each."
            )

    @torch._disable_dynamo  # opaque to Dynamo: a graph break (drivers/dynamo_backend.py)
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.check_state()
        inputs = self.flat_inputs(args, kwargs)
        if FUNCTORCH.peek_interpreter_stack() is not None:  # torch.func around it: one C call otherwise
            refuse_under_torch_func(self.name, inputs, training=False)
        outs = self.run_flat(inputs)
        if self.n_extra_outputs:
            outs = outs[: len(outs) - self.n_extra_outputs]
        return self.finish(self.unflatten(self.write_back(inputs, outs), args, kwargs), args, kwargs)


def refuse_under_torch_func(name: str, inputs: list[Any], training: bool) -> None:
    """A program's graphs run below autograd (a training program attaches them as one autograd.Function
    without ``setup_context``): only ``vmap`` (or ``jvp``) of an inference program on tensors that need no
    gradient runs as eager does.  A reverse transform would see no dependence of the outputs on the
    inputs -- silently zero gradients -- so it is refused, as an input that requires grad is."""
    kinds = torch_func_kinds()
    reverse = [k for k in kinds if k in ("Grad", "Functionalize")]
    needs_grad = wrapped_or_grad([(f"input {i}", t) for i, t in enumerate(inputs)])[1]
    if training:
        kind, why = (reverse or kinds)[-1], ("it is a training program, run as an autograd.Function that "
                                             "torch.func cannot transform")
    elif reverse:
        kind, why = reverse[-1], ("its graphs run below autograd, so the transform would see no dependence "
                                  "of its outputs on its inputs (zero gradients)")
    elif needs_grad is not None:
        kind, why = kinds[-1], f"its {needs_grad} requires grad, and its outputs would not"
    else:
        return
    raise torch_func_refusal(f"the captured program {name!r}", kind, why,
                             "Use torch.autograd on a training program (efx.capture under autograd, or "
                             "efx.compile), or run {transform} on the eager function")
