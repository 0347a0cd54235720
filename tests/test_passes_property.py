"""Property-based: random small programs (regions up to three deep, shared, effect-only, several keys, pure
or effectful, with or without autograd) through every form, the verifier and DCE, compared with eager."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import effectfx as efx
from effectfx.testing import check_against_eager

EFFECTS = {
    "memory": lambda x, tag: torch.ops.efxtest.record_memory(tag),
    "stdout": lambda x, tag: torch.ops.efxtest.log_tensor(x, tag),
    "collective:tp": lambda x, tag: torch.ops.efxtest.record_collective_tp(tag),
}
PURE = {
    "sin": torch.sin,
    "double": lambda x: x * 2,
    "tanh": torch.tanh,
    "bump": lambda x: torch.ops.efxtest.bump(x, "b"),  # effectful, returns a tensor
}

# a statement: ("effect", key) | ("pure", name) | ("call", region index) | ("drop", region index)
statement = st.one_of(
    st.tuples(st.just("effect"), st.sampled_from(sorted(EFFECTS))),
    st.tuples(st.just("pure"), st.sampled_from(sorted(PURE))),
    st.tuples(st.just("call"), st.integers(0, 2)),
    st.tuples(st.just("drop"), st.integers(0, 2)),  # call, result unused: effect-only if it has effects
)
bodies = st.lists(st.lists(statement, max_size=4), min_size=1, max_size=3)


def build(spec: list[list[tuple]], root: list[tuple]):
    """Region i may only call regions j > i (no recursion); the root may call any."""
    regions: list = []

    def run(stmts, x, depth_from):
        for kind, arg in stmts:
            if kind == "effect":
                EFFECTS[arg](x, f"{kind}{depth_from}")
            elif kind == "pure":
                x = PURE[arg](x)
            elif arg >= depth_from and arg < len(regions):
                y = regions[arg](x)
                x = x if kind == "drop" else y
        return x + 1

    for i, stmts in enumerate(spec):
        def body(x, stmts=stmts, i=i):
            return run(stmts, x, i + 1)

        body.__name__ = f"r{i}"
        regions.append(efx.region(body))
    return lambda x: run(root, x, 0)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=bodies, root=st.lists(statement, min_size=1, max_size=5), grad=st.booleans())
def test_random_programs_every_form(spec, root, grad) -> None:
    fn = build(spec, root)
    x = torch.randn(3, requires_grad=grad)
    check_against_eager(fn, x, calls=1)
    prog = efx.capture(fn, x)
    for form in (prog, efx.unlift_tokens(prog), efx.remove_effect_tokens(prog),
                 efx.remove_effect_tokens(efx.unlift_tokens(prog))):
        efx.verify(form)
        efx.verify(efx.dead_code_elimination(form) if not isinstance(form, efx.TrainingProgram)
                   else form.map(efx.dead_code_elimination))
