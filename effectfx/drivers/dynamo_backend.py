"""``torch.compile(model, backend="effectfx")``: effectfx behind Dynamo (Note [Dynamo backend]).

Dynamo runs the user's Python -- every construct it handles, side effects replayed, graph breaks where it
cannot -- and hands each graph it made (a ``GraphModule`` of torch calls, the parameters among its inputs) to
:func:`effectfx_backend`.  The backend makes the graph module an ``efx.compile``'d callable
(:class:`~effectfx.drivers.callable.CompiledCallable`), so effectfx's whole pipeline applies to it:
functionalization and effect tokens, its own joint forward/backward under autograd, write-backs of
mutated inputs, and regions -- Dynamo's ``invoke_subgraph`` calls (``torch.compiler.nested_compile_region``)
are effectfx regions (``effectfx.hops.dynamo_region``).  The capture runs at the graph's first call, on the
real inputs (Dynamo hands fake example inputs in some modes; they are not used), and what effectfx refuses
in a graph is refused there with effectfx's own error.  Between graphs the code runs eagerly, so effects keep
eager's order across graph breaks.

Dynamic sizes.  A graph Dynamo made with symbolic sizes (``dynamic=True``, or automatic dynamic once a size
changed) takes them as ``int`` inputs; effectfx would capture it once per size.  ``drivers.dynamo_inputs``
rewrites it so that effectfx captures it once, symbolically: the sizes are read from the tensors' dimensions
Dynamo made symbolic, and those are symbolic from effectfx's first capture.

``options={"backend": "inductor"}`` selects effectfx's Inductor lowering (``efx.compile(..., backend=
"inductor")``); the default is ``"eager"``.

The name is registered two ways.  Installed, the ``torch_dynamo_backends`` entry point names this module's
:func:`effectfx_backend`, so ``backend="effectfx"`` works without importing effectfx (a config string, as
torchtitan or Lightning pass it).  ``import effectfx`` calls :func:`register`, which must not import Dynamo
(seconds; effectfx imports it only when a capture first needs it): when Dynamo's registry is already
imported it registers directly, else it adds a finder to ``sys.meta_path`` whose only job is to list the same
entry point to ``importlib.metadata`` (the documented way to extend its search), which torch reads the first
time a backend name is unknown to it.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from ..errors import BackendError
from ..program.containers import register_tensor_holders
from .callable import BACKEND_PASSES, CompiledCallable
from .dynamo_inputs import effectfx_inputs

NAME = "effectfx"
_TARGET = "effectfx.drivers.dynamo_backend:effectfx_backend"
_OPTIONS = ("backend",)


def effectfx_backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *, mode: str | None = None,
                     options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """Dynamo's backend: ``gm`` as an ``efx.compile``'d callable, captured at its first call (module
    docstring).  ``options={"backend": "eager" | "inductor"}`` is effectfx's lowering."""
    options = dict(options or {})
    lowering = options.pop("backend", "eager")
    if options:
        raise BackendError(f"torch.compile(backend={NAME!r}) got options it does not know: "
                           f"{sorted(options)}; it takes {list(_OPTIONS)} ({{'backend': one of "
                           f"{sorted(BACKEND_PASSES)}}}).")
    if mode not in (None, "default"):
        raise BackendError(f"torch.compile(backend={NAME!r}) takes no mode (got {mode!r}); choose effectfx's "
                           "lowering with options={'backend': 'inductor'}.")
    if lowering not in BACKEND_PASSES:
        raise BackendError(f"torch.compile(backend={NAME!r}): unknown options['backend'] {lowering!r}; "
                           f"choose one of {sorted(BACKEND_PASSES)}.")
    # now, not at the first capture: it registers transformers' cache classes with pytree, and Dynamo
    # guards on the number of pytree classes -- registered after this graph's guards, it recompiles it
    register_tensor_holders()
    gm, inputs = effectfx_inputs(gm, example_inputs)  # sizes symbolic, numbers plain (drivers.dynamo_inputs)
    for module in gm.modules():  # Dynamo's graph modules make their code at the first call: made now, or
        if isinstance(module, _LazyGraphModule):  # the capture would see their classes change under it
            module.real_recompile()
    # tier 1 only: a tier-2 build in a background thread sets torch.fx's process-wide tracing flag, and
    # Dynamo refuses any compiled frame another thread enters meanwhile (docs/SUPPORT.md, "Known bugs")
    compiled = CompiledCallable(gm.forward, backend=lowering, tiers="tier1")
    compiled.shapes.declared = inputs.dynamic
    return inputs.adapt(compiled)


# -- registration -------------------------------------------------------------------------------------
class _EntryPoints(importlib.metadata.Distribution):
    """A distribution holding only effectfx's ``torch_dynamo_backends`` entry point (for an effectfx that
    is imported but not installed with its entry points: a source checkout on ``PYTHONPATH``)."""

    _FILES = {
        "METADATA": "Metadata-Version: 2.1\nName: effectfx-dynamo-backend\nVersion: 0\n",
        "entry_points.txt": f"[torch_dynamo_backends]\n{NAME} = {_TARGET}\n",
    }

    def read_text(self, filename: str) -> str | None:
        return self._FILES.get(filename)

    def locate_file(self, path: Any) -> Any:
        return path


class _EntryPointFinder:
    """On ``sys.meta_path``: finds no module; lists :class:`_EntryPoints` to ``importlib.metadata``."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == "effectfx-dynamo-backend":
            yield _EntryPoints()


def register() -> None:
    """Make ``backend="effectfx"`` known to ``torch.compile`` without importing Dynamo (module docstring)."""
    registry = sys.modules.get("torch._dynamo.backends.registry")
    if registry is not None:
        if NAME not in registry._BACKENDS:  # (listed there already: an entry point torch loads itself)
            registry.register_backend(effectfx_backend, name=NAME)
        return
    if not any(isinstance(finder, _EntryPointFinder) for finder in sys.meta_path):
        sys.meta_path.append(_EntryPointFinder())  # type: ignore[arg-type]
