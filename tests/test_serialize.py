"""prog.save / efx.load: the token-free form round-trips through a zip of JSON + weights-only tensors."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch

import effectfx as efx
from effectfx.program.serialize import SerializationError
from effectfx.testing import recording


@efx.region
def region(x):
    torch.ops.efxtest.record_memory("N")
    return torch.ops.efxtest.bump(x, "r") * 2


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    @efx.region
    def forward(self, x):
        torch.ops.efxtest.log_tensor(x, "in")
        return torch.ops.efxtest.scale(torch.tanh(self.lin(x)), 0.5)


class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        torch.ops.efxtest.record_stdout("done")
        return x, x.shape[0]


def seed(x):
    return region(region(x))


def test_round_trip_seed(tmp_path) -> None:
    x = torch.randn(3)
    prog = efx.remove_effect_tokens(efx.capture(seed, x))
    prog.save(tmp_path / "p.zip")
    loaded = efx.load(tmp_path / "p.zip")
    efx.verify(loaded)
    assert loaded.form == "token-free" and loaded.history[-1].name == "load"
    assert len(loaded.subgraphs()) == 1  # the shared region is saved once and stays shared
    with recording() as eager_log:
        expected = seed(x)
    with recording() as log:
        out = loaded(x)
    torch.testing.assert_close(out, expected)
    assert log == eager_log
    # it runs effectfx's code, calling operators directly, and prints as the saved program did
    (body,) = loaded.subgraphs().values()
    assert "_op_" in body.code and "torch.ops." not in body.code
    assert "torch.ops." in loaded.code()


def test_round_trip_training_with_parameters_by_value(tmp_path) -> None:
    torch.manual_seed(0)
    model = Blocks()
    x = torch.randn(2, 4, requires_grad=True)
    prog = efx.remove_effect_tokens(efx.capture(model, x))
    prog.save(tmp_path / "t.zip")
    loaded = efx.load(tmp_path / "t.zip")
    assert isinstance(loaded, efx.TrainingProgram)
    with recording() as eager_log:
        (y, n), = [model(x)]
        y.sum().backward()
    eager_grad = x.grad.clone()
    x.grad = None
    with recording() as log:
        out, m = loaded(x)
        out.sum().backward()
    torch.testing.assert_close(out, y)
    assert m == n
    torch.testing.assert_close(x.grad, eager_grad)
    assert log == eager_log
    with torch.no_grad():  # parameters are saved by value: the loaded program does not see later updates
        model.blocks[0].lin.weight.add_(1.0)
    torch.testing.assert_close(loaded(x)[0], out)


def test_format_is_json_and_weights_only(tmp_path) -> None:
    prog = efx.remove_effect_tokens(efx.capture(seed, torch.randn(3)))
    prog.save(tmp_path / "p.zip")
    with zipfile.ZipFile(tmp_path / "p.zip") as zf:
        assert sorted(zf.namelist()) == ["program.json", "tensors.pt"]
        doc = json.loads(zf.read("program.json"))
    assert doc["format"] == "effectfx-program" and doc["version"] == 1
    targets = {n["target"] for g in doc["program"]["graphs"].values() for n in g["nodes"]
               if n["op"] == "call_function"}
    assert {"efxtest::record_memory.default", "effectfx.ops.invoke_subgraph", "operator.getitem"} <= targets


def test_load_refuses_unknown_targets(tmp_path) -> None:
    prog = efx.remove_effect_tokens(efx.capture(seed, torch.randn(3)))
    prog.save(tmp_path / "p.zip")
    with zipfile.ZipFile(tmp_path / "p.zip") as zf:
        doc, tensors = json.loads(zf.read("program.json")), zf.read("tensors.pt")
    graphs = doc["program"]["graphs"].values()
    node = next(n for g in graphs for n in g["nodes"] if n["op"] == "call_function")
    node["target"] = "os.system"
    with zipfile.ZipFile(tmp_path / "bad.zip", "w") as zf:
        zf.writestr("program.json", json.dumps(doc))
        zf.writestr("tensors.pt", tensors)
    with pytest.raises(SerializationError, match="os.system"):
        efx.load(tmp_path / "bad.zip")


@pytest.mark.parametrize("field", ["form", "out_layout"])
def test_load_refuses_unknown_kinds(tmp_path, field: str) -> None:
    """The form and the output leaves' kinds are saved by name (``Form``, ``OutputKind``), as plain strings;
    a name the enum lacks is refused."""
    prog = efx.remove_effect_tokens(efx.capture(lambda x: (region(x), 3), torch.randn(3)))
    prog.save(tmp_path / "p.zip")
    with zipfile.ZipFile(tmp_path / "p.zip") as zf:
        text, tensors = zf.read("program.json").decode(), zf.read("tensors.pt")
    doc = json.loads(text)
    assert doc["program"]["form"] == "token-free" and '"form": "token-free"' in text
    assert [kind for kind, _ in doc["program"]["out_layout"]] == ["tensor", "const"]
    if field == "form":
        doc["program"]["form"] = "sideways"
    else:
        doc["program"]["out_layout"][1][0] = "sideways"
    with zipfile.ZipFile(tmp_path / "bad.zip", "w") as zf:
        zf.writestr("program.json", json.dumps(doc))
        zf.writestr("tensors.pt", tensors)
    with pytest.raises(SerializationError, match="unknown (Form|OutputKind) 'sideways'"):
        efx.load(tmp_path / "bad.zip")


def test_only_token_free_is_saved(tmp_path) -> None:
    with pytest.raises(SerializationError, match="remove_effect_tokens"):
        efx.capture(seed, torch.randn(3)).save(tmp_path / "p.zip")
