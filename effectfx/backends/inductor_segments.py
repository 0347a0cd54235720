"""Inductor segments: a pure piece of a token-free graph compiled by Inductor, its cache for the process
and on disk, and its un-compiled fallback (``lower_to_inductor``'s steps 2 and 3,
``effectfx.backends.inductor``).

Each segment is compiled by ``torch._inductor.standalone_compile`` (aot_autograd's decompositions to core
aten, then Inductor) on fake example inputs built from the capture's tensor metadata.  Compiled segments
are cached for the process by their code and input metadata (:data:`SEGMENTS`), so a body is compiled once
however many call sites, programs or input signatures share it; and saved as ``CompiledArtifact`` files in
Inductor's cache directory (:func:`artifact_path`), so a second process loads each in milliseconds.  A
segment Inductor cannot compile runs its aten graph un-compiled, with an :class:`InductorFallbackWarning`
naming the region: never a wrong result.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from ..errors import EffectfxWarning


class InductorFallbackWarning(EffectfxWarning):
    """A pure segment Inductor could not compile runs un-compiled (correct, slower)."""


Meta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


def input_meta(t: torch.Tensor) -> Meta:
    device = getattr(t, "fake_device", None) or t.device
    return tuple(t.shape), tuple(t.stride()), t.dtype, device


def example_input(meta: Meta) -> torch.Tensor:
    shape, stride, dtype, device = meta
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


class InductorSegment(torch.nn.Module):
    """One pure segment: ``forward(*tensors)`` returns the values later nodes read (a list or tuple).

    ``compiled`` is Inductor's artifact, or None when the segment runs its aten graph (``source``).  The
    first call runs the artifact; when it holds one Inductor-compiled graph whose outputs are exactly the
    artifact's (checked on that call, value for value), later calls run that graph directly, without the
    aot_autograd wrappers around it (about 20 us a call; a transformer block calls two segments a step)."""

    def __init__(self, source: fx.GraphModule, inputs: tuple[Meta, ...], where: str) -> None:
        super().__init__()
        object.__setattr__(self, "source", source)  # the aten graph (not a submodule: printed apart)
        self.inputs = inputs
        self.where = where
        self._found: tuple[Any, str | None] | None = None  # (artifact or None, why not): on first use
        self.run: Any = None  # boxed: run([*tensors]) -> outputs; set by the first call

    @classmethod
    def ready(cls, source: fx.GraphModule, compiled: Any, inputs: tuple[Meta, ...]) -> InductorSegment:
        """A segment around an artifact compiled elsewhere (``compiled(*tensors)``)."""
        segment = cls(source, inputs, "a compiled graph")
        segment._found = (compiled, None)
        return segment

    @property
    def compiled(self) -> Any:
        """Inductor's artifact, compiled (or loaded) on first use: a segment that never runs -- the full
        backward of a program whose callers only ever backpropagate some outputs (Note [Partial
        backward]) -- costs no compile."""
        if self._found is None:
            self._found = _compiled_or_why(self.source, self.inputs)
            if self._found[0] is None:
                size = len(self.source.graph.nodes)
                warnings.warn(f"Inductor could not compile a segment of {self.where} ({size} nodes); it runs "
                              f"un-compiled. {self._found[1]}", InductorFallbackWarning, stacklevel=3)
        return self._found[0]

    @property
    def reason(self) -> str | None:
        """Why the segment runs un-compiled, if it does."""
        return None if self.compiled is not None else self._found[1]  # type: ignore[index]

    def __call__(self, *args: torch.Tensor) -> Any:
        # a segment is effectfx's, not the user's: torch's global module hooks must not see it
        return self.forward(*args)

    def forward(self, *args: torch.Tensor) -> Any:
        run = self.run
        if run is not None:
            try:
                return run(list(args))
            except AssertionError:  # compiled code checks its inputs' layout first, before any work
                return run(self._traced_layout(args))
        if self.compiled is None:
            return self.source(*args)
        return self._first_call(args)

    def _traced_layout(self, args: tuple) -> list[torch.Tensor]:
        """The inputs, copied into the strides they were traced with where they differ (an expanded
        tangent); dimensions of size 1 do not count, as in Inductor's check."""
        out = list(args)
        for i, (t, (shape, stride, _, _)) in enumerate(zip(args, self.inputs)):
            if any(n > 1 and s != g for n, s, g in zip(shape, stride, t.stride())):
                out[i] = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
        return out

    def _first_call(self, args: tuple) -> Any:
        artifact = self.compiled
        args = tuple(self._traced_layout(args))
        outs = artifact(*args)
        run = lambda inputs: artifact(*inputs)  # noqa: E731
        direct = _compiled_graph(artifact)
        if direct is not None:
            try:
                mine = direct(list(args))
            except Exception:  # noqa: BLE001 -- the artifact's own path is the reference
                mine = None
            if mine is not None and len(mine) == len(outs) and all(
                    type(a) is type(b) and (not isinstance(a, torch.Tensor) or (
                        a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
                        and torch.equal(a, b))) for a, b in zip(mine, outs)):
                run, outs = direct, mine
        # Inductor hands an input back as an output where the op was an alias (detach, a no-op view);
        # an aten op never does: that output would be the caller's tensor itself, requiring grad
        inputs = {id(a) for a in args}
        returned = [k for k, o in enumerate(outs) if id(o) in inputs]
        if returned:
            self.run = lambda inputs, run=run: _fresh(run(inputs), returned)
            return _fresh(outs, returned)
        self.run = run
        return outs


