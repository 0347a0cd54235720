"""Smoke test of ``benchmarks/resnet.py --quick``: it runs into a temporary folder (never over the
committed figures), writes its JSON and PNG, and effectfx trains the ResNet like eager (loss, gradients,
BatchNorm buffers, one effect per block).  torch.compile is left out to keep this fast (its first calls
take tens of seconds); the full benchmark measures it."""

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
if not (ROOT / "benchmarks" / "resnet.py").is_file():  # pragma: no cover - installed without sources
    pytest.skip("benchmarks/ not in this checkout", allow_module_level=True)


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_resnet_quick(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/resnet.py", "--quick", "--systems", "eager,efx",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step/eager" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resnet.json", "resnet.png"]
    assert (tmp_path / "resnet.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    data = json.loads((tmp_path / "resnet.json").read_text())
    assert data["benchmark"] == "resnet"
    assert data["machine"]["torch"].startswith("2.") and data["machine"]["timestamp"]
    cfg = data["config"]
    assert cfg["quick"] is True and cfg["blocks"] == 8 and cfg["reps"] == 1 and cfg["rounds"] >= 3
    assert set(cfg["systems"]) == {"eager", "efx"}

    results = {r["system"]: r for r in data["results"]}
    assert set(results) == {"eager", "efx"}
    for r in results.values():
        fc, step = r["first_call"], r["step"]
        assert _finite_positive(fc["median_s"]) and fc["median_s"] < 120, r["system"]
        assert _finite_positive(fc["cpu_median_s"]) and _finite_positive(fc["second_call_median_s"])
        assert _finite_positive(step["median_s"]) and _finite_positive(step["cpu_median_s"])
        assert len(step["runs_s"]) == cfg["rounds"]
        # effectfx (and eager, the reference) must be right: loss, every gradient, every BatchNorm buffer
        assert fc["ok"] and step["status"] == "ok", r["system"]
        assert r["matches_eager"] is True and r["effects_correct"] is True, r["system"]
        run = fc["runs"][0]
        assert run["loss_matches"] and run["grads_matches"] and run["buffers_matches"], run
        assert run["buffers_compared"] > 0 and run["grads_compared"] > 0
        assert fc["effects_per_call"] == [8] and step["effects_per_step"] == [8]
        assert step["state_after_warmup"]["matches_eager"] is True
    # transformers sets config.problem_type during the first call: effectfx captures again, once
    assert results["efx"]["first_call"]["runs"][0]["efx_compiles"] == 2
    assert results["efx"]["step"]["efx_region_bodies"] >= 1

    summary = data["summary"]
    assert summary["efx_correct"] is True
    assert _finite_positive(summary["efx_over_eager_step"])
    assert _finite_positive(summary["by_system"]["efx"]["first_call_ms"])
