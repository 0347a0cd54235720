"""The examples in ``examples/`` run, and match eager; ``effectfx demo`` shows the training beside eager."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

import effectfx as efx
from effectfx.cli import demo

ROOT = Path(__file__).resolve().parents[1]


def run_script(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_print_and_log_example() -> None:
    proc = run_script("examples/print_and_log.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "# tokens (in order): log, ordered" in out
    assert "transcripts identical (capture and efx.compile): True; outputs equal: True" in out
    assert "6 prints (key 'ordered') and 5 logs (key 'log')" in out
    # the side-by-side transcript, eager's order: prints and logs interleaved as the program runs them
    table = out.split("effectfx (captured program)\n", 1)[1].split("\n\n", 1)[0].splitlines()
    eager_column = [line.split("   ")[0].strip() for line in table]
    kinds = [line.split("]")[0] + "]" for line in eager_column]
    assert kinds == ["[print]", "[print]", "[log]", "[log]", "[print]", "[print]", "[log]", "[log]",
                     "[print]", "[log]", "[print]"]
    assert all(line.split("   ")[0].strip() == line.split("   ")[-1].strip() for line in table)


def test_gpt2_memory_example() -> None:
    proc = run_script("examples/gpt2_memory.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "effect log identical to eager: True (4 effects)" in out and "losses match: True" in out
    # one record per layer, in order, each with the layer's activation (2 x 8 x 64 float32)
    log = out.split("effect log (prefix, layer, activation bytes, rms):\n", 1)[1].split("\n\n", 1)[0]
    entries = [line.strip().strip("()").split(", ")[:3] for line in log.splitlines()]
    assert entries == [["'forward'", f"'layer{i}'", "4096"] for i in range(4)]
    # the layer name is an operand of the effect: one body serves the four layers
    assert "region MemoryRecorded.forward: 1 body, 4 calls; effects ['memory']" in out


def test_generate_example() -> None:
    proc = run_script("examples/generate.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for cache, captures in (("DynamicCache", 3), ("StaticCache", 2)):
        assert (f"{cache}: tokens identical to eager: True; effect log identical: True (64 records); "
                f"{captures} captures; 4 bodies") in out


def test_tensor_parallel_example() -> None:
    proc = run_script("examples/tensor_parallel.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "every rank matches its eager run: True" in out
    for rank in (0, 1):
        block = out.split(f"rank {rank}: ", 1)[1]
        assert "gradients equal: True; effect log identical: True (12 effects); collectives identical: " \
               "True (24 all-reduces over 3 steps)" in block
        assert "region Block.forward: 1 body, 4 calls; forward effects ['c10d:0', 'log'], backward effects " \
               "['c10d:0']" in block
    # the body threads the group's token through the all-reduce, the group a program constant
    assert "def Block_forward_subgraph0(self, token_c10d_0, token_log, x, name," in out
    assert ("with_effects(token_c10d_0, torch.ops.effectfx_c10d.all_reduce_group0.default, _torchbind_obj0"
            in out)


@pytest.fixture(scope="module")
def transformer():  # noqa: ANN201 - the example module
    module = demo.load_example("transformer_memory")
    assert module is not None, "examples/transformer_memory.py is missing"
    return module


def test_transformer_example_matches_eager(transformer) -> None:  # noqa: ANN001
    result = transformer.compare(steps=2, n_layers=2)
    assert result.ok and result.logs_match and result.losses_match and result.params_match
    assert result.eager.losses[1] < result.eager.losses[0] - 0.1  # it learns: the loss falls
    for log in result.effectfx.logs:
        forward = [name for prefix, name in log if prefix == "forward"]
        backward = [name for prefix, name in log if prefix == "backward"]
        assert forward == ["layer0", "attention", "mlp", "layer1", "attention", "mlp", "head"]
        assert backward == ["block", "block"]
    # the block is one region body, called once per layer
    region = efx.explain(result.compiled).regions["Block.forward"]
    assert len(region.bodies) == 1 and region.calls == 2
    assert region.forward_effects == ("memory",) and region.backward_effects == ("memory",)


def test_transformer_example_main(transformer, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    assert transformer.main(steps=1, n_layers=2) == 0
    out = capsys.readouterr().out
    assert "effect logs identical: True (9 effects over 1 steps)" in out
    assert "parameters match: True" in out and "losses match: True" in out
    assert "region Block.forward: 1 body, 2 calls per step; forward effects ['memory'], backward effects " \
           "['memory']" in out


def test_demo_fails_when_logs_differ(transformer, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                     capsys: pytest.CaptureFixture[str]) -> None:
    real = transformer.compare(steps=1, n_layers=1)
    assert demo.run_training_demo(1, 1) == 0
    broken = dataclasses.replace(real, effectfx=dataclasses.replace(
        real.effectfx, logs=[real.effectfx.logs[0][:-1]]))
    monkeypatch.setattr(transformer, "compare", lambda steps, n_layers: broken)
    assert demo.run_training_demo(1, 1) == 1
    out = capsys.readouterr().out
    assert "effect logs identical: False" in out
    assert "first difference: entry 4: eager ('backward', 'block'), got nothing" in out


def test_first_difference() -> None:
    assert demo.first_difference([[1, 2], [3]], [[1, 2], [3]]) is None
    assert demo.first_difference([[1, 2], [3]], [[1, 2], [4]]) == "step 1, entry 0: eager 3, got 4"
    assert demo.first_difference([[1.5, 2.5]], [[]]) == "entry 0: eager 1.5, got nothing"


def test_demo_command() -> None:
    proc = run_script("-m", "effectfx", "demo", "--steps", "2", "--layers", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    lines = out.splitlines()
    # about a screenful, in a terminal's width
    assert len(lines) <= 70 and max(len(line) for line in lines) <= 110, out
    assert "Why effect tokens." in out
    # 1. the smallest program
    assert "outputs equal: True; effect logs identical: True (2 record_memory calls each)" in out
    assert re.search(r"first capture in this process: \d+ ms, \d+ ms of it one-time: torch's fake tensors "
                     r"import\ntorch._dynamo on first use. The capture itself took \d+ ms", out)
    # 2. beside torch.compile: effectfx's row must be right; torch.compile's is measured, whatever it is
    assert "torch.compile uses backend='aot_eager'" in out
    assert re.search(r"  torch.compile, op unknown to torch +\d of 4", out)
    assert re.search(r"  torch.compile, op in torch's private registry +\d of 4", out)
    assert re.search(r"  effectfx \(efx.compile\) +4 of 4   equal eager's", out)
    # 3. training: effect counts, no difference, and a falling loss
    assert "effect logs identical: True (18 effects over 2 steps; first difference: none)" in out
    assert "parameters match: True" in out
    table = out.split("effects (forward + backward)\n", 1)[1].split("\n\n", 1)[0].splitlines()
    losses = [(float(row.split()[1]), float(row.split()[2])) for row in table]
    assert len(losses) == 2 and losses[0][0] == losses[0][1] and losses[1][0] < losses[0][0]
    assert [row.split(None, 3)[3] for row in table] == ["7 + 2", "7 + 2"]