def _fresh(outs: Any, indices: list[int]) -> list[Any]:
    """``outs`` with the tensors at ``indices`` replaced by new aliases (graphs run without autograd, so
    the alias requires no grad, as eager's detach or view would not in the same place)."""
    outs = list(outs)
    for k in indices:
        outs[k] = outs[k].detach()
    return outs


def _compiled_graph(artifact: Any) -> Any:
    """The boxed callable of the one Inductor graph inside a ``standalone_compile`` artifact (found
    through the closures of aot_autograd's wrappers), or None when there is not exactly one, the
    wrappers pass parameters of their own, or the graph mutates inputs."""
    from torch._inductor.output_code import CompiledFxGraph

    found: list[Any] = []
    seen: set[int] = set()
    stack = [getattr(artifact, "_compiled_fn", None)]
    while stack and len(seen) < 100:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, CompiledFxGraph):
            found.append(obj)
        elif callable(getattr(obj, "__code__", None)) or hasattr(obj, "__closure__"):
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                try:
                    value = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if name == "params_buffers_flat" and value:  # leading inputs of the wrappers' own
                    return None
                if callable(value):
                    stack.append(value)
        else:  # aot_autograd's SerializableCompiledFunction holds the graph
            stack.append(getattr(obj, "compiled_fn", None))
    if len(found) != 1 or found[0].mutated_inputs or found[0].current_callable is None:
        return None
    return found[0].current_callable


# -- the caches of compiled segments ----------------------------------------------------------------------
@dataclass
class CacheStats:
    compiles: int = 0  # segments handed to Inductor
    loads: int = 0  # segments loaded from an artifact an earlier process saved
    hits: int = 0  # segments found compiled (another call site, body, program or signature)
    fallbacks: int = 0  # segments run un-compiled


SEGMENTS: dict[tuple, tuple[Any, str | None]] = {}  # _key(segment) -> (compiled or None, why not)
STATS = CacheStats()
_LOCK = threading.Lock()  # one Inductor compile at a time (Inductor's state is global)
ARTIFACT_FORMAT = 1  # bump when what a saved artifact means changes


def clear_cache() -> None:
    """Forget every compiled segment of this process (saved artifacts stay; see :func:`artifact_path`)."""
    with _LOCK:
        SEGMENTS.clear()


def artifact_path(source: fx.GraphModule, inputs: tuple[Meta, ...]) -> Path:
    """Where a segment's compiled artifact is saved: inside Inductor's cache directory (so
    ``TORCHINDUCTOR_CACHE_DIR`` governs both), named by everything the compiled code depends on."""
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = repr((ARTIFACT_FORMAT, torch.__version__, _key(source, inputs), inductor_config.get_hash(),
                torch._functorch.config.get_hash()))
    return Path(cache_dir()) / "effectfx" / f"{hashlib.sha256(key.encode()).hexdigest()}.bin"


@contextlib.contextmanager
def _quiet_unsaveable() -> Iterator[None]:
    """Silence standalone_compile's warning that it has nothing to save (a graph that compiles to no
    kernel): on stderr it would interleave with the program's own output; the next process compiles such
    a segment again from Inductor's caches instead of loading our artifact."""
    logger = logging.getLogger("torch._inductor.standalone_compile")
    quiet = lambda record: "cannot save" not in record.getMessage()  # noqa: E731
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _compile(source: fx.GraphModule, inputs: tuple[Meta, ...]) -> tuple[Any, str | None]:
    """``torch._inductor.standalone_compile`` (aot_autograd's decompositions, then Inductor) of one segment,
    saved as a ``CompiledArtifact`` that a later process loads in milliseconds instead of tracing and
    looking up Inductor's caches again."""
    from torch._inductor import CompiledArtifact, standalone_compile
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    path = artifact_path(source, inputs)
    if path.is_file():
        try:
            loaded = CompiledArtifact.load(path=str(path), format="binary")
            STATS.loads += 1
            return loaded, None
        except Exception:  # written by another torch, or damaged: compile anew (and overwrite it)
            pass
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())  # static shapes: specialized on these examples
    try:
        with fake_mode:
            examples = [example_input(m) for m in inputs]
        with torch.no_grad(), _quiet_unsaveable():  # the inference path: segments run without grad
            artifact = standalone_compile(source, examples, dynamic_shapes="from_example_inputs",
                                          fake_mode=fake_mode)
    except Exception as e:  # any Inductor failure: run the aten graph instead
        STATS.fallbacks += 1
        return None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    STATS.compiles += 1
    if getattr(artifact, "is_saveable", lambda: True)():
        try:  # atomically: two processes may save the same segment at once
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.tmp")
            artifact.save(path=str(tmp), format="binary")
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache: the next process compiles again
    return artifact, None


def _key(source: fx.GraphModule, inputs: tuple[Meta, ...]) -> tuple:
    """What a segment's compiled code depends on: its code, the objects that code names (FX writes some
    arguments as globals, not literals) and its inputs' metadata."""
    code = source.graph.python_code("self")
    return code.src, tuple(sorted((k, repr(v)) for k, v in code.globals.items())), inputs


def compiled_segment(source: fx.GraphModule, inputs: tuple[Meta, ...], where: str) -> InductorSegment:
    """The segment ``source`` (canonical names, see ``_Lowering.segment``), compiled once per process, on
    its first use."""
    return InductorSegment(source, inputs, where)


def _compiled_or_why(source: fx.GraphModule, inputs: tuple[Meta, ...]) -> tuple[Any, str | None]:
    key = _key(source, inputs)
    with _LOCK:
        found = SEGMENTS.get(key)
        if found is None:
            found = SEGMENTS[key] = _compile(source, inputs)
        else:
            STATS.hits += 1
    return found


# -- splitting graphs ------------------------------------------------------------------------------------
