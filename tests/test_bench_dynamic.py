"""Smoke test of ``benchmarks/dynamic.py --quick``: it runs into a temporary folder (never over the committed
figures), writes its JSON and PNG, and effectfx's automatic dynamic trains GPT-2 over the quick run's
sequence lengths like eager (loss, every gradient, one effect per layer) with at most two captures.
torch.compile is left out to keep this fast (its two compiles take 10-20 s); the full benchmark has it."""

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
if not (ROOT / "benchmarks" / "dynamic.py").is_file():  # pragma: no cover - installed without sources
    pytest.skip("benchmarks/ not in this checkout", allow_module_level=True)


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_dynamic_quick(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/dynamic.py", "--quick", "--systems", "efx",
                           "--no-progress", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "targets" in proc.stdout and "sym/static" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dynamic.json", "dynamic.png"]
    assert (tmp_path / "dynamic.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    data = json.loads((tmp_path / "dynamic.json").read_text())
    assert data["benchmark"] == "dynamic"
    assert data["machine"]["torch"].startswith("2.") and data["machine"]["timestamp"]
    cfg = data["config"]
    lengths = cfg["lengths"]
    assert cfg["quick"] is True and len(lengths) == len(set(lengths)) >= 3
    assert cfg["first_call_systems"] == ["efx"]
    assert set(cfg["steady_systems"]) == {"eager", "efx", "efx_static"}

    # the first calls, in a fresh process: one per length, each checked against eager
    (run,) = data["first_calls"]["efx"]
    assert run["status"] == "ok" and run["matches_eager"] is True and run["effects_ok"] is True, run
    assert [c["length"] for c in run["calls"]] == lengths
    for c in run["calls"]:
        assert _finite_positive(c["wall_s"]) and c["wall_s"] < 120 and _finite_positive(c["cpu_s"]), c
        assert c["ok"] and c["max_rel_diff"] < cfg["tolerance"] and c["effects"] == c["effects_expected"] == 4
    # automatic dynamic: static first, one symbolic capture at the second length, which serves the rest
    assert [c["captures"] for c in run["calls"]] == [1] + [2] * (len(lengths) - 1)
    assert run["captures"] <= 2 and len(run["capture_seconds"]) == 2

    s = data["summary"]["by_system"]["efx"]
    assert s["captures"] <= 2 and s["matches_eager"] is True and s["effects_ok"] is True
    assert len(s["calls_wall_s"]) == len(lengths)
    for field in ("first_wall_s", "first_cpu_s", "total_wall_s", "total_cpu_s", "total_over_first_wall",
                  "total_over_first_cpu", "total4_wall_s", "step_ms", "step_cpu_ms", "step_over_eager",
                  "step_over_static"):
        assert _finite_positive(s[field]), (field, s)
    assert s["total_wall_s"] >= s["first_wall_s"]

    # the steady state: every system right, and nothing captured again while timed
    steady = data["steady_state"]
    assert steady["status"] == {"eager": "ok", "efx": "ok", "efx_static": "ok"}, steady["status"]
    assert steady["rounds"] >= 3 and steady["length"] == cfg["steady_length"]
    for system, info in steady["info"].items():
        assert info["effects_ok"] and info["max_rel_diff"] < cfg["tolerance"], (system, info)
        assert info["captures_while_timing"] == 0, (system, info)
        assert _finite_positive(steady["step_ms"][system])
    assert steady["info"]["efx"]["captures_after_warmup"] == 2  # served by the symbolic program
    assert steady["info"]["efx_static"]["captures_after_warmup"] == 1

    targets = {t["target"]: t for t in data["summary"]["targets"]}
    assert targets[f"default backend: captures over {len(lengths)} lengths <= 2"]["met"] is True
    assert all(t["met"] is None for name, t in targets.items() if name.startswith("inductor"))
