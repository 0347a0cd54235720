"""Compiling one Inductor segment, and the caches of compiled segments: for the process (:data:`SEGMENTS`)
and on disk (:func:`artifact_path`), so a body is compiled once however many call sites, programs, input
signatures or processes share it (``effectfx.backends.inductor_segments`` runs them).

Each segment is compiled by ``torch._inductor.standalone_compile`` (aot_autograd's decompositions to core
aten, then Inductor) on fake example inputs built from the capture's metadata.  A segment with symbolic
sizes (Note [Symbolic shapes]) is compiled on examples whose sizes are symbols of a ShapeEnv of its own;
what Inductor's code assumed of them (a kernel chosen for ``8*z0*z1 <= 4096``) comes back as the
*variant's guards*: a segment keeps one variant per set of guards, and a size none of them admits
compiles another, as torch.compile recompiles.  Most segments have none: one variant serves every size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.utils._sympy.functions as sympy_functions

from ..graph.symbols import expr_of, is_symbolic

# an input's (shape, stride, dtype, device); a symbolic size is an expression over the segment's own
# symbols z0, z1, ... (canonical: equal segments of different programs compile once)
Meta = tuple[tuple[Any, ...], tuple[Any, ...], torch.dtype, torch.device]


def symbol(k: int) -> sympy.Symbol:
    return sympy.Symbol(f"z{k}", integer=True, positive=True)


def input_metas(values: list[torch.Tensor]) -> tuple[tuple[Meta, ...], tuple[int, ...]]:
    """The metadata of a segment's inputs (fakes), and the example value of each of its symbols.

    Inductor reads a symbol's value from an input dimension or stride that is exactly it; a symbol found
    only inside larger expressions -- ``(B*T, C)``, a flattened batch whose ``B`` and ``T`` no input has
    alone -- is one it cannot bind ("expected [s1, s0] to have been codegen-ed").  The segment reads no
    such symbol alone (``Lowering.size_inputs`` would have given it an input that has it), so each size
    made of them is one symbol of its own here: ``(z0, C)``, with the strides that use it rewritten."""
    exprs = [[[expr_of(d) if is_symbolic(d) else int(d) for d in group] for group in (t.shape, t.stride())]
             for t in values]
    bare = {d for sizes, strides in exprs for d in (*sizes, *strides) if isinstance(d, sympy.Symbol)}
    atoms: dict[Any, Any] = {}  # a size made of symbols no input has alone -> the symbol standing for it
    hint_of: dict[Any, int] = {}
    for t, (sizes, _) in zip(values, exprs):
        for d, e in zip(t.shape, sizes):
            if isinstance(e, sympy.Expr) and e not in atoms and e.free_symbols - bare:
                atoms[e] = sympy.Symbol(f"_atom{len(atoms)}", integer=True, positive=True)
                hint_of[atoms[e]] = int(d.node.shape_env.guarding_hint_or_throw(e))
    renamed: dict[Any, Any] = {}
    hints: list[int] = []
    metas = []
    for t, groups in zip(values, exprs):
        device = getattr(t, "fake_device", None) or t.device
        dims = []
        for group in groups:
            out: list[Any] = []
            for e in group:
                if type(e) is int:
                    out.append(e)
                    continue
                for atom, symbol_ in atoms.items():  # (subs: 64*B*T is 64*z0 once B*T is z0)
                    e = e.subs(atom, symbol_) if e.free_symbols & atom.free_symbols else e
                for s in sorted(e.free_symbols - set(renamed), key=str):
                    renamed[s] = symbol(len(renamed))
                    hints.append(hint_of[s] if s in hint_of else _hint(t, s))
                out.append(e.xreplace(renamed))
            dims.append(tuple(out))
        metas.append((dims[0], dims[1], t.dtype, device))
    return tuple(metas), tuple(hints)


def _hint(t: torch.Tensor, s: Any) -> int:
    env = next(d.node.shape_env for d in (*t.shape, *t.stride()) if is_symbolic(d))
    return int(env.guarding_hint_or_throw(s))


def example_inputs(metas: tuple[Meta, ...], hints: tuple[int, ...], fake_mode: Any
                   ) -> tuple[list[torch.Tensor], dict[Any, Any]]:
    """Fake inputs like ``metas`` in ``fake_mode``, each z<k> a symbol of its ShapeEnv (of value hints[k]),
    and the map from those symbols back to z<k>."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    env = fake_mode.shape_env
    symbols = {symbol(k): env.create_symbol(hint, ConstantSource(f"z{k}"), dynamic_dim=DimDynamic.DYNAMIC)
               for k, hint in enumerate(hints)}
    values = {symbol(k): hint for k, hint in enumerate(hints)}

    def size(d: Any) -> Any:
        if type(d) is int:
            return d
        return env.create_symintnode(d.xreplace(symbols), hint=int(d.xreplace(values)))

    with fake_mode:
        examples = [torch.empty_strided([size(d) for d in shape], [size(d) for d in stride], dtype=dtype,
                                        device=device) for shape, stride, dtype, device in metas]
    return examples, {v: k for k, v in symbols.items()}


