"""Golden tests of every form (captured, functionalized, unlifted, token-free) for two programs.

Each case prints the normalized graph text (``Program.code()``) of one form and compares it with the
expected text below; one line per case says what it proves.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

import effectfx as efx
from effectfx.testing import check_against_eager
from effectfx.testing.models import Stack

GOLDEN = pathlib.Path(__file__).parent / "golden" / "passes"


@efx.region
def seed_region(x):
    torch.ops.efxtest.record_memory("N")
    return x + x


def seed(x):
    return seed_region(seed_region(x))


def three_blocks() -> Stack:
    torch.manual_seed(0)
    return Stack(3, done=True)


CASES = {
    "seed": (lambda: seed, lambda: (torch.ones(3),)),
    "three_blocks": (lambda: three_blocks().requires_grad_(False), lambda: (torch.ones(2, 4),)),
}

FORMS_UNDER_TEST = {
    "captured": lambda fn, args: efx.capture(fn, *args, functionalize=False),
    "functionalized": lambda fn, args: efx.capture(fn, *args),
    "unlifted": lambda fn, args: efx.unlift_tokens(efx.capture(fn, *args)),
    "token-free": lambda fn, args: efx.remove_effect_tokens(efx.capture(fn, *args)),
}

# what each golden case proves, one line each
PROVES = {
    ("seed", "captured"): "the seed's 'Before': one shared subgraph, the effect called directly",
    ("seed", "functionalized"): "the seed's 'After': the region takes and returns the token, calls chain it",
    ("seed", "unlifted"): "no token at any boundary; make_token/sink_tokens per graph; calls wrapped",
    ("seed", "token-free"): "with_effects unwrapped, getitem indices shifted, the subgraph still shared",
    ("three_blocks", "captured"): "three blocks share one body with lifted weights; top-level effect last",
    ("three_blocks", "functionalized"): "two keys: sorted token positions, block calls thread 'memory' only",
    ("three_blocks", "unlifted"): "one-key region calls wrapped; the root makes and sinks both keys",
    ("three_blocks", "token-free"): "no tokens anywhere; the effects in node order",
}


def code_of(prog) -> str:
    if isinstance(prog, efx.TrainingProgram):
        return prog.forward.code() + "\n\n" + prog.backward.code()
    return prog.code()


@pytest.mark.parametrize("case,form", list(PROVES))
def test_golden(case: str, form: str) -> None:
    build, args = CASES[case]
    prog = FORMS_UNDER_TEST[form](build(), args())
    assert prog.form == form
    assert prog.token_keys == (() if form != "functionalized" else prog.token_keys)
    efx.verify(prog)
    expected = (GOLDEN / f"{case}.{form}.txt").read_text()
    assert code_of(prog).strip() == expected.strip(), PROVES[(case, form)]


@pytest.mark.parametrize("case", list(CASES))
def test_every_form_matches_eager(case: str) -> None:
    build, args = CASES[case]
    check_against_eager(build(), *args())
