"""``common.paired`` (the per-round step ratios of every benchmark, with their interval) and
``benchmarks/inductor_report.py``: the twins' noise floor that qualifies issue 26's step verdicts, and the
report over the committed full run's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if not (ROOT / "benchmarks" / "inductor_report.py").is_file():  # pragma: no cover - installed without sources
    pytest.skip("benchmarks/ not in this checkout", allow_module_level=True)

pytest.importorskip("numpy")


@pytest.fixture(scope="module")
def report():  # type: ignore[no-untyped-def]
    from effectfx.cli.bench import _benchmarks_package

    _benchmarks_package()
    from benchmarks import inductor_report

    return inductor_report


@pytest.fixture(scope="module")
def common(report):  # type: ignore[no-untyped-def]
    from benchmarks import common

    return common  # common.paired: the paired ratios of every benchmark's report


def test_paired_ratio_is_round_by_round(common) -> None:  # type: ignore[no-untyped-def]
    # b drifts upward, a stays 1.1x b in every round: the ratio of medians would see the drift, pairs do not
    b = [10.0 + k for k in range(40)]
    a = [1.1 * x for x in b]
    p = common.paired(a, b)
    assert p["median"] == pytest.approx(1.1)
    assert p["low"] == pytest.approx(1.1) and p["high"] == pytest.approx(1.1)
    assert p["q1"] == pytest.approx(1.1) and p["q3"] == pytest.approx(1.1)
    assert common.paired(a, b[:-1]) is None  # not from the same rounds
    assert common.paired(a, None) is None


def test_interval_widens_with_scatter(common) -> None:  # type: ignore[no-untyped-def]
    b = [10.0] * 60
    a = [10.0 * (0.9 if k % 2 else 1.12) for k in range(60)]
    p = common.paired(a, b)
    assert p["low"] < 1.0 < p["high"]


def test_verdict_is_unresolved_within_the_noise(report) -> None:  # type: ignore[no-untyped-def]
    tight = {"median": 1.03, "low": 1.02, "high": 1.04}
    clear = report._target("t", 1.03, 1.03, 1.0, tight, {"median": 1.005, "low": 1.0, "high": 1.01})
    assert clear["met"] is False and clear["resolved"] is True
    assert report._verdict(clear).startswith(
        "NOT met (paired per round 1.030x, 95% 1.020-1.040; twins 1.005x")
    # twins differ by more than the ratio's distance from the limit: the run cannot tell
    noisy_twins = report._target("t", 1.03, 1.03, 1.0, tight, {"median": 0.95, "low": 0.94, "high": 0.96})
    assert noisy_twins["resolved"] is False
    assert report._verdict(noisy_twins).startswith("NOT met, within this run's noise")
    straddles = report._target("t", 0.99, 0.99, 1.0, {"median": 0.99, "low": 0.97, "high": 1.01}, None)
    assert straddles["met"] is True and straddles["resolved"] is False
    assert "paired" not in report._target("first call", 0.5, 0.6, 0.8)  # first calls: one sample per process


def test_the_committed_run_reports_every_target(report) -> None:  # type: ignore[no-untyped-def]
    data = json.loads((ROOT / "benchmarks" / "results" / "inductor.json").read_text())
    summary = report.summarize(data)
    steps = [t for t in summary["targets"] if t["target"].startswith("(b)")]
    assert len(steps) == 12  # 3 models x training/inference x torch.compile/eager
    assert all("paired" in t and t["paired"]["low"] <= t["paired"]["median"] <= t["paired"]["high"]
               for t in steps)
    text = report.targets_text(summary)
    assert text.count("paired per round") == 12
    assert "(c) gpt2/12 efx effects exact" in text
