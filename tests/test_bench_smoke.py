"""Smoke test of ``effectfx bench --quick``: it runs, writes into the git-ignored
``benchmarks/results/quick/`` (never over the committed figures), and its JSON and PNGs hold sane numbers."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("matplotlib")
if not (ROOT / "benchmarks" / "first_call.py").is_file():  # pragma: no cover - installed without sources
    pytest.skip("benchmarks/ not in this checkout", allow_module_level=True)


def _finite_positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _results_status() -> str | None:
    """``git status`` of the committed results (None outside a git checkout)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    proc = subprocess.run(["git", "status", "--porcelain", "--", "benchmarks/results"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    return proc.stdout if proc.returncode == 0 else None


def test_output_dir() -> None:
    from effectfx.cli.bench import _benchmarks_package

    _benchmarks_package()  # the checkout's benchmarks/ made importable, as the CLI does
    from benchmarks import common

    assert common.output_dir(None, quick=False) == common.RESULTS_DIR
    assert common.output_dir(None, quick=True) == common.QUICK_RESULTS_DIR == common.RESULTS_DIR / "quick"
    assert common.output_dir(Path("elsewhere"), quick=True) == Path("elsewhere")


def test_bench_quick() -> None:
    """The README's command, verbatim (no ``--out``), from the repository's root."""
    before = _results_status()
    proc = subprocess.run([sys.executable, "-m", "effectfx", "bench", "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "effectfx bench [" in proc.stderr  # the progress bar
    assert "first call, inference" in proc.stdout and "steady state" in proc.stdout
    # nothing committed changed; the files went to the git-ignored quick folder
    assert _results_status() == before
    written = {Path(line.split(" ", 1)[1]).name: Path(line.split(" ", 1)[1])
               for line in proc.stdout.splitlines() if line.startswith("wrote ")}
    assert set(written) == {"first_call.json", "first_call.png", "runtime.json", "runtime.png"}
    assert all(path.parent == ROOT / "benchmarks" / "results" / "quick" for path in written.values())

    first = json.loads(written["first_call.json"].read_text())
    runtime = json.loads(written["runtime.json"].read_text())
    for name in ("first_call.png", "runtime.png"):
        png = written[name].read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    for data in (first, runtime):
        machine = data["machine"]
        assert machine["torch"].startswith("2.") and machine["timestamp"] and machine["cpu_count"]

    assert first["config"]["quick"] is True
    ns = first["config"]["ns"]
    results = first["results"]
    assert {(r["system"], r["mode"], r["n"]) for r in results} == {
        (s, m, n) for s in ("efx", "tc", "eager") for m in ("inference", "training") for n in ns
    }
    for r in results:
        assert _finite_positive(r["median_s"]) and r["median_s"] < 120, r
        assert _finite_positive(r["cpu_median_s"]), r
    for r in results:
        if r["system"] in ("efx", "eager"):  # effectfx must be right; torch.compile is only recorded
            assert r["ok"] and r["matches_eager"] and r["effects_correct"], r
            assert r["effects_per_call"] == [r["n"]]
    for mode in ("inference", "training"):
        s = first["summary"][mode]
        assert _finite_positive(s["efx_growth"])
        for row in s["by_n"].values():
            assert _finite_positive(row["tc_over_efx"]) and _finite_positive(row["efx_over_eager"])

    assert {(r["width"], r["mode"]) for r in runtime["results"]} == {(64, "inference"), (64, "training")}
    for r in runtime["results"]:
        for clock in ("wall", "cpu"):
            m = r[clock]
            for name in ("eager", "efx", "eager_noeffect", "efx_noeffect", "op"):
                assert _finite_positive(m["median_us"][name]) and m["median_us"][name] < 1e6, (name, m)
            assert _finite_positive(m["efx_over_eager"])
            per_effect = m["per_effect"]
            assert math.isfinite(per_effect["efx_us"]) and _finite_positive(per_effect["op_eager_us"])
        assert r["systems"]["efx"]["effects_per_call"] == 16 and r["systems"]["efx"]["status"] == "ok"
        assert r["systems"]["efx_noeffect"]["effects_per_call"] == 0
