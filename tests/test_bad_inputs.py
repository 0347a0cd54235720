"""A catalogue of bad inputs: each is refused with a clear EffectfxError subclass.

Every refusal must name the region or op, the user's source line, and what to do; after any error the
caches (efx.compile's signature cache, a region's known effects) hold nothing half-built, and the next
good call works.  A line marked ``# <- name`` is the source line the error must point at.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import effectfx as efx
import effectfx.testing  # noqa: F401  (registers the efxtest:: ops)
from effectfx.testing import check_against_eager, recording

_SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> str:
    """``test_bad_inputs.py:<line>`` of the line ending in ``# <- marker``."""
    (lineno,) = [i + 1 for i, line in enumerate(_SOURCE) if line.rstrip().endswith(f"# <- {marker}")]
    return f"{Path(__file__).name}:{lineno}"


def assert_clear(exc: BaseException, *, names: str, line: str | None, advice: str) -> None:
    """The message names ``names`` (region/op), ``line`` (source line) and gives ``advice`` (a regex)."""
    text = str(exc)
    assert names in text, f"message does not name {names!r}:\n{text}"
    if line is not None:
        assert line in text, f"message does not point at {line}:\n{text}"
    assert re.search(advice, text, re.IGNORECASE), f"message gives no advice matching {advice!r}:\n{text}"


