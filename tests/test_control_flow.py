# ruff: noqa: E501  (golden graph text has long lines)
"""torch.cond, while_loop and scan in captured code (Note [Control flow]).

Each differential test runs eager and every form of ``FORMS`` plus two calls of ``efx.compile`` on the same
inputs and compares outputs, gradients and the effect log; ``both_ways`` runs one captured program on
inputs that take each branch (or loop a different number of times), so the predicate and the trip count
are run-time values.  Golden tests pin the token convention in branches and loop bodies.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import textwrap

import pytest
import torch
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

import effectfx as efx
from effectfx.testing import check_against_eager
from effectfx.testing.differential import FORMS, compare, run_eager
from effectfx.testing.effect_ops import recording

R = torch.ops.efxtest


def randn(*shape: int, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(requires_grad)


def both_ways(fn, inputs: list[tuple], forms=tuple(FORMS)) -> None:
    """One program per form, captured on ``inputs[0]``, run on every input: each equals eager."""
    for name in (*forms, "saved", "compile"):
        if name == "compile":
            prog = efx.compile(fn)
        else:
            with recording() as capture_log:
                prog = FORMS["token-free" if name == "saved" else name](fn, inputs[0], {})
            assert capture_log == [], f"[{name}] capture ran effects"
            if name == "saved":
                with tempfile.TemporaryDirectory() as tmp:
                    prog.save(f"{tmp}/p.zip")
                    prog = efx.load(f"{tmp}/p.zip")
        for args in inputs:
            eager = run_eager(fn, args)
            with recording() as log:
                out = prog(*args)
            outs = torch.utils._pytree.tree_flatten(out)[0]
            got = type(eager)(outs, [], log, [])
            compare(name, type(eager)(eager.outputs, [], eager.log, []), got)


def dedent(s: str) -> str:
    return textwrap.dedent(s).strip("\n")


# -- programs ----------------------------------------------------------------------------------------
@efx.region
def inner(x):
    R.record_memory("inner")
    return x * 3


def branches_with_effects(x):
    def yes(x):
        R.record_memory("yes")
        return x.sin()

    def no(x):
        R.log_tensor(x, "no")
        R.record_stdout("no")
        return x.cos()

    R.record_memory("before")
    y = torch.cond(x.sum() > 0, yes, no, (x,))
    R.log_tensor(y, "after")
    return y * 2


def region_in_branch(x):
    return torch.cond(x.sum() > 0, lambda x: inner(x) + 1, lambda x: x - 1, (x,))


@efx.region
def block(x, w):
    R.record_stdout("block")
    return torch.cond(x.sum() > 0, lambda x: inner(x) @ w, lambda x: (x * 2) @ w, (x,))


def cond_in_region(x, w):
    return block(block(x, w), w)


def nested(x):
    def outer_yes(x):
        return torch.cond(x.mean() > 1, lambda y: inner(y), lambda y: y.neg(), (x,))

    return torch.cond(x.sum() > 0, outer_yes, lambda x: x.cos(), (x,))


def loop(i, x):
    def body(i, x):
        R.log_tensor(x, "body")
        return i + 1, inner(x)

    return while_loop(lambda i, x: i < 3, body, (i, x))


def cumulative(init, xs):
    def combine(c, x):
        R.log_tensor(c, "step")
        return c + x, (c * x).clone()

    return scan(combine, init, xs)


class Gated(torch.nn.Module):
    """cond in training: a parameter read in one branch only, a region and an effect whose backward
    records (``scale``) in the other."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 3)
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        R.record_stdout("start")
        y = torch.cond(x.sum() > 0, lambda x: R.scale(inner(self.lin(x)), 2.0).tanh(),
                       lambda x: R.bump(x * self.w, "no"), (x,))
        return y * 2


POS, NEG = randn(3).abs() + 0.1, -randn(3).abs() - 0.1


# -- differential tests --------------------------------------------------------------------------------
@pytest.mark.parametrize("x", [POS, NEG], ids=["true", "false"])
def test_effects_in_branches_match_eager(x) -> None:
    check_against_eager(branches_with_effects, x)


def test_one_program_takes_both_branches() -> None:
    both_ways(branches_with_effects, [(POS,), (NEG,), (POS * 2,)])


def test_region_in_branch() -> None:
    both_ways(region_in_branch, [(POS,), (NEG,)])


