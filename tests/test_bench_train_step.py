"""Smoke test of ``benchmarks/train_step.py --quick``: it runs into a temporary folder (never over the
committed figures), writes its JSON and PNG, and ``efx.compile(step)`` of a whole GPT-2 AdamW training step
captures twice (the first step, then one program for the later ones) and performs eager's effects in eager's
order, with parameters and optimizer state close to eager's.  Inductor and torch.compile are left out to
keep this fast (their first calls take a minute or more each); the full benchmark has them."""

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
if not (ROOT / "benchmarks" / "train_step.py").is_file():  # pragma: no cover - installed without sources
    pytest.skip("benchmarks/ not in this checkout", allow_module_level=True)

SYSTEMS = ["eager", "efx_step", "efx_model", "eager_cosine", "efx_step_cosine"]
EFFECTS_PER_STEP = 4 + 2  # one per layer, "after backward", the loss's log_tensor


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_train_step_quick(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/train_step.py", "--quick", "--no-progress",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "step ms" in proc.stdout and "targets:" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train_step.json", "train_step.png"]
    png = (tmp_path / "train_step.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    data = json.loads((tmp_path / "train_step.json").read_text())
    assert data["benchmark"] == "train_step"
    machine = data["machine"]
    assert machine["torch"].startswith("2.") and machine["timestamp"] and len(machine["load_average"]) == 3
    cfg = data["config"]
    assert cfg["quick"] is True and cfg["reps"] == 1 and cfg["model"]["layers"] == 4
    assert cfg["systems_run"] == SYSTEMS  # no Inductor, no torch.compile in a quick run
    steps = cfg["calls"]

    # the first calls, each system in a fresh process, checked there against eager's same steps
    for system in SYSTEMS:
        (run,) = data["first_call"][system]
        assert run["status"] == "ok", run
        assert _finite_positive(run["warmup_s"])
        assert len(run["calls"]) == steps
        for call in run["calls"]:
            assert _finite_positive(call["wall_s"]) and call["wall_s"] < 120
            assert _finite_positive(call["cpu_s"])
            assert call["effects"] == EFFECTS_PER_STEP
        check = run["check"]
        assert check["effects_equal_eager"] and check["effects_per_step"] == [EFFECTS_PER_STEP], check
        assert check["state_keys_equal"] and check["grads_none"] and check["eager_grads_none"]
        assert check["max_param_diff"] < 1e-4 and check["max_loss_diff"] < 1e-4, check
    # the first step and the later ones are two programs; nothing is captured after the second step
    assert [c["captures"] for c in data["first_call"]["efx_step"][0]["calls"]] == [1, 2, 2]
    assert [c["captures"] for c in data["first_call"]["efx_model"][0]["calls"]] == [1] * steps
    assert [c["captures"] for c in data["first_call"]["eager"][0]["calls"]] == [0] * steps

    # the steady state: every system right after its check steps, nothing captured while timed
    steady = data["steady_state"]
    assert steady["status"] == dict.fromkeys(SYSTEMS, "ok") and steady["rounds"] >= 3
    for system in SYSTEMS:
        check = steady["checks"][system]
        assert check["steps"] == cfg["check_steps"]
        assert check["effects_equal_eager"] and check["effects_per_step_timed"] == [EFFECTS_PER_STEP], check
        assert check["max_param_diff"] < 1e-4 and check["state_keys_equal"], check
        assert all(v is not None and v < 1e-4 for v in check["max_state_diff"].values()), check
        assert check["captures_while_timing"] == 0, check
        assert _finite_positive(steady["step_ms"][system]) and steady["step_ms"][system] < 1000
        assert _finite_positive(steady["step_cpu_ms"][system])
        assert len(steady["samples_ms"][system]) == steady["rounds"]
    assert steady["checks"]["efx_step"]["captures_in_checks"] == 2
    # a new float lr before every step: an input from its first change, still two captures in all
    assert steady["checks"]["efx_step_cosine"]["captures_in_checks"] == 2
    assert [c["captures"] for c in data["first_call"]["efx_step_cosine"][0]["calls"]] == [1, 2, 2]
    assert steady["checks"]["eager_cosine"]["losses"] != steady["checks"]["eager"]["losses"]  # it schedules
    assert steady["checks"]["eager"]["max_param_diff"] == 0.0  # the reference against itself

    summary = data["summary"]
    for system in SYSTEMS:
        s = summary["systems"][system]
        assert s["effects_equal_eager"] and s["grads_none"], (system, s)
        assert _finite_positive(s["first_s"]) and _finite_positive(s["step_ms"])
    for system in ("efx_step", "efx_model"):
        assert _finite_positive(summary["systems"][system]["over_eager"])
    assert summary["systems"]["efx_step"]["captures"] == [2]
    assert summary["targets"]["step_captures"]["met"]
    assert summary["targets"]["cosine_captures"]["met"]
    assert _finite_positive(summary["targets"]["cosine_over_step"]["value"])  # measured, not required
    assert _finite_positive(summary["targets"]["step_over_efx_model"]["value"])  # measured, not required
