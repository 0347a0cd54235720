"""Smoke test of ``benchmarks/generate.py --quick``: it runs into a temporary folder (never over the
committed figures), writes its JSON and PNG, and ``efx.compile(model).generate`` generates eager's tokens
with eager's effect log in at most the targets' captures (StaticCache 2, DynamicCache 3).  torch.compile is
left out to keep this fast (its first generate call takes tens of seconds); the full benchmark has it."""

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
if not (ROOT / "benchmarks" / "generate.py").is_file():  # pragma: no cover - installed without sources
    pytest.skip("benchmarks/ not in this checkout", allow_module_level=True)


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_generate_quick(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/generate.py", "--quick", "--no-progress",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "per token" in proc.stdout and "targets:" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["generate.json", "generate.png"]
    png = (tmp_path / "generate.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    data = json.loads((tmp_path / "generate.json").read_text())
    assert data["benchmark"] == "generate"
    assert data["machine"]["torch"].startswith("2.") and data["machine"]["timestamp"]
    cfg = data["config"]
    tokens, layers = cfg["tokens"], cfg["model"]["layers"]
    assert cfg["quick"] is True and tokens == 8 and layers == 4 and cfg["reps"] == 1
    assert cfg["first_call_systems"] == ["efx_static", "efx_dynamic"]  # no Inductor in a quick run
    assert set(cfg["steady_systems"]) == {"eager_static", "efx_static", "eager_dynamic", "efx_dynamic"}
    targets = cfg["targets"]
    limit = {"efx_static": targets["static_captures"], "efx_dynamic": targets["dynamic_captures"]}

    steady = data["steady_state"]
    checks = steady["checks"]
    assert steady["status"] == dict.fromkeys(cfg["steady_systems"], "ok") and steady["rounds"] >= 3
    eager_tokens = {cache: checks[f"eager_{cache}"]["tokens"] for cache in ("static", "dynamic")}
    assert all(len(t) == tokens for t in eager_tokens.values())
    assert len(set(eager_tokens["static"])) > 1  # the weights are scaled so that the tokens vary

    # the first calls, each in a fresh process, checked there against eager on the same weights
    for system, runs in data["first_call"].items():
        (run,) = runs
        assert run["status"] == "ok", run
        assert _finite_positive(run["wall_s"]) and run["wall_s"] < 120 and _finite_positive(run["cpu_s"])
        assert _finite_positive(run["second_s"]) and _finite_positive(run["warmup_s"])
        assert 1 <= run["compiles"] <= limit[system], run
        assert run["compiles_after_second"] == run["compiles"]  # the second generate captures nothing
        assert run["tokens_equal_eager"] and run["second_tokens_equal_eager"], run
        assert run["tokens"] == eager_tokens[system.split("_")[1]]
        assert run["effects"] == run["eager_effects"] == tokens * layers
        assert run["effects_equal_eager"] and run["second_effects_equal_eager"], run

    # the steady state: every system right in its warm-up and timed calls, nothing captured while timed
    for system in cfg["steady_systems"]:
        check = checks[system]
        cache = system.split("_")[1]
        assert check["tokens"] == eager_tokens[cache], system
        assert check["tokens_equal_eager"] and check["timed_tokens_equal_eager"], system
        assert check["effects_equal_eager"] and check["effects_per_generate_timed"] == [tokens * layers]
        assert check["max_logit_diff"] is not None and check["max_logit_diff"] < 1e-4, check
        assert check["compiles_in_timing"] == 0, check
        if system.startswith("efx"):
            assert 1 <= check["compiles_in_warmup"] <= limit[system], check
        assert steady["forwards_per_generate"][system] == [tokens]
        medians = steady["medians"][system]
        for field in ("generate_s", "generate_cpu_s", "token_s", "token_cpu_s", "forward_s", "prefill_s"):
            assert _finite_positive(medians[field]) and medians[field] < 10, (system, field, medians)
        assert medians["forward_s"] <= medians["token_s"] * 1.5  # a forward is most of a decode step

    summary = data["summary"]
    for system in cfg["steady_systems"]:
        s = summary["systems"][system]
        assert s["tokens_equal_eager"] and s["effects_equal_eager"], (system, s)
        assert _finite_positive(s["token_over_eager"]) and _finite_positive(s["generate_over_eager"])
    assert summary["targets"]["static_captures"]["met"] and summary["targets"]["dynamic_captures"]["met"]
    assert _finite_positive(summary["targets"]["static_token_over_eager"]["value"])  # measured, not required
