"""``common.paired`` (the per-round step ratios of every benchmark, with their interval) and
``benchmarks/inductor_report.py``: the twins' noise floor that qualifies the verdicts of the Inductor step
targets (benchmarks/README.md, "Inductor backend"), and the report over the committed full run's JSON."""

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
    tier2 = [t for t in summary["targets"] if t["target"].startswith("(d)")]
    assert len(tier2) == 6  # tier 2: 3 models x training/inference, against torch.compile
    assert all("efx tier 2 / tc" in t["target"] and "paired" in t for t in tier2)
    text = report.targets_text(summary)
    assert text.count("paired per round") == 12 + 6
    assert "(c) gpt2/12 efx effects exact" in text


def _process(ratio: float, status: str = "ok", rounds: int = 5) -> dict:
    """One steady-state process in which effectfx takes ``ratio`` times torch.compile's 10 ms."""
    times = {"eager": 20.0, "efx": 10.0 * ratio, "efx_twin": 10.0 * ratio, "tc_pure": 10.0}
    per_mode = {mode: dict(times) for mode in ("training", "inference")}
    return {"status": {mode: {k: status if k == "tc_pure" else "ok" for k in times} for mode in per_mode},
            "checks": {mode: {"efx": {"ok": True, "max_rel_diff": 0.0, "effects": 16,
                                      "effects_expected": 16}} for mode in per_mode},
            "step_ms": per_mode, "step_cpu_ms": per_mode,
            "samples_ms": {mode: {k: [v] * rounds for k, v in times.items()} for mode in per_mode}}


def test_steady_processes_each_give_a_ratio_and_must_agree(report) -> None:  # type: ignore[no-untyped-def]
    # three processes, each building every system anew: their ratios straddle the limit, so the median
    # (1.01x) is not met and the run cannot tell; a failed process is reported, not averaged in
    st = {"processes": [_process(0.98), _process(1.03), _process(1.01), {"status": "child failed (exit 1)"}]}
    data = {"first_call": {}, "steady_state": {"stack/16": st}}
    m = report.merged(st)
    assert m["step_ms"]["training"]["efx"] == pytest.approx(10.1)  # median of the processes' medians
    assert m["failed"] == ["child failed (exit 1)"]
    summary = report.summarize(data)
    assert summary["stack/16"]["training_efx_over_tc"] == pytest.approx(1.01)
    assert summary["stack/16"]["training_efx_over_tc_processes"] == pytest.approx([0.98, 1.03, 1.01])
    (t,) = [t for t in summary["targets"] if t["target"] == "(b) stack/16 training step efx / tc_pure"]
    assert t["met"] is False and t["resolved"] is False
    assert "processes 0.980 / 1.030 / 1.010x" in report._verdict(t)
    # the same ratios all above the limit: resolved
    st_clear = {"processes": [_process(1.04), _process(1.05), _process(1.06)]}
    summary = report.summarize({"first_call": {}, "steady_state": {"stack/16": st_clear}})
    (t,) = [t for t in summary["targets"] if t["target"] == "(b) stack/16 training step efx / tc_pure"]
    assert t["met"] is False and t["resolved"] is True
    # the rounds alone are clear of the limit (one short process below it): the processes still disagree
    st_split = {"processes": [_process(0.99, rounds=2), _process(1.04, rounds=10), _process(1.04, rounds=10)]}
    summary = report.summarize({"first_call": {}, "steady_state": {"stack/16": st_split}})
    (t,) = [t for t in summary["targets"] if t["target"] == "(b) stack/16 training step efx / tc_pure"]
    assert t["paired"]["low"] > 1.0 and t["met"] is False and t["resolved"] is False
    assert "a process failed: child failed" in report.table(
        {"first_call": {}, "steady_state": {"stack/16": st}, "summary": report.summarize(data)})


def test_a_failing_system_in_one_process_shows(report) -> None:  # type: ignore[no-untyped-def]
    st = {"processes": [_process(1.0), _process(1.0, status="wrong results: max rel. difference 0.5")]}
    assert report.merged(st)["status"]["training"]["tc_pure"].startswith("wrong results")
