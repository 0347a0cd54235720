"""Testing support: recording effect ops and a differential check against eager PyTorch.

Used by the test suite and by ``effectfx fuzz``; importing it registers the ``efxtest::`` ops.
"""

from .differential import (
    EagerMismatch,
    check_against_eager,
    check_mutations_against_eager,
    run_eager,
    run_program,
)
from .effect_ops import EFFECT_KEYS, LOG, recording

__all__ = ["EFFECT_KEYS", "EagerMismatch", "LOG", "check_against_eager", "check_mutations_against_eager",
           "recording", "run_eager", "run_program"]
