"""The tracer: a dispatch mode above FakeTensorMode that records aten ops into the current graph.

Capture never runs an effectful op and never computes on real data: every tensor that reaches the
dispatcher is swapped for its fake, and effectful ops only run their fake implementation.  In-place ops on
intermediates are recorded as their functional variant (the mutated tensor is rebound to the result).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..effects import effect_of
from ..errors import DataDependentControlFlowError, EffectfxError
from ..graph.source import user_location
from ..graph.traced import TensorMeta
from ..guards.labels import LabelMode, has_sentinel, resolve_labels
from ..guards.reads import Watcher
from ..interposers.collectives import COLLECTIVE_NAMESPACES, record_collective
from ..interposers.composite import CompositeEffects
from ..program.containers import map_structure
from ..regions.cache import RegionCache
from .constants import UNKNOWN, Constants
from .fakes import SYMBOLIC_FAKES, fake_maker, symbolic_context
from .graph_builder import GraphBuilder
from .mutation import AUTO_FUNCTIONALIZED, Mutation, by_name, functional_target, mutation_of
from .unsupported import fake_failure

aten = torch.ops.aten

# metadata queries a fake tensor answers itself: never recorded, so skip all bookkeeping
_PASSTHROUGH = {
    torch.ops.prim.device.default,
    aten.sym_size.default,
    aten.sym_size.int,
    aten.sym_stride.default,
    aten.sym_stride.int,
    aten.sym_numel.default,
    aten.sym_storage_offset.default,
    aten.is_contiguous.default,
    aten.is_contiguous.memory_format,
}

_DEVICE = torch.ops.prim.device.default
# C++'s factory functions (``torch.zeros``, ``zeros_like``, ``ones``...) hand their result to Python as a
# ``detach()`` of it when anything else holds the tensor -- the tracer does.  That detach follows the factory
# within one torch-level call, so nobody but the tracer ever sees the tensor it aliases: its result is a
# fresh tensor, not a view (an in-place op without a functional form may write it).
_DETACH = aten.detach.default
_LIFT_FRESH = aten.lift_fresh.default

_DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.is_nonzero.default,
    aten.equal.default,
}


class Tracer(TorchDispatchMode):
    """Records every aten op into the innermost :class:`GraphBuilder` on ``self.builders``.

    ``call_region(tracer, region, args, kwargs)`` is what a region's call does during the capture
    (``effectfx.hops.region``, handed over by the driver that makes the tracer)."""

    def __init__(self, call_region: Callable[..., Any], symbolic: bool = False) -> None:
        super().__init__()
        # symbolic sizes (Note [Symbolic shapes]): a ShapeEnv that never makes a size from data (nonzero,
        # item: refused as in a static capture)
        self.shape_env = ShapeEnv(allow_scalar_outputs=False, allow_dynamic_output_shape_ops=False,
                                  specialize_zero_one=True) if symbolic else None
        self.fake_mode = FakeTensorMode(shape_env=self.shape_env)
        if symbolic:  # its cache entries cost more symbolic arithmetic than the ops they spare
            self.fake_mode.cache_enabled = False
        self.specialized: list[str] = []  # ops that pinned a symbol to a number (Note [Symbolic shapes])
        self.builders: list[GraphBuilder] = []
        self.region_stack: list[Any] = []
        self.real_of: dict[int, torch.Tensor] = {}  # id(fake) -> real tensor it stands for
        self.fake_of: dict[int, torch.Tensor] = {}  # id(real) -> its fake
        self.keepalive: list[torch.Tensor] = []
        self.recording = True
        self.base_of: dict[int, torch.Tensor] = {}  # id(view) -> the intermediate it aliases
        self.views_of: dict[int, list[torch.Tensor]] = {}  # id(base) -> views of it made so far
        self.literals: set[int] = set()  # id(fake) of each torch.tensor(...) result (a lifted constant)
        # id(caller's tensor) -> (its grad_fn after a region's write-back, the body op's grad_fn name)
        self.written_by_region: dict[int, tuple[Any, str]] = {}
        self.regions = RegionCache()
        self._call_region = call_region
        self.watcher = Watcher()
        self.label_mode = LabelMode()
        self.composite = CompositeEffects(self)  # effect ops with a CompositeImplicitAutograd kernel
        # the last op's fresh result and the torch-level call that made it (see _DETACH)
        self._fresh: tuple[torch.Tensor, int] | None = None
        self.constants = Constants(self)  # real twins of the tensors made from Python constants only
        self._fake_makers: dict[torch.device, Callable[[torch.Tensor, bool], torch.Tensor]] = {}
        self._numbers: dict[str, int] = {}

    def call_region(self, region: Any, args: tuple, kwargs: dict) -> Any:
        """A call of ``region`` (``effectfx.regions.Region.call``) during this capture."""
        return self._call_region(self, region, args, kwargs)

    def number(self, kind: str) -> int:
        """0, 1, 2, ... per ``kind`` of subgraph (``"control_flow"``): unique names within one capture."""
        n = self._numbers[kind] = self._numbers.get(kind, -1) + 1
        return n

    # -- tensors ---------------------------------------------------------------------------------
    @property
    def builder(self) -> GraphBuilder:
        return self.builders[-1]

    def to_fake(self, value: Any) -> Any:
        """The fake standing for a real tensor (one per real tensor, created on first sight)."""
        if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
            return value
        fake = self.fake_of.get(id(value))
        if fake is None:
            fake = self.fake_of[id(value)] = self.new_fake(TensorMeta.of(value))
            self.real_of[id(fake)] = value
            self.keepalive.append(value)
        return fake

    def symbolic_fake(self, value: torch.Tensor, dynamic: frozenset[int], name: str) -> torch.Tensor:
        """The fake of a captured function's argument, with the sizes ``dynamic`` names as fresh symbols
        (0 and 1 specialize, with a guard, as torch.compile's do): before the trace runs."""
        fake = self.fake_of.get(id(value))
        if fake is not None:
            return fake
        context, source = symbolic_context(value, dynamic, name)
        fake = self.fake_mode.from_tensor(value.detach(), symbolic_context=context, source=source)
        fake.requires_grad_(value.requires_grad)
        self.fake_of[id(value)] = fake
        self.real_of[id(fake)] = value
        self.keepalive.append(value)
        return fake

    def new_fake(self, meta: TensorMeta, requires_grad: bool | None = None) -> torch.Tensor:
        """A fresh fake tensor with the given TensorMeta (``requires_grad`` overriding its flag), created
        without recording anything."""
        # straight from a meta tensor: ~10x cheaper than a factory call through the fake mode (and no
        # torch-function mode needs to see it)
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            storage = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
        make = self._fake_makers.get(meta.device)
        if make is None:
            make = self._fake_makers[meta.device] = fake_maker(self.fake_mode, meta.device)
        return make(storage, meta.requires_grad if requires_grad is None else requires_grad)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        previous, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = previous

    @contextlib.contextmanager
    def graph(self, builder: GraphBuilder) -> Iterator[GraphBuilder]:
        self.builders.append(builder)
        try:
            yield builder
        finally:
            self.builders.pop()

    def where(self) -> str:
        names = " > ".join(r.name for r in self.region_stack)
        return f"region {names!r}" if names else "the captured function"

    # -- dispatch --------------------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        # CIA effect ops decompose above this mode: a torch-function mode sees them first (composite.py)
        self.composite.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.composite.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        rule = _RULES.get(func)
        if rule is None:
            rule = _RULES[func] = _rule_of(func)
        return rule(self, func, args, kwargs or {})

    # -- the per-op rules (``_RULES``) --------------------------------------------------------------
    def _device(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if type(args[0]) is FakeTensor:
            return args[0].fake_device  # autograd asks ~10 times per region call site: answer at once
        return func(*args, **kwargs)

    def _run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Metadata queries a fake answers itself: never recorded, no bookkeeping."""
        return func(*args, **kwargs)

    def _collective(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Per-group ordered effects (``interposers.collectives``)."""
        if not self.recording:
            return func(*args, **kwargs)
        out = record_collective(self, func, args, kwargs)
        return self._record(func, args, kwargs) if out is NotImplemented else out

    def _data_dependent(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if not self.recording:
            return func(*args, **kwargs)
        value = self.constants.value(func, args, kwargs)
        if value is not UNKNOWN:  # a tensor made from Python constants only: eager's Python sees this
            return value
        raise DataDependentControlFlowError(
            f"{self.where()} uses the value of a tensor in Python ({func}) at {user_location()}.\n"
            "effectfx traces with fake tensors, so values are unknown during capture. Use tensor ops "
            "instead of Python control flow (e.g. torch.where), or move the check outside the captured "
            "function."
        )

    def _record(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Every other op: recorded into the current graph, run on fakes."""
        if not self.recording:
            return func(*args, **kwargs)
        args, kwargs = map_structure(self.to_fake, (args, kwargs))
        key = effect_of(func)
        composite = self.composite
        if composite.kernels and composite.skips(func, key):  # inside the kernel of a CIA effect op
            return self._run_fake(func, args, kwargs, key)
        builder = self.builder
        node_args, node_kwargs = map_structure(builder.node_of, (args, kwargs))
        if self.label_mode.sentinels and has_sentinel((args, kwargs)):
            (args, kwargs), (node_args, node_kwargs) = resolve_labels(
                self.label_mode, builder.labels, key is not None, (args, kwargs),
                (node_args, node_kwargs))
        mutation = mutation_of(func, args, kwargs)
        target = func if mutation is None else functional_target(self, func, mutation, key)
        mutated = list(mutation.written) if mutation is not None else []
        out = composite.take() if composite.pending is not None else self._run_fake(func, args, kwargs, key)
        out_tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if key is None and not out_tensors and mutation is None:
            return out  # metadata queries (prim.device, sym_size, ...): constants in a static trace
        written = [t for _, t in mutated]
        twins = self.constants.prepare(func, args, kwargs, out, written) if key is None else None
        if target is AUTO_FUNCTIONALIZED:
            node_args, node_kwargs = (func,), by_name(func, node_args, node_kwargs)
        node = builder.call(target, node_args, node_kwargs)
        if key is not None:
            node.meta["effect_key"] = key
            node.meta["location"] = user_location()
        if mutation is not None:
            self._bind_written(out, node, mutation)
        else:
            self._bind_outputs(out, node)
        fresh, self._fresh = self._fresh, None
        if mutated:
            for tensor_written in written:
                self._write_back(tensor_written, builder.values[id(tensor_written)])
        elif func is _LIFT_FRESH:
            # torch.tensor(data): data torch made for this call alone, lifted as a program constant. The
            # result stands for it: written functionally, never written back (the next call must see the
            # literal again); an in-place op with no functional form on it is refused
            # (mutation.functional_target)
            self.literals.add(id(out))
        elif getattr(func, "is_view", False) and args and isinstance(args[0], torch.Tensor):
            if not (func is _DETACH and fresh is not None and fresh[0] is args[0]
                    and fresh[1] == composite.calls):
                self._record_views(args[0], out_tensors)
        elif isinstance(out, torch.Tensor) and id(out) not in self.base_of:
            self._fresh = (out, composite.calls)
        if twins is not None:
            self.constants.commit(twins, written)
        return out

    # -- aliasing: views of intermediates, and writes through them ----------------------------------
    def _record_views(self, source: torch.Tensor, views: list[torch.Tensor]) -> None:
        root = self.base_of.get(id(source), source)
        for view in views:
            self.base_of[id(view)] = root
            self.views_of.setdefault(id(root), []).append(view)

    def _write_back(self, tensor: torch.Tensor, node: fx.Node) -> None:
        """After ``tensor`` got a new value (``node``): its base and every other view of that base see it,
        as they would in eager, through ``as_strided_scatter`` / ``as_strided`` on the base's new value."""
        root = self.base_of.get(id(tensor), tensor)
        views = self.views_of.get(id(root), ())
        if root is tensor and not views:
            return
        builder = self.builder
        root_node = node
        if root is not tensor:
            root_node = builder.call(aten.as_strided_scatter.default, (
                builder.values[id(root)], node, list(tensor.shape), list(tensor.stride()),
                tensor.storage_offset()))
            builder.bind(root, root_node)
            root_node.meta["val"] = root
        for view in views:
            if view is not tensor:
                alias = builder.call(aten.as_strided.default, (
                    root_node, list(view.shape), list(view.stride()), view.storage_offset()))
                builder.bind(view, alias)
                alias.meta["val"] = view

    def _bind_written(self, out: Any, node: fx.Node, mutation: Mutation) -> None:
        """Rebind each tensor a mutation wrote to its new value, where ``mutation.paths`` puts it in the
        node's result (``getitem`` nodes, one per element), and the op's own results to theirs."""
        builder = self.builder
        values: dict[int, Any] = {}
        if mutation.appended:  # ``*_functional``, ``auto_functionalized``: the op's results come first
            results = list(out) if isinstance(out, (tuple, list)) else [out]
            for i, item in enumerate(results):
                values[i] = item
                if isinstance(item, torch.Tensor):
                    builder.bind(item, builder.call(operator.getitem, (node, i)))
        elif isinstance(out, torch.Tensor) and out is not mutation.written[0][1]:
            builder.bind(out, node)
        items: dict[tuple[int, ...], fx.Node] = {(): node}
        for (_, tensor), path in zip(mutation.written, mutation.paths):
            for depth in range(1, len(path) + 1):
                if path[:depth] not in items:
                    parent = items[path[:depth - 1]]
                    items[path[:depth]] = builder.call(operator.getitem, (parent, path[depth - 1]))
            builder.bind(tensor, items[path])
            if len(path) == 1:
                values[path[0]] = tensor
            elif len(path) == 2:  # an element of a written list
                values.setdefault(path[0], []).append(tensor)
                items[path[:1]].meta["val"] = values[path[0]]
        if values:
            node.meta["val"] = tuple(values.get(i) for i in range(max(values) + 1))

    def _run_fake(self, func: Any, args: tuple, kwargs: dict, key: str | None) -> Any:
        try:
            if self.shape_env is not None:
                return self._run_symbolic(func, args, kwargs)
            return func(*args, **kwargs)
        except EffectfxError:
            raise
        except Exception as exc:  # turn torch's internal failures into errors that name the op
            if self.fake_mode.cache_enabled and any(
                    isinstance(a, torch.ScriptObject) for a in tree_flatten((args, kwargs))[0]):
                # torch's fake-op cache compares arguments, and script objects (a ProcessGroup) have no
                # __eq__: the lookup failed before the op ran, so run it again without the cache
                from torch._subclasses.fake_tensor import disable_fake_tensor_cache

                with disable_fake_tensor_cache(self.fake_mode):
                    return self._run_fake(func, args, kwargs, key)
            error, cause = fake_failure(exc, func, args, kwargs, self.where())
            raise error from cause

    def _run_symbolic(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` on fakes with symbolic sizes; a symbol it pins to a number is noted (for efx.explain)."""
        replacements = self.shape_env.replacements
        before = len(replacements)
        fake = SYMBOLIC_FAKES.get(func)
        out = fake(*args, **kwargs) if fake is not None else NotImplemented
        if out is NotImplemented:  # (a case the fake does not take: torch's own)
            out = func(*args, **kwargs)
        if len(replacements) != before:
            pinned = [f"{s} = {v}" for s, v in list(replacements.items())[before:] if v.is_number]
            if pinned:
                self.specialized.append(f"{func} at {user_location()} made {', '.join(pinned)}")
        return out

    def _bind_outputs(self, out: Any, node: fx.Node) -> None:
        builder = self.builder
        if isinstance(out, torch.Tensor):
            builder.bind(out, node)
            return
        if isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    builder.bind(item, builder.call(operator.getitem, (node, i)))
            node.meta["val"] = tuple(out)


# What the tracer does with each op, one rule per op (as JAX's per-primitive rules), found once per op
_RULES: dict[Any, Callable[[Tracer, Any, tuple, dict], Any]] = {
    _DEVICE: Tracer._device,
    **dict.fromkeys(_PASSTHROUGH - {_DEVICE}, Tracer._run),
    **dict.fromkeys(_DATA_DEPENDENT, Tracer._data_dependent),
}


def _rule_of(func: Any) -> Callable[[Tracer, Any, tuple, dict], Any]:
    if getattr(func, "namespace", None) in COLLECTIVE_NAMESPACES:
        return Tracer._collective
    return Tracer._record
