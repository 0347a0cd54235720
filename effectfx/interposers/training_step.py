"""A whole training step in captured code: ``loss.backward()``, gradient clipping and optimizer steps
(Note [Training step]).

During a capture, ``torch.autograd.backward`` (``Tensor.backward``) on this thread runs here: the gradients
of the leaves the backward reaches are taken with ``torch.autograd.grad`` -- so the backward's ops, region
backward bodies and effects are recorded into the root graph in the engine's own order -- and accumulated
into each leaf's ``.grad`` as eager's engine does (set when it is None, added in place otherwise).  An
optimizer's ``step`` runs traced too (``torch.optim`` global step hooks see which optimizers run).

What the step leaves in Python state -- each leaf's ``.grad``, each optimizer's ``state`` -- is fake during
the trace.  :class:`TrainingStep` remembers how it was before, puts it back afterwards, returns the new
values as graph outputs (``StepWrites``: the program writes them after each run), and guards on the state
the trace started from, so the program of a step whose optimizer state is created lazily is not the
program of the steps after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim import lr_scheduler, optimizer
from torch.utils._pytree import tree_map

from ..errors import UnsupportedOperatorError
from ..graph.source import user_location
from ..guards.check import resolve
from ..guards.floats import active_floats
from ..guards.kinds import Guard, OfType, SameObject, guard_on
from ..guards.reads import unrecorded
from ..guards.values import MISSING, Ref, class_of
from ..regions.decorator import active_tracer
from .interpose import interpose

_NO_GRAD = object()  # a tensor whose .grad the trace never looked at


class TrainingStep:
    """The Python state one root capture's training step changes (Note [Training step])."""

    def __init__(self, read: dict[int, Any]) -> None:
        self.read = read  # id(real tensor) -> its fake: the real tensors the trace read (Tracer.fake_of)
        self.ran_backward = False
        self.leaves: dict[int, tuple[torch.Tensor, Any]] = {}  # id(leaf) -> (leaf, its .grad before)
        # id(optimizer) -> (optimizer, its state before: {id(p): (p, dict before)}, hyperparameters before)
        self.optimizers: dict[int, tuple[Any, dict[int, tuple[torch.Tensor, dict]], list[dict]]] = {}
        self._created: list[tuple[Any, torch.Tensor]] = []  # per-parameter dicts the trace made
        self.targets: list[tuple] = []  # (path, is None) per Python state write (see results)
        self.guards: list[Guard] = []

    # -- what the trace does ------------------------------------------------------------------------
    def begin(self, roots: list[Any]) -> None:
        """Before the code runs: the ``.grad`` of every parameter of the modules and optimizers the code
        is handed or reads from its closure and globals (one attribute deep), as the step finds it --
        ``opt.zero_grad()`` before ``backward()`` changes it before the backward reaches it."""
        seen: set[int] = set()
        for root in roots:
            for obj in (root, *_attributes(root)):
                if id(obj) in seen:
                    continue
                seen.add(id(obj))
                if isinstance(obj, torch.nn.Module):
                    with unrecorded():
                        for p in obj.parameters():
                            self.track(p)
                elif isinstance(obj, torch.optim.Optimizer):
                    for group in obj.param_groups:
                        for p in group["params"]:
                            self.track(p)

    def track(self, leaf: torch.Tensor) -> None:
        if id(leaf) not in self.leaves:
            self.leaves[id(leaf)] = (leaf, leaf.grad)

    def backward(self, tracer: Any, tensors: Any, grad_tensors: Any, retain_graph: bool | None,
                 create_graph: bool, inputs: Any) -> None:
        """``torch.autograd.backward`` inside a capture: gradients accumulated into ``.grad``."""
        where = user_location()
        if tracer.region_stack:
            raise UnsupportedOperatorError(
                f"region {tracer.region_stack[-1].name!r} calls backward() (at {where}); a region body is "
                "traced once for all its calls and its backward is derived from it. Call backward() in "
                "the compiled step, outside the region (Note [Training step])."
            )
        if create_graph:
            raise UnsupportedOperatorError(
                f"the captured function calls backward(create_graph=True) (at {where}): a gradient of a "
                "gradient inside a compiled step is not supported. Use torch.autograd.grad(..., "
                "create_graph=True) and sum the result into the loss, or run the step eagerly."
            )
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if grad_tensors is None:
            grad_tensors = (None,) * len(tensors)
        elif isinstance(grad_tensors, torch.Tensor):
            grad_tensors = (grad_tensors,)
        grad_tensors = tuple(torch.ones_like(t) if g is None and t.numel() == 1 else g
                             for t, g in zip(tensors, grad_tensors))
        if inputs is None:
            leaves = _leaves(tensors)
        else:
            leaves = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
        for leaf in leaves:
            if not isinstance(leaf, FakeTensor):
                continue  # a real tensor: a parameter, a tensor read from Python state
            if tracer.real_of.get(id(leaf)) is not None:
                raise UnsupportedOperatorError(
                    f"the captured function's backward() (at {where}) accumulates a gradient into one of its "
                    "arguments (it requires grad). A compiled step writes the .grad of parameters and "
                    "tensors it reads from Python state, not of its arguments: pass the argument without "
                    "requires_grad, or take its gradient with torch.autograd.grad and return it."
                )
            raise UnsupportedOperatorError(
                f"the captured function's backward() (at {where}) accumulates a gradient into a tensor it "
                "made itself (a leaf that requires grad); that .grad would not outlive the trace. Compute "
                "the gradient with torch.autograd.grad and return it."
            )
        self.ran_backward = True
        for leaf in leaves:
            self.track(leaf)
        grads = torch.autograd.grad(tensors, leaves, grad_tensors, retain_graph=retain_graph,
                                    allow_unused=True) if leaves else ()
        with torch.no_grad():
            for leaf, grad in zip(leaves, grads):
                if grad is None:
                    continue
                if leaf.grad is None:  # the engine's AccumulateGrad: set, or added in place
                    leaf.grad = grad if grad.stride() == leaf.stride() else _like(leaf, grad)
                else:
                    leaf.grad.add_(grad)
                for hook in (getattr(leaf, "_post_accumulate_grad_hooks", None) or {}).values():
                    hook(leaf)

    def optimizer_starts(self, opt: Any) -> None:
        """An optimizer's ``step`` begins: remember its state and its parameters' gradients as they were."""
        if id(opt) in self.optimizers:
            return
        params = [p for group in opt.param_groups for p in group["params"]]
        for p in params:
            self.track(p)
        state = {}
        for p in params:
            if p not in opt.state:
                self._created.append((opt, p))
            state[id(p)] = (p, dict(opt.state[p]))  # (a defaultdict: eager's step makes the dict too)
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
        self.optimizers[id(opt)] = (opt, state, hyper)

    def wrap(self, run: Callable[[], Any]) -> Callable[[], Any]:
        """``run`` returning ``(out, new state values)`` when the step set Python state; ``targets`` and
        ``guards`` are known once it returned."""
        def step_run() -> Any:
            out = run()
            self.targets, values, self.guards = self.results()
            if self.ran_backward:
                out = detached(out)
            return (out, values) if self.targets else out

        return step_run

    # -- after the trace ----------------------------------------------------------------------------
    def results(self) -> tuple[list[tuple], list[torch.Tensor], list[Guard]]:
        """``(targets, values, guards)``: where each new value goes after a run (a path for
        ``program.containers.set_at``, and whether the value written is None), the tensors to return,
        and what the program assumes of the state the step starts from."""
        targets: list[tuple] = []
        values: list[torch.Tensor] = []
        guards: list[Guard] = []
        stepped = self.ran_backward or bool(self.optimizers)
        for leaf, before in self.leaves.values():
            after, path = leaf.grad, (("id", Ref(leaf)), "grad")
            if after is not before:
                targets.append((path, after is None))
                if after is not None:
                    values.append(after)
            if stepped or after is not before:  # (a plain forward's program ignores .grad)
                # a gradient the trace never read (zero_grad() before the backward) need only exist
                unread = isinstance(before, torch.Tensor) and id(before) not in self.read
                guards.append(OfType(path, class_of(before)) if unread else _expect(path, before))
        for opt, state, hyper in self.optimizers.values():
            name = type(opt).__name__
            guards.append(SameObject((("id", Ref(opt)), "state"), Ref(opt.state)))
            for k, group in enumerate(opt.param_groups):
                now = {key: v for key, v in group.items() if key != "params"}
                changed = [key for key in now if not _same(now[key], hyper[k].get(key, MISSING))]
                if changed:
                    raise UnsupportedOperatorError(
                        f"the captured function changes {name}'s param_groups[{k}][{changed[0]!r}] (at "
                        f"{user_location()}), Python state a compiled step does not replay (an LR "
                        "scheduler's step(), say). Change it outside the compiled step: the program sees "
                        "the new value at its next call (Note [Training step])."
                    )
                floats = active_floats()
                for path, v in ((_item(group, key), v) for key, v in now.items()):
                    guards.extend(floats.guards(path, v) if floats is not None and path in floats.read
                                  else [_expect(path, v)])
            for p, before in state.values():
                where = (("id", Ref(opt.state)), ("key", Ref(p)))
                after = opt.state.get(p, {})
                for key in {**before, **after}:
                    old, new = before.get(key, MISSING), after.get(key, MISSING)
                    guards.append(_expect((*where, ("item", key)), old))
                    if new is old:
                        continue
                    if not isinstance(new, torch.Tensor):
                        raise UnsupportedOperatorError(
                            f"{name}.step() (at {user_location()}) sets its state {key!r} to "
                            f"{type(new).__name__} {new!r}: Python state a compiled step does not replay. "
                            "Only tensor state is supported (torch.optim's SGD, Adam, AdamW...)."
                        )
                    targets.append(((*where, ("item", key)), False))
                    values.append(new)
        return targets, values, guards

    def replaces(self, path: tuple) -> bool:
        """Whether the step's own guards replace a read's guard at ``path``: an optimizer's ``state``,
        which the step guards entry by entry (a read guards the whole dict by value)."""
        if path[-1] != "state" or path[0][0] != "id" or not self.optimizers:
            return False
        owner = resolve(path[:-1], ())
        return id(owner) in self.optimizers

    def restore(self) -> None:
        """Put every ``.grad`` and optimizer state back as the trace found it: none of its fakes leaks."""
        for leaf, before in self.leaves.values():
            leaf.grad = before
        for opt, state, hyper in self.optimizers.values():
            for group, before in zip(opt.param_groups, hyper):
                group.update(before)
            for p, before in state.values():
                held = opt.state[p]
                held.clear()
                held.update(before)
        for opt, p in self._created:
            if not opt.state.get(p, True):
                del opt.state[p]


