"""Errors are eager's (Note [Errors are eager's], effectfx.drivers.eager_errors).

An error the user's code makes, found while capturing (an op's shape check, Python's own index check, the
user's ``raise``), is raised as eager raises it: an instance of eager's class with eager's message, and,
for one found by an op, also a ``CaptureError`` naming the op and the user's line.  The effects eager runs
before it run, once; no others.  An error effectfx raises on purpose (a limitation) runs nothing.
"""

from __future__ import annotations

import inspect
import pickle
import warnings

import pytest
import torch

import effectfx as efx
from effectfx.errors import (
    CaptureError,
    DataDependentControlFlowError,
    EagerFallbackWarning,
    OpError,
    op_error,
)
from effectfx.testing.effect_ops import LOG

R = torch.ops.efxtest


def outcome(fn, *args):
    """(the exception fn raised, the effect log up to it)."""
    LOG.clear()
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value, list(LOG)


def loss_of_sliced_targets(logits, targets):
    # nanoGPT's loss with targets sliced from a batch: .view(-1) of a tensor that is not contiguous
    R.record_memory("forward")
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), targets[:, 1:].view(-1))
    R.record_memory("loss")
    return loss


def test_view_of_non_contiguous_is_eager_runtime_error_after_eager_effects():
    logits, targets = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 4))
    eager, eager_log = outcome(loss_of_sliced_targets, logits, targets)
    assert type(eager) is RuntimeError
    got, log = outcome(efx.compile(loss_of_sliced_targets), logits, targets)
    assert isinstance(got, RuntimeError) and isinstance(got, CaptureError) and isinstance(got, OpError)
    assert log == eager_log == [("record_memory", "forward")]
    line = inspect.getsourcelines(loss_of_sliced_targets)[1] + 3
    assert str(got) == (f"{eager}\n(effectfx: aten.view.default raised this in the captured function at "
                        f"{__file__}:{line} (in loss_of_sliced_targets): loss = "
                        "torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), "
                        "targets[:, 1:].view(-1)), as it does in eager PyTorch)")
    with pytest.raises(RuntimeError, match="view size is not compatible"):  # the user's except catches it
        efx.compile(loss_of_sliced_targets)(logits, targets)


def test_capture_raises_eager_class_and_message_running_nothing():
    def mm(x, y):
        R.record_memory("before")
        return x @ y

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    eager, _ = outcome(mm, x, y)
    got, log = outcome(lambda: efx.capture(mm, x, y))
    assert type(got).__name__ == "CaptureRuntimeError" and isinstance(got, RuntimeError)
    # eager's message (mm's fake kernel says "a and b must have same reduction dim")
    assert str(got).splitlines()[0] == str(eager) == "mat1 and mat2 shapes cannot be multiplied (3x4 and 3x4)"
    assert log == []  # a capture runs nothing


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_error_in_a_region_body(backend):
    @efx.region
    def flatten(x):
        R.record_memory("region")
        return x[:, 1:].view(-1)

    def fn(x):
        R.record_memory("root")
        return flatten(x.sin()) + flatten(x)

    x = torch.randn(3, 4)
    eager, eager_log = outcome(fn, x)
    got, log = outcome(efx.compile(fn, backend=backend), x)
    assert isinstance(got, RuntimeError) and isinstance(got, CaptureError)
    assert str(got).splitlines()[0] == str(eager)
    assert log == eager_log == [("record_memory", "root"), ("record_memory", "region")]


def test_python_errors_of_user_code_are_eager_own_after_eager_effects():
    def index(x):
        R.record_memory("before")
        return x[5]

    def raising(x):
        R.record_memory("before")
        if x.shape[0] == 3:
            raise ValueError("three rows")
        return x

    def sizes(x):
        R.record_memory("before")
        return torch.nn.functional.cross_entropy(x, torch.tensor([1, 2]))

    x = torch.randn(3, 4)
    for fn, cls in ((index, IndexError), (raising, ValueError), (sizes, ValueError)):
        eager, eager_log = outcome(fn, x)
        got, log = outcome(efx.compile(fn), x)
        assert type(got) is type(eager) is cls and str(got) == str(eager), fn
        assert log == eager_log == [("record_memory", "before")], fn


def test_error_at_run_time_runs_the_effects_before_it():
    def fn(x, y):
        R.record_memory("before")
        z = torch.mm(x, y.double().t())  # the fake kernel does not check dtypes: the program's kernel does
        R.record_memory("after")
        return z

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    eager, eager_log = outcome(fn, x, y)
    got, log = outcome(efx.compile(fn), x, y)
    assert type(got) is type(eager) is RuntimeError and str(got) == str(eager)
    assert log == eager_log == [("record_memory", "before")]


def test_limitation_stays_effectfx_error_and_runs_nothing():
    @torch.library.custom_op("efxtest_errors::fake_fails", mutates_args=())
    def fake_fails(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @fake_fails.register_fake
    def _(x):
        raise ValueError("this fake kernel is wrong")

    def fn(x):
        R.record_memory("before")
        return fake_fails(x)

    got, log = outcome(efx.compile(fn), torch.randn(3))
    assert type(got) is CaptureError and "ValueError: this fake kernel is wrong" in str(got)
    assert log == []

    def data_dependent(x):
        R.record_memory("before")
        return x * 2 if x.sum() > 0 else x

    got, log = outcome(efx.compile(data_dependent), torch.randn(3))
    assert type(got) is DataDependentControlFlowError and log == []


def test_capture_failing_where_eager_does_not_returns_eager_result_with_warning():
    def fn(x):
        R.record_memory("before")
        if isinstance(x, torch._subclasses.FakeTensor):  # (effectfx's limitation, made up)
            raise ValueError("fakes only")
        return x + 1

    x = torch.randn(3)
    LOG.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = efx.compile(fn)(x)
    assert torch.equal(out, x + 1) and LOG == [("record_memory", "before")]
    assert [type(w.message) for w in caught] == [EagerFallbackWarning]
    assert "(ValueError: fakes only)" in str(caught[0].message)


def test_op_error_classes():
    for eager in (RuntimeError, IndexError, ValueError, TypeError, NotImplementedError, KeyError, OSError,
                  torch.OutOfMemoryError, torch._C._LinAlgError):
        error = op_error(eager, "the message", "somewhere")
        assert isinstance(error, eager) and isinstance(error, OpError), eager
        assert type(error) is type(op_error(eager, "another", "elsewhere"))  # one class per eager class
        assert str(error) == "the message\n(effectfx: somewhere)"  # (KeyError's would be quoted)
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error) and str(again) == str(error)
    # UnicodeDecodeError cannot be made from a message: its nearest base that can
    error = op_error(UnicodeDecodeError, "bad byte", "here")
    assert isinstance(error, UnicodeError) and isinstance(error, ValueError) and isinstance(error, OpError)