# -- ops used only by these tests ------------------------------------------------------------------
@torch.library.custom_op("efxfuzz::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x + 1


efx.register_effect(no_fake, key="memory")

FLAKY_LOG: list[str] = []
FAIL: set[str] = set()


@torch.library.custom_op("efxfuzz::flaky", mutates_args=())
def flaky(label: str) -> None:
    """An effect that raises while its label is in FAIL, and logs it otherwise."""
    if label in FAIL:
        raise RuntimeError(f"flaky effect {label!r} failed")
    FLAKY_LOG.append(label)


flaky.register_fake(lambda label: None)
efx.register_effect(flaky, key="memory")


@torch.library.custom_op("efxfuzz::flaky_double", mutates_args=())
def flaky_double(x: torch.Tensor) -> torch.Tensor:
    """``2 * x``; its backward performs the effect ``flaky("backward")``."""
    return x * 2


flaky_double.register_fake(lambda x: torch.empty_like(x))


def _flaky_double_backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
    torch.ops.efxfuzz.flaky("backward")
    return grad * 2


flaky_double.register_autograd(_flaky_double_backward)


@pytest.fixture(autouse=True)
def _clean() -> None:
    FLAKY_LOG.clear()
    FAIL.clear()


# -- data-dependent Python control flow ------------------------------------------------------------
def test_data_dependent_if_in_region() -> None:
    @efx.region
    def branchy(x):
        if x.sum() > 0:  # <- branchy
            return x * 2
        return -x

    with pytest.raises(efx.DataDependentControlFlowError) as info:
        efx.capture(branchy, torch.randn(4))
    assert_clear(info.value, names="'branchy'", line=line_of("branchy"), advice=r"torch\.where|outside")


def test_data_dependent_item_in_root() -> None:
    def scaled(x):
        return x * x.max().item()  # <- item

    with pytest.raises(efx.DataDependentControlFlowError) as info:
        efx.capture(scaled, torch.randn(4))
    assert_clear(info.value, names="captured function", line=line_of("item"), advice=r"tensor ops|outside")


def test_data_dependent_output_shape() -> None:
    def positives(x):
        return x[x > 0]  # <- mask

    with pytest.raises(efx.DataDependentControlFlowError) as info:
        efx.capture(positives, torch.randn(4))
    assert_clear(info.value, names="aten.index", line=line_of("mask"), advice=r"static shapes")


def test_failed_compile_leaves_cache_empty_and_next_call_works() -> None:
    def maybe_branchy(x, check):
        if check and x.sum() > 0:  # <- maybe
            return x
        torch.ops.efxtest.record_memory("ran")
        return x * 2

    cfn = efx.compile(maybe_branchy)
    x = torch.randn(4)
    with recording() as log, pytest.raises(efx.DataDependentControlFlowError) as info:
        cfn(x, True)
    assert_clear(info.value, names="captured function", line=line_of("maybe"), advice=r"torch\.where")
    assert log == []  # capture never runs an effect, and nothing ran after the failure
    assert cfn.cache == {} and cfn.stats.compiles == 0 and cfn.stats.calls == 0
    with recording() as log:
        assert torch.equal(cfn(x, False), x * 2)
    assert log == [("record_memory", "ran")]
    assert cfn.stats.compiles == 1 and len(cfn.cache) == 1
    with pytest.raises(efx.DataDependentControlFlowError):  # the failing signature still fails, cleanly
        cfn(x, True)
    assert cfn.stats.compiles == 1 and len(cfn.cache) == 1


# -- effectful op without a fake implementation ----------------------------------------------------
def test_effectful_op_without_fake_impl() -> None:
    @efx.region
    def uses_no_fake(x):
        return torch.ops.efxfuzz.no_fake(x) * 2  # <- nofake

    with recording() as log, pytest.raises(efx.MissingFakeImplError) as info:
        efx.capture(uses_no_fake, torch.randn(4))
    assert_clear(info.value, names="efxfuzz::no_fake", line=line_of("nofake"), advice=r"register_fake")
    assert "'uses_no_fake'" in str(info.value)
    assert log == []
    assert uses_no_fake.__effectfx_region__.known_effects == {}


# -- register_effect on an unknown op or with a bad key --------------------------------------------
def test_register_unknown_op() -> None:
    with pytest.raises(efx.RegistryError) as info:
        efx.register_effect("efxfuzz::does_not_exist", key="memory")
    assert_clear(info.value, names="efxfuzz::does_not_exist", line=None, advice=r"custom_op")
    assert efx.effect_of("efxfuzz::does_not_exist") is None


def test_register_name_without_namespace() -> None:
    with pytest.raises(efx.RegistryError) as info:
        efx.register_effect("record_memory")
    assert_clear(info.value, names="record_memory", line=None, advice=r"namespace::name")


def test_register_not_an_op() -> None:
    with pytest.raises(efx.RegistryError) as info:
        efx.register_effect(print)
    assert_clear(info.value, names="print", line=None, advice=r"custom_op")


@pytest.mark.parametrize("key", ["", "has space", "semi;colon", 3, None])
def test_register_bad_key(key: object) -> None:
    before = efx.effect_of(flaky)
    with pytest.raises(efx.RegistryError) as info:
        efx.register_effect(flaky, key=key)  # type: ignore[arg-type]
    assert_clear(info.value, names=repr(key), line=None, advice=r"a key is")
    assert efx.effect_of(flaky) == before == "memory"  # the registry is untouched


def test_register_bad_key_names_the_op() -> None:
    with pytest.raises(efx.RegistryError) as info:
        efx.register_effect(flaky, key="has space")
    assert "efxfuzz::flaky" in str(info.value)


# -- mutation of inputs ----------------------------------------------------------------------------
def _eager_and_compiled(fn, *make_args):
    """(outputs, args after the call) of eager and of efx.compile, from equal fresh arguments."""
    results = []
    for run in (fn, efx.compile(fn)):
        args = [make() for make in make_args]
        results.append((run(*args), args))
    return results


def test_region_mutates_its_input_like_eager() -> None:
    # Note [Mutations]: the body returns the new value, the call site writes the caller's tensor
    @efx.region
    def bump_in_place(x):
        x.add_(1)
        return x * 2

    (want, want_args), (got, got_args) = _eager_and_compiled(lambda x: bump_in_place(x),
                                                             lambda: torch.zeros(4))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_args, want_args)


def test_region_copies_into_its_input_like_eager() -> None:
    @efx.region
    def overwrite(x, y):
        x.copy_(y)
        return x

    (want, want_args), (got, got_args) = _eager_and_compiled(overwrite, lambda: torch.zeros(4),
                                                             lambda: torch.ones(4))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_args, want_args)


def test_root_mutates_its_input_under_compile_like_eager() -> None:
    def scale_in_place(x):
        x.mul_(2)
        return x

    (want, want_args), (got, got_args) = _eager_and_compiled(scale_in_place, lambda: torch.ones(4))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_args, want_args)

def test_in_place_on_intermediate_is_supported() -> None:
    @efx.region
    def fine(x):
        y = x * 1.0
        y.add_(1)
        torch.ops.efxtest.log_tensor(y, "y")
        return y

    check_against_eager(lambda x: fine(fine(x)), torch.randn(4, requires_grad=True))


