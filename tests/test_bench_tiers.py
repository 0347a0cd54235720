"""Smoke test of ``benchmarks/tiers.py --quick``: it runs into a temporary folder (never over the committed
figures), writes its JSON and PNG; eager, effectfx tier 1 and tier 2 at once each train GPT-2 (2 layers) for
30 steps in a fresh process with a fresh Inductor cache; at once runs tier 2 from each program's first call;
every step's effect log and loss agree with eager's.  Slow: it compiles with Inductor (about 3 minutes)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("matplotlib")
pytest.importorskip("transformers")
if not (ROOT / "benchmarks" / "tiers.py").is_file():  # pragma: no cover - installed without sources
    pytest.skip("benchmarks/ not in this checkout", allow_module_level=True)

SYSTEMS = ["eager", "efx_tier1", "efx_at_once"]
STEPS, STEADY = 30, 10
EFFECTS_PER_STEP = [["record_memory", "layer0"], ["record_memory", "layer1"],
                    ["record_memory", "after backward"]]  # then the loss's log_tensor


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_tiers_quick(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/tiers.py", "--quick", "--no-progress",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "to train" in proc.stdout and "effect log = eager's at steps around the switch" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiers.json", "tiers.png"]
    png = (tmp_path / "tiers.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    data = json.loads((tmp_path / "tiers.json").read_text())
    assert data["benchmark"] == "tiers" and data["machine"]["torch"].startswith("2.")
    cfg = data["config"]
    assert cfg["quick"] is True and cfg["layers"] == 2 and cfg["steps"] == STEPS
    assert cfg["systems_run"] == SYSTEMS  # no tiered, no torch.compile in a quick run
    for system in SYSTEMS:
        run = data["runs"][system]
        assert run["status"] == "ok", run
        cumulative = run["cumulative_s"]
        assert len(cumulative) == STEPS and all(b > a for a, b in zip(cumulative, cumulative[1:]))
        assert len(run["steady_s"]) == STEADY and all(map(_positive, run["steady_s"]))
        assert len(run["logs"]) == len(run["losses"]) == len(run["tiers"]) == STEPS + STEADY
        for log in run["logs"]:
            assert log[:-1] == EFFECTS_PER_STEP and log[-1][:2] == ["log_tensor", "loss"]
        assert _positive(run["peak_rss_mb"]) and len(run["rss_mb"]) == STEPS
    assert data["runs"]["eager"]["tier_states"] == data["runs"]["efx_tier1"]["tier_states"] == []

    at_once = data["runs"]["efx_at_once"]
    assert [s["tier"] for s in at_once["tier_states"]] == [2, 2]  # the first step's program, the steady one
    assert [s["switched_call"] for s in at_once["tier_states"]] == [1, 1]
    assert all(s["error"] is None and _positive(s["compile_wall_s"]) for s in at_once["tier_states"])

    per = data["summary"]["systems"]
    for system in SYSTEMS:
        s = per[system]
        assert s["failure"] is None
        assert s["effects"]["all_equal"] and s["effects"]["steps_equal"] == STEPS + STEADY
        assert s["max_loss_rel_diff"] < 1e-3
        assert _positive(s["time_to_train_s"]) and _positive(s["steady_ms"])
    assert per["efx_at_once"]["switch_steps"] == [1, 2] and per["efx_at_once"]["switch_step"] == 2
    assert per["efx_at_once"]["effects_around_switch"] == {"1": True, "2": True, "3": True}
    assert _positive(per["efx_at_once"]["tier2_compile_s"])
    assert per["efx_at_once"]["peak_rss_over_tier1_mb"] is not None
    assert per["efx_tier1"]["switch_steps"] == [] and per["efx_tier1"]["tier2_compile_s"] is None
    assert data["summary"]["tc"] is None and data["summary"]["targets"] == {}  # no torch.compile run
