"""Smoke test of ``benchmarks/dynamo_backend.py --quick``: it runs into a temporary folder (never over the
committed figures), writes its JSON and PNG, and ``torch.compile(model, backend="effectfx")`` of a GPT-2 keeps
every effect of its training steps (one effectfx capture of one Dynamo graph), as ``efx.compile(model)`` does,
where ``backend="aot_eager"`` keeps none.  The Inductor systems are left out to keep this fast (their first
calls take a minute or more each); the full benchmark has them."""

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
if not (ROOT / "benchmarks" / "dynamo_backend.py").is_file():  # pragma: no cover - installed without sources
    pytest.skip("benchmarks/ not in this checkout", allow_module_level=True)

SYSTEMS = ["eager", "efx_backend", "tc_aot_eager", "efx_compile"]
LAYERS = 4  # each records its name: the effects of one step


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_dynamo_backend_quick(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/dynamo_backend.py", "--quick", "--no-progress",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "first call wall / CPU" in proc.stdout and "targets:" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dynamo_backend.json", "dynamo_backend.png"]
    png = (tmp_path / "dynamo_backend.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    data = json.loads((tmp_path / "dynamo_backend.json").read_text())
    assert data["benchmark"] == "dynamo_backend"
    cfg = data["config"]
    assert cfg["quick"] is True and cfg["model"]["layers"] == LAYERS
    assert cfg["systems_run"] == SYSTEMS  # no Inductor in a quick run
    for system in SYSTEMS:
        (run,) = data["first_call"][system]
        assert run["status"] == "ok", run
        assert len(run["calls"]) == cfg["calls"]
        for call in run["calls"]:
            assert _finite_positive(call["wall_s"]) and _finite_positive(call["cpu_s"])
        check = run["check"]
        assert check["max_loss_diff"] < 1e-4 and check["max_param_diff"] < 1e-4, (system, check)
        kept = LAYERS if system != "tc_aot_eager" else 0  # aot_eager drops the effect ops
        assert [c["effects"] for c in run["calls"]] == [kept] * cfg["calls"], system
        assert check["effects_equal_eager"] == (system != "tc_aot_eager"), (system, check)
    # one Dynamo graph, captured once by effectfx, and nothing captured after the first step
    backend = data["first_call"]["efx_backend"][0]
    assert backend["graphs"] == 1 and [c["captures"] for c in backend["calls"]] == [1] * cfg["calls"]

    steady = data["steady_state"]
    assert steady["status"] == dict.fromkeys(SYSTEMS, "ok") and steady["rounds"] >= 3
    for system in SYSTEMS:
        check = steady["checks"][system]
        assert check["captures_while_timing"] == 0, (system, check)
        assert _finite_positive(steady["step_ms"][system])

    summary = data["summary"]
    assert summary["systems"]["efx_backend"]["effects_equal_eager"]
    assert summary["systems"]["tc_aot_eager"]["effects_kept"] == 0
    assert summary["targets"]["backend_keeps_effects"]["met"]
    assert isinstance(summary["targets"]["backend_first_over_aot_eager"]["ratio"], float)  # measured