# -- unsupported return values ---------------------------------------------------------------------
class _Opaque:
    pass


@pytest.mark.parametrize("value", [{1, 2}, _Opaque(), slice(1, 2)], ids=["set", "object", "slice"])
def test_region_returns_unsupported_object(value: object) -> None:
    @efx.region
    def odd(x):
        return x * 2, value

    with pytest.raises(efx.UnsupportedReturnError) as info:
        efx.capture(lambda x: odd(x)[0], torch.randn(4))
    assert_clear(info.value, names="'odd'", line=None, advice=r"return tensors")
    assert type(value).__name__ in str(info.value)
    assert odd.__effectfx_region__.known_effects == {}


def test_unsupported_return_names_source_line() -> None:
    @efx.region
    def odd(x):
        return x * 2, _Opaque()  # <- oddreturn

    with pytest.raises(efx.UnsupportedReturnError) as info:
        efx.capture(lambda x: odd(x)[0], torch.randn(4))
    assert line_of("oddreturn") in str(info.value)


def test_root_returns_unsupported_object() -> None:
    with pytest.raises(efx.UnsupportedReturnError) as info:
        efx.capture(lambda x: (x + 1, _Opaque()), torch.randn(4))
    assert_clear(info.value, names="captured function", line=None, advice=r"return tensors")


def test_constants_in_returns_are_supported() -> None:
    @efx.region
    def mixed(x):
        torch.ops.efxtest.record_stdout("mixed")
        return {"y": x * 2, "n": 3, "s": "ok", "none": None}

    check_against_eager(lambda x: mixed(x), torch.randn(4, requires_grad=True))


# -- recursion -------------------------------------------------------------------------------------
def test_recursion_into_the_same_region() -> None:
    @efx.region
    def halve(x, n):
        return x if n == 0 else halve(x * 0.5, n - 1)  # <- recurse

    with pytest.raises(efx.RegionRecursionError) as info:
        efx.capture(halve, torch.randn(4), 3)
    assert_clear(info.value, names="'halve'", line=line_of("recurse"), advice=r"unroll|remove @region")


def test_mutual_recursion() -> None:
    @efx.region
    def ping(x, n):
        return x if n == 0 else pong(x + 1, n - 1)

    @efx.region
    def pong(x, n):
        return ping(x * 2, n)  # <- pong

    with pytest.raises(efx.RegionRecursionError) as info:
        efx.capture(ping, torch.randn(4), 2)
    assert_clear(info.value, names="ping -> pong -> ping", line=line_of("pong"), advice=r"unroll")


# -- a region whose effect set differs between traces of the same cache key ------------------------
# State a region's own code names (closures, globals) is guarded (Note [Region identity]); state read
# inside a callee is not, so a flip there can only be caught when the body is traced again.
_MOODY = {"log": False}


def _moody_logs() -> bool:
    return _MOODY["log"]


@contextlib.contextmanager
def moody_logging() -> Iterator[None]:
    """Flip the callee's flag for the duration (no guard sees it: a region's callees are not guarded)."""
    _MOODY["log"] = True
    try:
        yield
    finally:
        _MOODY["log"] = False


def test_flag_in_region_closure_is_guarded() -> None:
    flag = {"log": False}

    @efx.region
    def moody(x):
        if flag["log"]:
            torch.ops.efxtest.record_stdout("moody")
        torch.ops.efxtest.record_memory("moody")
        return x * 2

    x = torch.randn(4)
    for log_it in (False, True, False):
        flag["log"] = log_it
        with recording() as log:
            efx.capture(moody, x)(x)
        assert log == [("record_stdout", "moody")] * log_it + [("record_memory", "moody")]


def test_effect_set_changes_between_captures() -> None:
    @efx.region
    def moody(x):
        if _moody_logs():
            torch.ops.efxtest.record_stdout("moody")  # only sometimes
        torch.ops.efxtest.record_memory("moody")
        return x * 2

    x = torch.randn(4)
    efx.capture(moody, x)
    known = dict(moody.__effectfx_region__.known_effects)
    assert list(known.values()) == [frozenset({"memory"})]
    with moody_logging():
        with pytest.raises(efx.RegionEffectsChangedError) as info:
            efx.capture(moody, x)
    assert_clear(info.value, names="'moody'", line=None, advice=r"pass that state to the region")
    assert "stdout" in str(info.value)
    assert moody.__effectfx_region__.known_effects == known  # not polluted by the refused trace
    with recording() as log:
        efx.capture(moody, x)(x)
    assert log == [("record_memory", "moody")]