def _attributes(obj: Any) -> list[Any]:
    """The modules and optimizers one attribute away from ``obj`` (a trainer's ``self.model``)."""
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) or not hasattr(obj, "__dict__"):
        return []
    return [v for v in vars(obj).values() if isinstance(v, (torch.nn.Module, torch.optim.Optimizer))]


def _leaves(tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The leaves ``tensors``' autograd graph accumulates into, in the order the graph reaches them."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    stack = [t.grad_fn for t in reversed(tensors) if t.grad_fn is not None]
    for t in tensors:
        if t.grad_fn is None and t.requires_grad:
            found.setdefault(id(t), t)
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        variable = getattr(fn, "variable", None)
        if isinstance(variable, torch.Tensor):
            found.setdefault(id(variable), variable)
        stack.extend(next_fn for next_fn, _ in reversed(fn.next_functions))
    return list(found.values())


def _expect(path: tuple, value: Any) -> Guard:
    """A guard on a state value: a tensor by identity (its data is an input)."""
    if isinstance(value, torch.Tensor):
        return SameObject(path, Ref(value))
    return guard_on(path, value, structural=False)


def _item(group: dict, key: str) -> tuple:
    """The path of a param group's hyperparameter ``key``."""
    return (("id", Ref(group)), ("item", key))


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or type(a) is not type(b):
        return False
    return bool(a == b)


def _like(leaf: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` in ``leaf``'s layout, as the engine's gradient layout contract has it."""
    out = torch.empty_strided(leaf.shape, leaf.stride(), dtype=grad.dtype, device=grad.device)
    return out.copy_(grad)


def detached(out: Any) -> Any:
    """The step's results: their graph was the step's backward's, so they need no gradient of their own."""
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) and v.requires_grad else v, out)


# -- reaching the tracer ----------------------------------------------------------------------------------

def _step_of() -> tuple[Any, TrainingStep] | None:
    tracer = active_tracer()
    step = getattr(tracer, "training_step", None) if tracer is not None else None
    return (tracer, step) if step is not None else None


def _backward(tensors: Any, grad_tensors: Any = None, retain_graph: bool | None = None,
              create_graph: bool = False, grad_variables: Any = None, inputs: Any = None) -> None:
    found = _step_of()
    if found is None:
        return _BACKWARD.original(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
    tracer, step = found
    step.backward(tracer, tensors, grad_tensors if grad_tensors is not None else grad_variables,
                  retain_graph, create_graph, inputs)
    return None


def _refused_inside(cls: type) -> None:
    original = cls.step

    def scheduler_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _step_of() is None:
            return original(self, *args, **kwargs)
        raise UnsupportedOperatorError(
            f"the captured function steps the LR scheduler {type(self).__name__} (at {user_location()}): "
            "its step() changes Python state (the optimizer's learning rate, its own epoch count) that a "
            "compiled step does not replay. Call scheduler.step() outside the compiled step: the program "
            "sees the new learning rate at its next call (Note [Training step])."
        )

    interpose(cls, "step", scheduler_step)


# ``torch.autograd.backward`` and the LR schedulers' steps, diverted on a capturing thread only (the
# original runs everywhere else)
_BACKWARD = interpose(torch.autograd, "backward", _backward)
for _cls in (lr_scheduler.LRScheduler, lr_scheduler.ReduceLROnPlateau):
    _refused_inside(_cls)
_HOOKS: list[Any] = []


def _register_step_hooks() -> None:
    """The optimizers' global step hooks (torch's own mechanism, not an interposer), registered at the
    first capture."""
    if not _HOOKS:
        _HOOKS.append(optimizer.register_optimizer_step_pre_hook(_step_begins))
        _HOOKS.append(optimizer.register_optimizer_step_post_hook(_step_ends))


_RESTORE: list[tuple[list[tuple[dict, str, Any]], bool]] = []  # per optimizer step being traced


def _step_begins(opt: Any, args: Any, kwargs: Any) -> None:
    found = _step_of()
    if found is None:
        return
    found[1].optimizer_starts(opt)
    # torch.optim's tensor-only formulas (no .item() of the step count), as under torch.compile; and,
    # unless the user chose, its multi-tensor path: one graph node per update for all parameters, where
    # the per-tensor loop (eager's choice on CPU) records each scalar formula once per parameter
    changed = []
    for group in opt.param_groups:
        for key in ("capturable", "foreach"):
            if key in group and not group[key]:
                changed.append((group, key, group[key]))
                group[key] = True if key == "capturable" or group[key] is None else group[key]
    floats = active_floats()
    for k, group in enumerate(opt.param_groups if floats is not None else ()):
        for key, value in list(group.items()):  # a changed hyperparameter: an input (Note [Float inputs])
            cell = floats.cell(_item(group, key), value, f"{type(opt).__name__}.param_groups[{k}][{key!r}]",
                               hyperparameter=key)
            if cell is not None:
                changed.append((group, key, value))
                group[key] = cell
    for group in opt.param_groups:  # SGD's per-tensor loop takes a tensor lr as a Python scalar (.item())
        if group.get("foreach") is False and any(isinstance(v, torch.Tensor) for k, v in group.items()
                                                 if k != "params"):
            changed.append((group, "foreach", False))
            group["foreach"] = True
    _RESTORE.append((changed, torch.compiler._is_compiling_flag))
    torch.compiler._is_compiling_flag = True


def _step_ends(opt: Any, args: Any, kwargs: Any) -> None:
    if _step_of() is not None and _RESTORE:
        _undo()


def _undo() -> None:
    groups, flag = _RESTORE.pop()
    torch.compiler._is_compiling_flag = flag
    for group, key, value in groups:
        group[key] = value


@contextlib.contextmanager
def training_step(tracer: Any, roots: list[Any]) -> Iterator[TrainingStep]:
    """The training step of one root capture (``roots``: what its code is handed or reads, see
    :meth:`TrainingStep.begin`): its Python state is put back however the trace ends."""
    _register_step_hooks()
    step = tracer.training_step = TrainingStep(tracer.fake_of)
    step.begin(roots)
    try:
        yield step
    finally:
        while _RESTORE:  # a step that raised: its post-hook never ran
            _undo()
        tracer.training_step = None
        step.restore()


