"""What a long first call with backend="inductor" is doing: one INFO record per segment on the logger
``effectfx.inductor`` (quiet unless configured; ``log_compiles`` prints them, a bar on a terminal), and
``efx.explain``'s compile time per graph and segment.

The model is tiny (two blocks sharing one body, and a pure step before and after them: three segments),
compiled in a fresh Inductor cache directory so the segments really compile.  The root's two segments
compile on their second run (deferred, ``effectfx.backends.inductor_segments``), the body's on its first."""

from __future__ import annotations

import gc
import io
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import effectfx as efx
import effectfx.testing  # noqa: F401 -- registers the efxtest:: ops
from effectfx.backends import inductor_cache as cache
from effectfx.backends import inductor_segments as segs
from effectfx.backends import progress


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.record_memory("x")
        return nn.functional.gelu(self.lin(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x * 2 + 1).tanh().sin() * 3  # a root segment before the region calls ...
        for block in self.blocks:
            x = block(x)
        return x.relu().cos().exp().neg().abs()  # ... and one after them (each more than a tiny one)


def model() -> nn.Module:
    torch.manual_seed(0)
    return Model().requires_grad_(False)  # inference: forward segments only, fewer compiles


X = torch.randn(2, 4)


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """An empty Inductor cache directory and process cache: every segment is compiled."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    cache.clear_cache()
    yield
    cache.clear_cache()  # what this test compiled lives in tmp_path only


def new_count() -> None:
    """The counts below start at 1 only when no segment lowered earlier is still waiting for its run."""
    gc.collect()
    assert not progress._PENDING, f"unrun segments of earlier tests alive: {list(progress._PENDING)}"


def records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    found = [r for r in caplog.records if r.name == "effectfx.inductor"]
    caplog.clear()
    return found


def test_each_segment_is_logged_with_its_count_where_and_outcome(
        fresh_cache: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="effectfx.inductor")
    new_count()
    compiled = efx.compile(model(), backend="inductor", tiers="tier1")
    compiled(X)
    first = records(caplog)
    assert len(first) == 3
    # all three were lowered before the first ran: m is known from the first record on
    assert [r.efx_n for r in first] == [1, 2, 3] and [r.efx_m for r in first] == [3, 3, 3]
    # the root's segments run un-compiled on the first call (deferred), the body's compile
    assert [r.efx_outcome for r in first] == ["deferred", "compiled", "deferred"]
    assert first[1].efx_seconds > 0 and first[0].efx_seconds == first[2].efx_seconds == 0
    assert all(r.efx_nodes > 0 for r in first)
    assert [r.getMessage().split(" of ")[0] for r in first] == [f"segment {n}/3" for n in (1, 2, 3)]
    wheres = [r.efx_where for r in first]
    assert wheres[1].startswith("region 'Block.forward' (subgraph_") and "'forward'" in wheres[1]
    assert wheres[0] == wheres[2] == "'forward'"  # the root's segments
    assert "compiled in" in first[1].getMessage() and "(7 nodes)" in first[0].getMessage()

    compiled(X)  # the root's segments compile on their second run: a count of their own
    second = records(caplog)
    assert [(r.efx_n, r.efx_m, r.efx_outcome, r.efx_where) for r in second] == [
        (1, 2, "compiled", "'forward'"), (2, 2, "compiled", "'forward'")]
    assert all(r.efx_seconds > 0 for r in second)

    compiled(X)  # runs what is compiled: nothing to say
    assert records(caplog) == []

    # an equal model: the same segments, a new count
    again = efx.compile(model(), backend="inductor", tiers="tier1")
    again(X)  # every segment at hand, the root's too: none deferred
    hits = records(caplog)
    assert [(r.efx_n, r.efx_m, r.efx_outcome) for r in hits] == [(n, 3, "cache hit") for n in (1, 2, 3)]
    assert [r.efx_where for r in hits] == wheres


def test_quiet_by_default_and_log_compiles_prints(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    new_count()
    efx.compile(model(), backend="inductor", tiers="tier1")(X)
    assert "effectfx inductor" not in capsys.readouterr().err

    progress.log_compiles(True)
    try:
        # cache hits: fast, and logged all the same
        efx.compile(model(), backend="inductor", tiers="tier1")(X)
        lines = [line for line in capsys.readouterr().err.splitlines() if "effectfx inductor" in line]
        assert [line.split(" of ")[0] for line in lines] == [
            f"effectfx inductor: segment {n}/3" for n in (1, 2, 3)]  # not a terminal: plain lines

        class Terminal(io.StringIO):
            def isatty(self) -> bool:
                return True

        terminal = Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        efx.compile(model(), backend="inductor", tiers="tier1")(X)
        text = terminal.getvalue()
        assert "\r" in text and text.endswith("\n") and text.count("\n") == 1  # one line, in place
        assert "effectfx inductor [" in text and "3/3 segments" in text and "region 'Block.forward'" in text
    finally:
        progress.log_compiles(False)
    monkeypatch.undo()
    efx.compile(model(), backend="inductor", tiers="tier1")(X)
    assert "effectfx inductor" not in capsys.readouterr().err  # switched off again


def test_the_environment_switch() -> None:
    code = ("import logging; from effectfx.backends import progress; "
            "print(any(isinstance(h, progress.ProgressHandler) for h in progress.LOGGER.handlers), "
            "progress.LOGGER.isEnabledFor(logging.INFO))")
    for value, want in (("1", "True True"), ("0", "False False")):
        env = {**os.environ, "EFFECTFX_LOG_COMPILES": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout
        assert out.split() == want.split()


def test_explain_shows_compile_time_per_segment(fresh_cache: None) -> None:
    compiled = efx.compile(model(), backend="inductor", tiers="tier1")
    before = str(efx.explain(compiled, X))  # lowered, not run: nothing compiled yet
    assert "Inductor compile time per segment: 3 segments, 0 run, 0.00 s" in before
    assert before.count("not run yet") == 3

    compiled(X)
    once = efx.explain(compiled).programs[0].segments
    assert [s.outcome for s in once[0].segments] == ["deferred"] * 2  # the root's: compiled on their 2nd run
    assert "deferred" in str(efx.explain(compiled))
    compiled(X)
    e = efx.explain(compiled)
    (program,) = e.programs
    root, body = program.segments
    assert (root.graph, root.region, body.region) == ("root", None, "Block.forward")
    assert [s.name for s in root.segments] == ["segment_0", "segment_1"]
    every = [*root.segments, *body.segments]
    assert all(s.outcome == "compiled" and s.seconds > 0 and s.nodes > 0 for s in every)
    text = str(e)
    section = text[text.index("Inductor compile time per segment"):].splitlines()
    total = sum(s.seconds for s in every)
    assert section[0] == f"Inductor compile time per segment: 3 segments, 3 run, {total:.2f} s"
    assert any(line.strip().startswith("Block_forward_subgraph") for line in section)
    rows = [line.split() for line in section if line.strip().startswith("segment_")]
    assert len(rows) == 3 and all(r[2] == "compiled" and float(r[3]) > 0 and r[4] == "s" for r in rows)


def test_a_fallback_is_logged_and_explained(fresh_cache: None, caplog: pytest.LogCaptureFixture,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(torch._inductor, "standalone_compile", refuse)
    caplog.set_level(logging.INFO, logger="effectfx.inductor")
    compiled = efx.compile(model(), backend="inductor", tiers="tier1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", segs.InductorFallbackWarning)
        torch.testing.assert_close(compiled(X), model()(X))
        torch.testing.assert_close(compiled(X), model()(X))  # the root's segments try on their second run
    logged = records(caplog)
    assert [r.efx_outcome for r in logged] == ["deferred", "fell back", "deferred", "fell back", "fell back"]
    assert all("fell back (RuntimeError: no kernel for you)" in r.getMessage() for r in logged
               if r.efx_outcome == "fell back")
    text = str(efx.explain(compiled))
    assert text.count("fell back") == 3 and "RuntimeError: no kernel for you" in text