def guards_hold(guards: tuple[Any, ...], sizes: tuple[int, ...]) -> bool:
    values = {symbol(k): v for k, v in enumerate(sizes)}
    return all(bool(g.xreplace(values)) for g in guards)


@dataclass
class Compiled:
    """One variant of a segment: Inductor's artifact (None: runs un-compiled, ``why``), its guards, and
    how it was made: "compiled", "loaded" (an earlier process's artifact) or "fell back"."""

    artifact: Any
    why: str | None = None
    guards: tuple[Any, ...] = ()
    how: str = "compiled"
    seconds: float = 0.0  # what compiling it took (a loaded one: its compile in the process that saved it)


@dataclass
class CacheStats:
    compiles: int = 0  # segments handed to Inductor
    loads: int = 0  # segments loaded from an artifact an earlier process saved
    hits: int = 0  # segments found compiled (another call site, body, program or signature)
    fallbacks: int = 0  # segments run un-compiled


SEGMENTS: dict[tuple, list[Compiled]] = {}  # _key(segment) -> its variants
STATS = CacheStats()
_LOCK = threading.Lock()  # one Inductor compile at a time (Inductor's state is global)
ARTIFACT_FORMAT = 2  # bump when what a saved artifact means changes


def clear_cache() -> None:
    """Forget every compiled segment of this process (saved artifacts stay; see :func:`artifact_path`)."""
    with _LOCK:
        SEGMENTS.clear()


def artifact_path(source: fx.GraphModule, inputs: tuple[Meta, ...]) -> Path:
    """Where a segment's compiled artifacts are saved (``<key>.bin``, and ``<key>.<n>.bin`` with an index
    ``<key>.json`` of their guards for a symbolic one): inside Inductor's cache directory (so
    ``TORCHINDUCTOR_CACHE_DIR`` governs both), named by everything the compiled code depends on."""
    from torch._inductor import config as inductor_config

    key = repr((ARTIFACT_FORMAT, torch.__version__, _key(source, inputs), inductor_config.get_hash(),
                torch._functorch.config.get_hash()))
    return artifacts_dir() / f"{hashlib.sha256(key.encode()).hexdigest()}.bin"


def mark_path(segments: list[tuple[fx.GraphModule, tuple[Meta, ...]]], what: str) -> Path:
    """A marker saved beside the artifacts that says ``what`` was saved for the program made of these
    segments (its tier 2: ``backends.tiers``), so that a later process can ask without building it."""
    names = sorted(artifact_path(source, inputs).name for source, inputs in segments)
    key = hashlib.sha256(repr((what, names)).encode()).hexdigest()
    return artifacts_dir() / f"{key}.{what}"


def artifacts_dir() -> Path:
    """The folder of every saved artifact (inside Inductor's cache directory)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "effectfx"


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


def _parse(text: str) -> Any:
    names = {name: getattr(sympy_functions, name) for name in sympy_functions.__all__}
    names.update({f"z{k}": symbol(int(k)) for k in re.findall(r"\bz(\d+)\b", text)})
    return sympy.sympify(text, locals=names)


def _index(path: Path) -> list[tuple[tuple[Any, ...], Path]]:
    """The saved variants of a symbolic segment: (guards, artifact file)."""
    try:
        entries = json.loads(path.with_suffix(".json").read_text())
        return [(tuple(_parse(g) for g in guards), path.with_name(name)) for guards, name in entries]
    except (OSError, ValueError, TypeError, SyntaxError, sympy.SympifyError):
        return []


def _save(artifact: Any, path: Path, guards: tuple[Any, ...] | None, seconds: float) -> None:
    """Write an artifact atomically (two processes may save the same segment at once), and beside it the
    ``seconds`` its compile took (what compiling it again would cost: ``backends.tiers``); a symbolic
    segment's (``guards`` not None) also goes into its index."""
    if not getattr(artifact, "is_saveable", lambda: True)():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        unique = f"{os.getpid()}.{threading.get_ident()}"
        target = path if guards is None else path.with_name(f"{path.stem}.{unique}.bin")
        tmp = target.with_name(f".{target.stem}.{unique}.tmp")
        artifact.save(path=str(tmp), format="binary")
        os.replace(tmp, target)
        target.with_suffix(".seconds").write_text(f"{seconds:.3f}")
        if guards is not None:
            entries = [[[str(g) for g in gs], p.name] for gs, p in _index(path)]
            entries.append([[str(g) for g in guards], target.name])
            index = path.with_name(f".{path.stem}.{unique}.json.tmp")
            index.write_text(json.dumps(entries))
            os.replace(index, path.with_suffix(".json"))
    except OSError:
        pass  # a read-only cache: the next process compiles again