def test_effect_set_change_names_source_line() -> None:
    @efx.region
    def moody(x):
        if _moody_logs():
            torch.ops.efxtest.record_stdout("moody")  # <- moody
        return x * 2

    efx.capture(moody, torch.randn(4))
    with moody_logging():
        with pytest.raises(efx.RegionEffectsChangedError) as info:
            efx.capture(moody, torch.randn(4))
    assert line_of("moody") in str(info.value)


def test_backward_effect_set_changes_between_captures() -> None:
    @efx.region
    def maybe_scaled(x):
        if _moody_logs():
            x = torch.ops.efxtest.scale(x, 2.0)  # its backward records on "memory"
        return x * 3

    x = torch.randn(4, requires_grad=True)
    efx.capture(maybe_scaled, x)
    known = dict(maybe_scaled.__effectfx_region__.known_effects)
    with moody_logging():
        with pytest.raises(efx.RegionEffectsChangedError) as info:
            efx.capture(maybe_scaled, x)
    assert_clear(info.value, names="'maybe_scaled'", line=None, advice=r"argument")
    assert "backward" in str(info.value)
    assert maybe_scaled.__effectfx_region__.known_effects == known


def test_effect_set_change_under_compile_leaves_cache_empty() -> None:
    @efx.region
    def moody(x):
        if _moody_logs():
            torch.ops.efxtest.record_stdout("moody")
        return x * 2

    x = torch.randn(4)
    efx.compile(moody)(x)
    cfn = efx.compile(moody)
    with moody_logging():
        with recording() as log, pytest.raises(efx.RegionEffectsChangedError):
            cfn(x)
    assert log == [] and cfn.cache == {} and cfn.stats.compiles == 0
    assert torch.equal(cfn(x), x * 2) and cfn.stats.compiles == 1


# -- calling a Program with inputs it was not captured for -----------------------------------------
def _logged_add(x, y):
    torch.ops.efxtest.log_tensor(x, "x")
    return x + y


@pytest.mark.parametrize(
    ("args", "kwargs", "says"),
    [
        ((torch.randn(4), torch.randn(4)), {}, "float32[3]"),  # shape
        ((torch.randn(3).double(), torch.randn(3)), {}, "float64[3]"),  # dtype
        ((torch.randn(3),), {}, "captured for arguments"),  # fewer arguments
        ((torch.randn(3), torch.randn(3), torch.randn(3)), {}, "captured for arguments"),  # more
        ((torch.randn(3),), {"y": torch.randn(3)}, "captured for arguments"),  # keyword instead
        ((torch.randn(3), 2.0), {}, "2.0"),  # a number where a tensor was
    ],
    ids=["shape", "dtype", "fewer", "more", "keyword", "number"],
)
def test_program_refuses_other_inputs(args: tuple, kwargs: dict, says: str) -> None:
    prog = efx.capture(_logged_add, torch.randn(3), torch.randn(3))
    with recording() as log, pytest.raises(efx.SignatureMismatchError) as info:
        prog(*args, **kwargs)
    assert log == []  # refused before any effect ran
    assert_clear(info.value, names="_logged_add", line=None, advice=r"capture again|effectfx\.compile")
    assert says in str(info.value)
    x, y = torch.randn(3), torch.randn(3)
    assert torch.equal(prog(x, y), x + y)  # and it still works for what it was captured for


def test_program_refuses_other_constant() -> None:
    prog = efx.capture(lambda x, s: x * s, torch.randn(3), 2.0)
    with pytest.raises(efx.SignatureMismatchError) as info:
        prog(torch.randn(3), 3.0)
    assert_clear(info.value, names="3.0", line=None, advice=r"capture again")


def test_training_program_refuses_other_inputs() -> None:
    prog = efx.capture(_logged_add, torch.randn(3, requires_grad=True), torch.randn(3))
    assert isinstance(prog, efx.TrainingProgram)
    with recording() as log, pytest.raises(efx.SignatureMismatchError):
        prog(torch.randn(5, requires_grad=True), torch.randn(5))
    assert log == []


