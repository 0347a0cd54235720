"""Everything README.md shows runs, verbatim, as a newcomer would run it after the set-up command.

* every ```python block is a complete program: it runs on its own, in a fresh interpreter, with exit 0;
* the ```text block after the first example is what that example prints;
* every command of every ```bash block runs from the repository's root with exit 0 and leaves the
  committed files as they were -- except where running it here would recurse or repeat a test (below).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == language]


def commands() -> list[str]:
    """The command lines of the bash blocks, comments removed."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


# Commands not run verbatim here, and why.
#  * `make X` would recurse (`make test` runs this file) or reinstall the virtualenv: `make -n X` checks the
#    target exists and its recipe parses; what `make demo` then runs is the `effectfx demo` line below.
#  * `effectfx bench --quick` is run verbatim by tests/test_bench_smoke.py::test_bench_quick (through
#    `python -m effectfx`), which also checks that the committed results stay untouched.
#  * `effectfx fuzz --programs N` runs about a second per program: here 3 programs, the same command else.
DELEGATED = {"bench --quick": "tests/test_bench_smoke.py::test_bench_quick"}


def _as_run(command: str) -> str:
    if command.startswith("make "):
        return "make -n " + command.removeprefix("make ")
    return re.sub(r"fuzz --programs \d+", "fuzz --programs 3", command)


def _committed_state() -> dict[str, str]:
    """Hashes of the tracked files a command could write (benchmark results, examples)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return {}
    listed = subprocess.run(["git", "ls-files", "benchmarks/results", "examples"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60).stdout.split()
    return {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest() for p in listed if (ROOT / p).is_file()}


def test_readme_has_blocks() -> None:
    assert len(blocks("python")) >= 2 and len(blocks("text")) >= 1 and len(commands()) >= 5


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_python_block_runs(index: int, tmp_path: Path) -> None:
    program = tmp_path / f"readme_block_{index}.py"
    program.write_text(blocks("python")[index])
    proc = subprocess.run([sys.executable, str(program)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"README python block {index}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
    if index == 0:  # the first example prints its program: the README shows that output
        shown = blocks("text")[0].splitlines()
        printed = proc.stdout.splitlines()
        assert printed[0].startswith("# effectfx <lambda>, functionalized form; made by: capture (")
        assert printed[1:1 + len(shown)] == shown
        assert printed[1 + len(shown):] == ["record_memory forward N"]


@pytest.mark.parametrize("command", commands())
def test_command_runs(command: str) -> None:
    delegated = next((test for cmd, test in DELEGATED.items() if cmd in command), None)
    if delegated is not None:
        pytest.skip(f"run verbatim by {delegated}")
    if command.startswith(".venv/") and not (ROOT / command.split()[0]).exists():
        pytest.skip(f"no {command.split()[0]}: set up with `make demo` or `make test` first")
    if command.startswith("make ") and shutil.which("make") is None:
        pytest.skip("no make")
    before = _committed_state()
    proc = subprocess.run(["bash", "-c", _as_run(command)], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert _committed_state() == before, f"{command} changed committed files"
