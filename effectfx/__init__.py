"""effectfx: capture PyTorch programs into FX graphs with reusable regions and effect tokens.

The model is written once, in ``effectfx.notes`` (Note [Effect tokens], Note [Region identity],
Note [Joint trace]).
"""

from __future__ import annotations

from . import ops
from .capture.capture import capture
from .effects import effect_of, register_effect
from .errors import (
    BackendError,
    CaptureError,
    DataDependentControlFlowError,
    EffectfxError,
    EffectfxWarning,
    FreeTensorError,
    MissingFakeImplError,
    RegionEffectsChangedError,
    RegionRecursionError,
    RegistryError,
    SignatureMismatchError,
    UnfaithfulPrintWarning,
    UnsupportedMutationError,
    UnsupportedOperatorError,
    UnsupportedReturnError,
    VerificationError,
)
from .explain import Explanation, explain
from .passes.dce import dead_code_elimination
from .passes.remove_tokens import remove_effect_tokens
from .passes.unlift import unlift_tokens
from .passes.verify import verify
from .regions import region
from .runtime.compile import CompiledCallable, compile
from .runtime.program import Program, TrainingProgram
from .runtime.serialize import load

__all__ = [
    "BackendError", "CaptureError", "CompiledCallable", "DataDependentControlFlowError", "EffectfxError",
    "FreeTensorError", "MissingFakeImplError", "Program", "RegionEffectsChangedError",
    "RegionRecursionError", "RegistryError", "SignatureMismatchError", "TrainingProgram",
    "UnsupportedMutationError", "UnsupportedReturnError", "VerificationError", "EffectfxWarning",
    "UnfaithfulPrintWarning", "UnsupportedOperatorError", "capture", "compile",
    "effect_of", "explain", "Explanation", "ops", "region", "register_effect",
    "dead_code_elimination", "load", "remove_effect_tokens", "unlift_tokens", "verify",
]
