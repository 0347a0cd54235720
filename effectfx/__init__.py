"""effectfx: capture PyTorch programs into FX graphs with reusable regions and effect tokens.

The model is written once, in ``effectfx.notes`` (Note [Effect tokens], Note [Region identity],
Note [Joint trace]).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import ops
from .backends.tiers import Tiers
from .capture.shapes import mark_dynamic, mark_static
from .drivers.callable import CompiledCallable
from .drivers.capture import capture
from .drivers.compile import compile
from .drivers.dynamo_backend import register as _register_dynamo_backend
from .effects import effect_of, register_effect
from .errors import (
    BackendError,
    CallbackError,
    CaptureError,
    CaptureSideEffectWarning,
    DataDependentControlFlowError,
    EagerFallbackWarning,
    EffectfxError,
    EffectfxWarning,
    FakeTensorLeakError,
    FreeTensorError,
    MissingFakeImplError,
    OpError,
    PartialBackwardError,
    PythonStateError,
    RegionEffectsChangedError,
    RegionRecursionError,
    RegistryError,
    SerializationError,
    SignatureMismatchError,
    UnfaithfulPrintWarning,
    UnsupportedMutationError,
    UnsupportedOperatorError,
    UnsupportedParallelWrapperError,
    UnsupportedReturnError,
    VerificationError,
)
from .interposers.callback import TensorSpec, callback, effect
from .passes.dce import dead_code_elimination
from .passes.remove_tokens import remove_effect_tokens
from .passes.unlift import unlift_tokens
from .program.program import Program
from .program.training import TrainingProgram
from .regions.decorator import region

_register_dynamo_backend()  # torch.compile(backend="effectfx"), without importing Dynamo now

if TYPE_CHECKING:
    from .backends.progress import log_compiles
    from .explanation import Explanation, explain
    from .passes.verify import verify
    from .program.training import load

# Imported on first use (PEP 562), not by ``import effectfx``: a capture never needs them, and every module
# spared here is time a user's first ``import effectfx`` does not pay.
_LAZY = {
    "explain": "explanation", "Explanation": "explanation", "load": "program.training",
    "verify": "passes.verify", "log_compiles": "backends.progress",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'effectfx' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__all__ = [
    "BackendError", "CallbackError", "CaptureError", "CaptureSideEffectWarning", "CompiledCallable",
    "DataDependentControlFlowError", "EagerFallbackWarning", "EffectfxError", "OpError",
    "FakeTensorLeakError", "FreeTensorError", "MissingFakeImplError", "PartialBackwardError", "Program",
    "PythonStateError", "RegionEffectsChangedError", "RegionRecursionError", "RegistryError",
    "SerializationError", "SignatureMismatchError", "TensorSpec", "Tiers", "TrainingProgram",
    "UnsupportedMutationError", "UnsupportedReturnError", "VerificationError", "EffectfxWarning",
    "UnfaithfulPrintWarning", "UnsupportedOperatorError", "UnsupportedParallelWrapperError", "capture",
    "compile", "callback", "effect",
    "effect_of", "explain", "Explanation", "mark_dynamic", "mark_static", "ops", "region", "register_effect",
    "dead_code_elimination", "load", "log_compiles", "remove_effect_tokens", "unlift_tokens", "verify",
]