def test_compile_recaptures_for_other_inputs() -> None:
    cfn = efx.compile(_logged_add)
    for x, y in [(torch.randn(3), torch.randn(3)), (torch.randn(4), torch.randn(4)),
                 (torch.randn(3).double(), torch.randn(3).double()), (torch.randn(3), torch.randn(3))]:
        with recording() as log:
            out = cfn(x, y)
        assert torch.equal(out, x + y)
        assert [entry[:3] for entry in log] == [("log_tensor", "x", tuple(x.shape))]
    assert cfn.stats.compiles == 3
    out = cfn(torch.randn(3), y=torch.randn(3))  # a keyword argument is another signature
    assert cfn.stats.compiles == 4 and out.shape == (3,)
    s2 = efx.compile(lambda x, s: x * s)
    assert torch.equal(s2(torch.ones(2), 2.0), torch.full((2,), 2.0))
    assert torch.equal(s2(torch.ones(2), 3.0), torch.full((2,), 3.0))
    assert s2.stats.compiles == 2


def test_program_refuses_other_strides() -> None:
    prog = efx.capture(_logged_add, torch.randn(2, 3), torch.randn(2, 3))
    x = torch.randn(3, 2).t()
    assert not x.is_contiguous()
    with recording() as log, pytest.raises(efx.SignatureMismatchError) as info:
        prog(x, torch.randn(2, 3))
    assert log == []
    assert_clear(info.value, names="_logged_add", line=None, advice=r"capture again|effectfx\.compile")


def test_compile_recaptures_for_other_strides() -> None:
    # a program captured for contiguous inputs traces reshape as view; reused on a transposed input it
    # failed (found here and in test_compile_recompile.py)
    def flat_sum(x, y):
        torch.ops.efxtest.log_tensor(x, "x")
        return (x + y).reshape(-1)

    cfn = efx.compile(flat_sum)
    y = torch.randn(2, 3)
    for x in (torch.randn(2, 3), torch.randn(3, 2).t()):
        with recording() as log:
            out = cfn(x, y)
        assert torch.equal(out, flat_sum(x, y))
        assert [entry[:2] for entry in log] == [("log_tensor", "x")]


# -- an effect op raising at run time --------------------------------------------------------------
@efx.region
def _two_effects(x):
    torch.ops.efxfuzz.flaky("a")
    torch.ops.efxfuzz.flaky("b")
    return x + 1


def _flaky_program(x):
    y = _two_effects(x)
    torch.ops.efxfuzz.flaky("c")
    return _two_effects(torch.ops.efxfuzz.flaky_double(y))


@pytest.mark.parametrize("make", ["capture", "compile"])
def test_effect_raising_at_run_time(make: str) -> None:
    x = torch.randn(4, requires_grad=True)
    run = efx.capture(_flaky_program, x) if make == "capture" else efx.compile(_flaky_program)
    FAIL.add("c")
    with pytest.raises(RuntimeError, match="flaky effect 'c' failed"):
        run(x)
    assert FLAKY_LOG == ["a", "b"]  # what ran before the failure ran once; nothing after it
    FAIL.clear()
    FLAKY_LOG.clear()
    out = run(x)  # the next call works, with every effect exactly once
    assert FLAKY_LOG == ["a", "b", "c", "a", "b"]
    out.sum().backward()
    assert FLAKY_LOG == ["a", "b", "c", "a", "b", "backward"]
    assert torch.allclose(x.grad, torch.full((4,), 2.0))
    if make == "compile":
        assert run.stats.compiles == 1


def test_effect_raising_in_backward() -> None:
    x = torch.randn(4, requires_grad=True)
    cfn = efx.compile(_flaky_program)
    out = cfn(x)
    FAIL.add("backward")
    with pytest.raises(RuntimeError, match="flaky effect 'backward' failed"):
        out.sum().backward()
    assert FLAKY_LOG == ["a", "b", "c", "a", "b"]
    FAIL.clear()
    FLAKY_LOG.clear()
    x.grad = None
    cfn(x).sum().backward()
    assert FLAKY_LOG == ["a", "b", "c", "a", "b", "backward"]
    assert torch.allclose(x.grad, torch.full((4,), 2.0))
    assert cfn.stats.compiles == 1