def test_cond_in_a_region_called_twice_one_body() -> None:
    w = randn(3, 3, seed=1)
    both_ways(cond_in_region, [(POS, w), (NEG, w)])
    prog = efx.capture(cond_in_region, POS, w)
    assert list(prog.region_traces) == ["subgraph_0", "subgraph_1"]


def test_nested_cond() -> None:
    both_ways(nested, [(POS + 1,), (POS * 0.01,), (NEG,)])


def test_while_loop_trip_count_is_a_run_time_value() -> None:
    x = randn(3)
    both_ways(loop, [(torch.tensor(0), x), (torch.tensor(2), x), (torch.tensor(5), x), (torch.tensor(-2), x)])


def test_scan_with_effects() -> None:
    both_ways(cumulative, [(torch.zeros(3), randn(4, 3)), (torch.ones(3), randn(4, 3, seed=2))])


@pytest.mark.parametrize("x", [POS, NEG], ids=["true", "false"])
def test_cond_training_matches_eager(x) -> None:
    """Gradients (input and parameters) and the effect log, eager's included: its cond backward runs the
    taken branch again, effects too."""
    model = Gated()
    check_against_eager(model, x.clone().requires_grad_(True))
    check_against_eager(model, x.clone())


# -- flex_attention ------------------------------------------------------------------
def _relative(score, b, h, q, kv):
    return score + (q - kv) * 0.1


def _causal(b, h, q, kv):
    return q >= kv


@efx.region
def attention(q, k, v):
    from torch.nn.attention.flex_attention import flex_attention

    R.record_memory("attention")
    return flex_attention(q, k, v, score_mod=_relative)


def two_layers(q, k, v):
    return attention(attention(q, k, v), k, v)


def masked(q, k, v):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(_causal, 1, 1, 16, 16, device="cpu")
    return flex_attention(q, k, v, score_mod=_relative, block_mask=mask)


QKV = tuple(randn(1, 2, 16, 8, seed=s) for s in (3, 4, 5))


def test_flex_attention_in_regions_matches_eager() -> None:
    check_against_eager(two_layers, *QKV)
    prog = efx.capture(two_layers, *QKV)
    assert list(prog.region_traces) == ["subgraph_0"]  # one body for both layers


def test_flex_attention_with_a_block_mask_matches_eager() -> None:
    check_against_eager(masked, *QKV)


def test_flex_attention_training_is_refused_where_eager_refuses() -> None:
    q = QKV[0].clone().requires_grad_(True)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        two_layers(q, *QKV[1:])
    with recording() as log, pytest.raises(efx.UnsupportedOperatorError, match="region 'attention'") as info:
        efx.capture(two_layers, q, *QKV[1:])
    assert "test_control_flow.py" in str(info.value) and "backward on CPU" in str(info.value)
    assert log == []


# -- golden graphs of the token convention (Note [Control flow]) -------------------------------------------
GOLDEN = pathlib.Path(__file__).parent / "golden" / "control_flow"


def _loop_two_keys(i, x):
    def body(i, x):
        R.record_stdout("body")
        return i + 1, x * 2

    R.record_memory("before")
    return while_loop(lambda i, x: i < 3, body, (i, x))


GOLDEN_CASES = {
    # both branches take and return both tokens; the true branch passes 'stdout' through, the false 'memory'
    "cond": (branches_with_effects, lambda: (POS,)),
    # the region inside the true branch threads the branch's token; the false branch passes it through
    "cond_region": (region_in_branch, lambda: (POS,)),
    # tokens are loop-carried in front of the carried values; the condition takes them and hands them back
    "while_loop": (_loop_two_keys, lambda: (torch.tensor(0), randn(3))),
    # tokens are part of scan's carry, in front of the user's carry
    "scan": (cumulative, lambda: (torch.zeros(3), randn(4, 3))),
}


@pytest.mark.parametrize("form", ["functionalized", "unlifted", "token-free"])
@pytest.mark.parametrize("case", list(GOLDEN_CASES))
def test_golden(case: str, form: str) -> None:
    """Normalized graph text (``Program.code()``); ``EFFECTFX_WRITE_GOLDEN=1`` rewrites the files."""
    fn, args = GOLDEN_CASES[case]
    prog = FORMS[form](fn, args(), {})
    efx.verify(prog)
    path = GOLDEN / f"{case}.{form}.txt"
    if os.environ.get("EFFECTFX_WRITE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(prog.code() + "\n")
    assert prog.code().strip() == path.read_text().strip()
