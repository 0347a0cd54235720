"""The one interposer mechanism (``effectfx.interposers.interpose``): a replacement is in place only while a
capture runs, acts only on the capturing thread, and the original comes back after -- unless someone
replaced the attribute meanwhile, whose replacement stays."""

from __future__ import annotations

import threading
import types

import torch

import effectfx as efx
from effectfx.interposers.interpose import interpose


def _owner() -> types.SimpleNamespace:
    calls: list[str] = []
    owner = types.SimpleNamespace(calls=calls)
    owner.f = lambda: calls.append("original")
    return owner


def test_the_replacement_acts_on_the_capturing_thread_only_and_only_during_a_capture() -> None:
    owner = _owner()
    original = owner.f
    interposer = interpose(owner, "f", lambda: owner.calls.append("replacement"))
    assert interposer.original is original and owner.f is original  # nothing patched outside captures

    def fn(x: torch.Tensor) -> torch.Tensor:
        owner.f()
        other = threading.Thread(target=owner.f)
        other.start()
        other.join()
        return x + 1

    efx.capture(fn, torch.randn(2))
    assert owner.calls == ["replacement", "original"]
    assert owner.f is original  # put back
    owner.f()
    assert owner.calls[-1] == "original"


def test_an_attribute_replaced_during_a_capture_is_left_as_the_replacer_set_it() -> None:
    owner = _owner()
    theirs = lambda: owner.calls.append("theirs")  # noqa: E731
    interpose(owner, "f", lambda: owner.calls.append("replacement"))

    def fn(x: torch.Tensor) -> torch.Tensor:
        owner.f = theirs
        return x * 2

    efx.capture(fn, torch.randn(2))
    assert owner.f is theirs


def test_an_inherited_method_is_deleted_again_not_set() -> None:
    class Base:
        def g(self) -> str:
            return "base"

    class Child(Base):
        pass

    interpose(Child, "g", lambda self: "interposed")

    def fn(x: torch.Tensor) -> torch.Tensor:
        assert Child().g() == "interposed" and Base().g() == "base"
        return x - 1

    efx.capture(fn, torch.randn(2))
    assert "g" not in vars(Child) and Child().g() == "base"