def test_effect_raising_inside_nested_region() -> None:
    @efx.region
    def inner(x):
        torch.ops.efxfuzz.flaky("inner")
        return x * 2

    @efx.region
    def outer(x):
        torch.ops.efxfuzz.flaky("outer-before")
        y = inner(x)
        torch.ops.efxfuzz.flaky("outer-after")
        return y

    cfn = efx.compile(lambda x: outer(outer(x)))
    x = torch.randn(3)
    FAIL.add("outer-after")
    with pytest.raises(RuntimeError):
        cfn(x)
    assert FLAKY_LOG == ["outer-before", "inner"]
    FAIL.clear()
    FLAKY_LOG.clear()
    assert torch.equal(cfn(x), x * 4)
    assert FLAKY_LOG == ["outer-before", "inner", "outer-after"] * 2
    assert cfn.stats.compiles == 1


# -- reading a caller's intermediate tensor from a region ------------------------------------------
def test_region_reads_caller_intermediate() -> None:
    stash: dict[str, torch.Tensor] = {}

    @efx.region
    def reads_stash(x):
        return x + stash["y"]  # <- free

    def caller(x):
        stash["y"] = x * 3
        return reads_stash(x)

    cfn = efx.compile(caller)
    with pytest.raises(efx.FreeTensorError) as info:
        cfn(torch.randn(4))
    assert_clear(info.value, names="'reads_stash'", line=line_of("free"), advice=r"as an argument")
    assert cfn.cache == {} and cfn.stats.compiles == 0
    assert reads_stash.__effectfx_region__.known_effects == {}


def test_region_reads_closed_over_constant_is_supported() -> None:
    weight = torch.randn(4, 4)

    @efx.region
    def proj(x):
        torch.ops.efxtest.record_collective_tp("proj")
        return x @ weight

    check_against_eager(lambda x: proj(proj(x)), torch.randn(2, 4, requires_grad=True))


# -- Python state the capture cannot see -----------------------------------------------------------
def test_no_grad_block_result_does_not_require_grad() -> None:
    def f(x):
        with torch.no_grad():
            y = x * 2
        return y + 1

    x = torch.randn(3, requires_grad=True)
    assert not f(x).requires_grad
    assert not efx.capture(f, x)(x).requires_grad


def test_no_grad_region_call_matches_eager() -> None:
    @efx.region
    def inner(x):
        torch.ops.efxtest.record_memory("inner")
        return x * 2

    def f(x):
        with torch.no_grad():
            y = inner(x)
        return torch.sigmoid(y)

    check_against_eager(f, torch.randn(3, requires_grad=True))


# -- more refusals listed in docs/SUPPORT.md ------------------------------------------------------
@torch.library.custom_op("efxfuzz::mutating_effect", mutates_args=("x",))
def mutating_effect(x: torch.Tensor) -> None:
    x.add_(1)


mutating_effect.register_fake(lambda x: None)
efx.register_effect(mutating_effect, key="memory")


def test_in_place_on_tensor_with_views_is_supported() -> None:
    """Writes into an intermediate are seen through its views, as in eager (no longer refused)."""
    def viewed(x):
        y = x * 1.0
        first = y[0]
        y.add_(1)
        return first

    check_against_eager(viewed, torch.randn(3, 2, requires_grad=True))


def test_in_place_on_a_view_of_an_input_like_eager() -> None:
    def writes_input_view(x):
        x[0].add_(1)
        return x * 2

    (want, want_args), (got, got_args) = _eager_and_compiled(writes_input_view, lambda: torch.ones(3, 2))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_args, want_args)

def test_effectful_op_mutating_its_argument() -> None:
    def writes(x):
        y = x * 1.0
        torch.ops.efxfuzz.mutating_effect(y)  # <- muteffect
        return y

    with pytest.raises(efx.UnsupportedMutationError) as info:
        efx.capture(writes, torch.randn(3))
    assert_clear(info.value, names="effectful op", line=line_of("muteffect"), advice=r"out-of-place")


def test_int_of_tensor() -> None:
    def as_int(x):
        return x * int(x.sum())  # <- int

    with pytest.raises(efx.DataDependentControlFlowError) as info:
        efx.capture(as_int, torch.randn(3))
    assert_clear(info.value, names="captured function", line=line_of("int"), advice=r"torch\.where")


def test_unknown_backend() -> None:
    with pytest.raises(efx.BackendError) as info:
        efx.compile(lambda x: x, backend="no-such-backend")
    assert_clear(info.value, names="no-such-backend", line=None, advice=r"choose one of")