def _saved_seconds(path: Path) -> float:
    """The seconds the saved artifact's compile took (0 when not recorded)."""
    try:
        return float(path.with_suffix(".seconds").read_text())
    except (OSError, ValueError):
        return 0.0


def _load(path: Path) -> Any:
    from torch._inductor import CompiledArtifact

    try:
        loaded = CompiledArtifact.load(path=str(path), format="binary")
    except Exception:  # noqa: BLE001 -- written by another torch, or damaged: compile anew (overwrite it)
        return None
    STATS.loads += 1
    return loaded


def _compile(source: fx.GraphModule, inputs: tuple[Meta, ...], hints: tuple[int, ...]) -> Compiled:
    """``standalone_compile`` of one segment (for ``hints``' sizes, and every size its guards admit),
    loaded from the artifact an earlier process saved when there is one."""
    from torch._inductor import standalone_compile
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    path = artifact_path(source, inputs)
    for guards, saved in _saved(path, hints):
        if (loaded := _load(saved)) is not None:
            return Compiled(loaded, guards=guards, how="loaded", seconds=_saved_seconds(saved))
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    start = time.perf_counter()
    try:
        examples, back = example_inputs(inputs, hints, fake_mode)
        with torch.no_grad(), _quiet_unsaveable():  # the inference path: segments run without grad
            artifact = standalone_compile(source, examples, dynamic_shapes="from_example_inputs",
                                          fake_mode=fake_mode, options=_config_patches(source))
    except Exception as e:  # noqa: BLE001 -- any Inductor failure: run the aten graph instead
        STATS.fallbacks += 1
        text = str(e).strip()
        return Compiled(None, f"{type(e).__name__}: {text.splitlines()[0] if text else ''}", how="fell back")
    STATS.compiles += 1
    # what Inductor's choices assumed of the sizes, over z<k>
    guards = tuple(g.expr.xreplace(back) for g in fake_mode.shape_env.guards)
    seconds = time.perf_counter() - start
    _save(artifact, path, guards if hints else None, seconds)
    return Compiled(artifact, guards=guards, seconds=seconds)


def _key(source: fx.GraphModule, inputs: tuple[Meta, ...]) -> tuple:
    """What a segment's compiled code depends on: its code, the objects that code names (FX writes some
    arguments as globals, not literals) and its inputs' metadata."""
    code = source.graph.python_code("self")
    key = code.src, tuple(sorted((k, repr(v)) for k, v in code.globals.items())), inputs
    options = options_of(source)
    return (*key, options) if options else key


def _config_patches(source: fx.GraphModule) -> dict[str, Any] | None:
    options = options_of(source)
    return {"config_patches": dict(options)} if options else None  # (compile_fx's keyword)


def options_of(source: fx.GraphModule) -> tuple[tuple[str, Any], ...]:
    """The Inductor options a segment is compiled with (``source.meta["inductor_options"]``, set by the
    lowering: tier 2's C++ wrapper, ``effectfx.backends.tiers``), as sorted pairs."""
    return tuple(sorted(source.meta.get("inductor_options", ())))


def _saved(path: Path, hints: tuple[int, ...]) -> list[tuple[tuple[Any, ...], Path]]:
    """The saved artifacts that may serve ``hints``' sizes, with their guards (a static segment's: one)."""
    if not hints:
        return [((), path)] if path.is_file() else []
    return [(guards, saved) for guards, saved in _index(path) if guards_hold(guards, hints)]


def _variant(variants: list[Compiled], hints: tuple[int, ...]) -> Compiled | None:
    """The variant compiled in this process that serves ``hints``' sizes (a static segment has one)."""
    if not hints:
        return variants[0] if variants else None
    return next((v for v in variants if guards_hold(v.guards, hints)), None)


def is_cached(source: fx.GraphModule, inputs: tuple[Meta, ...], hints: tuple[int, ...] = ()) -> bool:
    """Whether the variant serving ``hints``' sizes is at hand without compiling: in :data:`SEGMENTS`, or
    saved by an earlier process."""
    with _LOCK:
        if _variant(SEGMENTS.get(_key(source, inputs), []), hints) is not None:
            return True
    return bool(_saved(artifact_path(source, inputs), hints))


def compiled_or_why(source: fx.GraphModule, inputs: tuple[Meta, ...], hints: tuple[int, ...] = ()
                    ) -> tuple[Compiled, str]:
    """The variant of the segment that serves ``hints``' sizes, compiled once per process (and set of
    guards), and how this call got it: its ``how``, or "cache hit" when found in :data:`SEGMENTS`."""
    key = _key(source, inputs)
    with _LOCK:
        variants = SEGMENTS.setdefault(key, [])
        found = _variant(variants, hints)
        if found is None:
            found = _compile(source, inputs, hints)
            variants.append(found)
            return found, found.how
        STATS.hits += 1
    return found, "cache hit"
