"""A compiled program's guards as generated code (``effectfx.regions.guard_code``): the same verdict as
``object_guards_hold`` on every state -- a real model's guards under changes that break each kind of guard,
and generated guards over generated objects (hypothesis)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import effectfx as efx
import effectfx.testing  # noqa: F401  (registers the efxtest:: ops)
from effectfx.regions.guard_code import GuardChecker
from effectfx.regions.identity import object_guards, object_guards_hold
from effectfx.regions.reads import MISSING, Ref, expectation
from effectfx.testing import hf


def _both(guards: tuple) -> tuple[bool, bool]:
    """The generated code's verdict (a checker's third call on: its first two run the loop) and the loop's."""
    check = GuardChecker(guards)
    first = [check() for _ in range(3)]
    assert check.run is not None and len(set(first)) == 1
    return first[-1], object_guards_hold(*object_guards(guards))


CHANGES: dict[str, Callable[[torch.nn.Module], None]] = {
    "a config value": lambda m: setattr(m.config, "use_cache", not m.config.use_cache),
    "a submodule replaced": lambda m: setattr(m.transformer.h[1].layer, "mlp",
                                              type(m.transformer.h[1].layer.mlp)(256, m.config)),
    "an attribute found missing now present": lambda m: setattr(m.config, "is_causal", True),
    "a tuple value": lambda m: setattr(m.transformer.ln_f, "normalized_shape", (32,)),
    "a layer's name": lambda m: setattr(m.transformer.h[0], "name", "renamed"),
    "training mode": lambda m: m.eval(),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_real_model_s_guards_agree_and_fail(change: str) -> None:
    model = hf.build("gpt2")
    compiled = efx.compile(model)
    compiled(**hf.batch("gpt2", torch.Generator().manual_seed(0)))
    (entry,) = [e for entries in compiled.compiled.cache.values() for e in entries]
    assert _both(entry.guards) == (True, True)
    CHANGES[change](model)
    verdict = _both(entry.guards)
    assert verdict[0] == verdict[1]
    if change != "a layer's name":  # a label: an operand of the body, not a guard
        assert verdict == (False, False)


class Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


VALUES = st.one_of(st.integers(-2, 2), st.booleans(), st.sampled_from(["a", "b"]), st.none(),
                   st.tuples(st.integers(0, 2), st.integers(0, 2)))
NAMES = st.sampled_from(["a", "b", "c"])


@st.composite
def trees(draw: Any, depth: int = 0) -> Obj:
    fields = {}
    for name in draw(st.lists(NAMES, unique=True, max_size=3)):
        fields[name] = draw(trees(depth + 1)) if depth < 2 and draw(st.booleans()) else draw(VALUES)
    return Obj(**fields)


def _read(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = getattr(obj, name, MISSING)
    return obj


@settings(max_examples=200, deadline=None)
@given(trees(), st.lists(st.lists(NAMES, min_size=1, max_size=3), max_size=8),
       st.lists(st.tuples(st.lists(NAMES, min_size=1, max_size=3), VALUES), max_size=4))
def test_generated_guards_agree_with_the_loop(root: Obj, paths: list[list[str]],
                                              changes: list[tuple[list[str], Any]]) -> None:
    guards = []
    for path in paths:  # what a capture would have recorded of the tree as it is
        value = _read(root, tuple(path))
        expect = expectation(value, structural=False) if not isinstance(value, Obj) else ("is", Ref(value))
        guards.append(((("id", Ref(root)), *path), expect))
    guards = tuple(guards)
    assert _both(guards) == (True, True)
    for path, value in changes:  # then the tree changes
        owner = _read(root, tuple(path[:-1]))
        if isinstance(owner, Obj):
            setattr(owner, path[-1], value)
    now, loop = _both(guards)
    assert now == loop


GOLDEN = """
def check():
    v0 = getattr(c0, 'n', MISSING)
    if v0 is not c1 and (type(v0) is not type(c1) or v0 != c1): return False
    v1 = getattr(c0, 'cfg', MISSING)
    if v1 is not c2: return False
    v2 = getattr(v1, 'flag', MISSING)
    if v2 is not c3 and (type(v2) is not type(c3) or v2 != c3): return False
    v3 = getattr(v1, 'shape', MISSING)
    if type(v3) is not tuple or v3 != c4: return False
    v4 = getattr(v1, 'gone', MISSING)
    if v4 is not MISSING: return False
    return True
"""


def test_golden_generated_guards_read_each_prefix_once() -> None:
    """A value, an object by identity, a value and a tuple through it, an attribute found missing: one
    read of ``root.cfg`` serves the three guards below it; the first two calls run the loop."""
    inner = Obj(flag=True, shape=(2, 3))
    root = Obj(cfg=inner, n=4)
    guards = (((("id", Ref(root)), "n"), ("=", int, 4)),
              ((("id", Ref(root)), "cfg"), ("is", Ref(inner))),
              ((("id", Ref(root)), "cfg", "flag"), ("=", bool, True)),
              ((("id", Ref(root)), "cfg", "shape"), ("=", tuple, (2, 3))),
              ((("id", Ref(root)), "cfg", "gone"), ("missing",)))
    check = GuardChecker(guards)
    assert check() and check() and check.run is None
    assert check() and check.run.source.strip() == GOLDEN.strip()
    inner.flag = False
    assert not check()