def test_compiled_callable_sees_global_flag_change() -> None:
    flag = {"log": False}

    def f(x):
        if flag["log"]:
            torch.ops.efxtest.record_stdout("flag")
        return x * 2

    cfn = efx.compile(f)
    x = torch.randn(3)
    cfn(x)
    flag["log"] = True
    with recording() as eager_log:
        f(x)
    try:
        with recording() as log:
            cfn(x)
    except efx.EffectfxError:
        return  # refusing (and saying why) would keep the promise too
    assert log == eager_log


# -- checkpointing and tensors kept in Python state ---------------------------------------------------------
_CKPT_LIN = torch.nn.Linear(4, 4)


@efx.region
def _checkpointed(t):
    torch.ops.efxtest.record_memory("ckpt")
    return torch.tanh(_CKPT_LIN(t))


def test_a_region_under_checkpoint_is_refused_and_checkpoint_inside_a_region_works() -> None:
    from torch.utils.checkpoint import checkpoint

    def around(x):
        return checkpoint(_checkpointed, x, use_reentrant=False).sum()

    with pytest.raises(efx.CaptureError, match=r"'_checkpointed'.*saved-tensor hooks at .*test_bad_inputs"):
        efx.compile(around)(torch.randn(2, 4, requires_grad=True))

    @efx.region
    def inside(x):
        return checkpoint(_checkpointed.__wrapped__, x, use_reentrant=False)

    check_against_eager(lambda x: inside(x).sum(), torch.randn(2, 4, requires_grad=True))


def test_reentrant_checkpoint_under_autograd_is_refused() -> None:
    from torch.utils.checkpoint import checkpoint

    def f(x):
        return checkpoint(lambda t: torch.tanh(_CKPT_LIN(t)), x, use_reentrant=True).sum()

    with pytest.raises(efx.UnsupportedOperatorError, match=r"use_reentrant=True .*test_bad_inputs\.py"):
        efx.compile(f)(torch.randn(2, 4, requires_grad=True))


def test_a_tensor_a_region_keeps_in_python_state_is_written_at_each_call() -> None:
    """Was refused ("kept in Python state"): each call site now makes the body's write with its own result
    (Note [Python state]), so the caller reads it and the list holds each call's tensor, as in eager."""
    kept: list[torch.Tensor] = []

    @efx.region
    def keeps(x):
        y = x * 2
        kept.append(y)
        return y + 1

    def f(x):
        kept.clear()
        out = keeps(x)
        return out, kept[0]

    compiled = efx.compile(f)
    for _ in range(3):
        x = torch.randn(2)
        want = f(x)
        got = compiled(x)
        assert len(kept) == 1 and type(kept[0]) is torch.Tensor
        assert all(torch.equal(a, b) for a, b in zip(want, got)) and torch.equal(kept[0], want[1])


def test_a_saved_tensor_updated_in_place_is_refused_before_any_effect() -> None:
    """Eager's forward runs and only its backward fails; effectfx derives the backward at capture, so it
    refuses there -- with its own error naming the line, before any effect ran -- not torch's raw one."""
    w = torch.randn(4, 4, requires_grad=True)

    def f(x):
        torch.ops.efxtest.record_memory("f")
        h = x @ w  # saves x for w's gradient
        x.mul_(2)
        return h + x

    with recording() as log, pytest.raises(efx.CaptureError, match=r"autograd failed.*test_bad_inputs.*"
                                                                    r"modified by an inplace operation"):
        efx.compile(f)(torch.randn(2, 4, requires_grad=True) * 1.0)
    assert log == []


def test_an_input_that_needs_a_gradient_the_program_was_not_captured_for_is_refused() -> None:
    """A Program captured for an input without grad has no backward for it: run on one that requires grad
    it would hand back no gradient, silently.  (Without grad mode nothing is differentiated: it runs.)"""
    w = torch.randn(3, requires_grad=True)
    prog = efx.capture(lambda x: (x * w).sum(), torch.randn(3))
    x = torch.randn(3, requires_grad=True)
    with recording() as log, pytest.raises(efx.SignatureMismatchError, match=r"captured as float32\[3\]"):
        prog(x)
    assert log == []
    with torch.no_grad():
        assert torch.allclose(prog(x), (x * w).sum())
