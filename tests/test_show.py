"""``effectfx show FILE.py:FUNC``: printing each form, the example-inputs convention, and the HTML page
rendered by a real headless Chromium (Debian's package, installed by ``make browser``)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import effectfx as efx
from effectfx.cli import main
from effectfx.cli.show import FORMS, available_forms

ROOT = Path(__file__).resolve().parents[1]

USER_FILE = textwrap.dedent('''
    import torch
    import effectfx as efx

    NOTES = []

    if not hasattr(torch.ops.efxview, "show_note"):
        @torch.library.custom_op("efxview::show_note", mutates_args=())
        def show_note(label: str) -> None:
            NOTES.append(label)

        show_note.register_fake(lambda label: None)
    efx.register_effect("efxview::show_note", key="memory")


    @efx.region
    def inner(x):
        torch.ops.aten._print("inner")
        return x.sin()


    @efx.region
    def block(x):
        torch.ops.efxview.show_note("block")
        return inner(x) * 2


    def step(x):
        return block(block(x)).sum()


    def train(x):
        return block(x) * 3


    def by_attribute(x, scale):
        return block(x) * scale


    def by_function(x):
        return block(x)


    def no_inputs(x):
        return x


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return block(self.lin(x))


    net = Net()
    by_attribute.example_inputs = lambda: {"args": (torch.randn(4),), "kwargs": {"scale": 2.0}}


    def example_inputs_by_function():
        return (torch.randn(3),)


    EXAMPLE_INPUTS = {
        "step": (torch.randn(4),),
        "train": lambda: (torch.randn(4, requires_grad=True),),
        "net": torch.randn(2, 4),
    }
''')


@pytest.fixture(scope="module")
def user_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("show") / "user_model.py"
    path.write_text(USER_FILE)
    return path


def run_show(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["show", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# -- printing forms --------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_prints_each_available_form(form: str, user_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_show(capsys, f"{user_file}:step", "--form", form)
    if not available_forms()[form]:
        assert rc == 2 and "does not provide" in err, err
        pytest.skip(f"the {form} form's pass is not in this effectfx yet")
    assert rc == 0, err
    assert f"{form} form" in out
    assert "invoke_subgraph" in out and "'subgraph_0'" in out
    assert "def block_subgraph0(" in out and "def inner_subgraph1(" in out
    if form == "captured":
        assert "with_effects" not in out
        assert "torch.ops.efxview.show_note.default('block')" in out
    elif form == "functionalized":
        assert "def forward(self, token_memory, token_ordered, x)" in out
        assert "with_effects(token_memory, torch.ops.efxview.show_note.default, 'block')" in out
    elif form == "unlifted":
        assert "make_token()" in out and "sink_tokens(" in out
        assert "def forward(self, x)" in out
    else:  # token-free
        code = out.split("\n", 1)[1]  # below the header, which names the passes
        assert "with_effects" not in code and "token" not in code
        assert "torch.ops.efxview.show_note.default('block')" in out


def test_default_form_is_functionalized(user_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_show(capsys, f"{user_file}:step")
    assert rc == 0 and "functionalized form" in out


def test_unavailable_form_fails_clearly(user_file: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(efx, "unlift_tokens", raising=False)
    rc, out, err = run_show(capsys, f"{user_file}:step", "--form", "unlifted")
    assert rc == 2 and out == ""
    assert "'unlifted' form needs efx.unlift_tokens" in err
    assert "Available forms: captured, functionalized" in err


def test_example_input_conventions(user_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_show(capsys, f"{user_file}:by_attribute")  # attribute; a lambda giving kwargs
    assert rc == 0, err
    assert re.search(r"aten.mul.Tensor\(getitem_\d+, 2.0\)", out)
    rc, out, err = run_show(capsys, f"{user_file}:by_function")  # example_inputs_<func>()
    assert rc == 0, err
    assert "def forward(self, token_memory, token_ordered, x)" in out
    rc, out, err = run_show(capsys, f"{user_file}:net")  # an nn.Module instance; one bare tensor
    assert rc == 0, err
    assert "aten.addmm" in out or "aten.linear" in out
    rc, out, err = run_show(capsys, f"{user_file}:train", "--form", "captured")  # training program
    assert rc == 0, err
    assert "train (forward)" in out and "train (backward)" in out


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("{file}:no_inputs", "gives no example inputs for 'no_inputs'. Add one of:"),
        ("{file}:missing", "has no 'missing'"),
        ("{file}", "expected FILE.py:FUNC"),
        ("/nonexistent/file.py:f", "no such file"),
    ],
)
def test_bad_targets(target: str, message: str, user_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_show(capsys, target.format(file=user_file))
    assert rc == 2 and out == ""
    assert message in err


def test_console_entry_point_on_an_example(tmp_path: Path) -> None:
    out = tmp_path / "fn.html"
    cmd = [sys.executable, "-m", "effectfx", "show", "examples/print_and_log.py:fn", "--html", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"wrote {out}: functionalized form of fn")
    assert proc.stdout.rstrip().endswith("effect keys: log, ordered")
    data = page_data(out.read_text())
    layer = next(g for g in data["graphs"].values() if g["region"] == "layer")
    labels = [(n["key"], n["text"]) for n in layer["nodes"] if n["kind"] == "effect"]
    assert labels == [("ordered", "aten._print('[print] layer: start')"),
                      ("log", "efxex.log_value(x, 'layer input')"),
                      ("log", "efxex.log_value(tanh, 'layer output')"),
                      ("ordered", "aten._print('[print] layer: end')")]


# -- the HTML page ---------------------------------------------------------------------------------------


def write_page(capsys: pytest.CaptureFixture[str], target: str, out: Path,
               form: str = "functionalized") -> str:
    rc, stdout, err = run_show(capsys, target, "--form", form, "--html", str(out))
    assert rc == 0, err
    assert f"wrote {out}" in stdout
    return out.read_text()


def page_data(page: str) -> dict:
    match = re.search(r'<script type="application/json" id="efx-data">(.*?)</script>', page, re.S)
    assert match
    return json.loads(match.group(1))


def test_html_is_self_contained(user_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = write_page(capsys, f"{user_file}:step", tmp_path / "step.html")
    assert page.startswith("<!DOCTYPE html>")
    for external in ("<script src", "<link", "@import", "url(", "https://"):
        assert external not in page
    assert set(re.findall(r"http://[^\s\"']+", page)) <= {"http://www.w3.org/2000/svg"}  # a namespace
    data = page_data(page)
    assert data["keys"] == ["memory", "ordered"]
    graphs = data["graphs"]
    block = next(g for g in graphs.values() if g["region"] == "block")
    assert block["effects"] == ["memory", "ordered"]
    effect = next(n for n in block["nodes"] if n["kind"] == "effect")
    assert effect["key"] == "memory" and effect["text"] == "efxview.show_note('block')"
    assert block["chains"]["memory"]["style"] == "token"
    root = graphs[data["programs"][0]["root"]]
    assert [n["identifier"] for n in root["nodes"] if n["kind"] == "region"] == ["subgraph_0", "subgraph_0"]
    # a token chain per key at the root: input token -> region calls -> output
    chain = root["chains"]["memory"]["nodes"]
    assert chain[0] == "token_memory" and chain[-1] == "output"


# -- rendering in a real browser -------------------------------------------------------------------------


def _find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="session")
def chromium() -> str:
    path = _find_chromium()
    if path is None and shutil.which("make") and shutil.which("apt-get"):
        subprocess.run(["make", "-C", str(ROOT), "browser"], capture_output=True, timeout=1200)
        path = _find_chromium()
    if path is None:
        pytest.skip("headless Chromium is not available: /usr/bin/chromium is missing and `make browser` "
                    "could not install it (it needs apt-get and root or passwordless sudo)")
    return path


def dump_dom(chromium: str, page: Path, profile: Path, fragment: str = "") -> str:
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1200,2000",
           "--dump-dom", page.resolve().as_uri() + fragment]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "<html" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout


def test_browser_renders_regions_and_effects(chromium: str, user_file: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    page_path = tmp_path / "step.html"
    page = write_page(capsys, f"{user_file}:step", page_path)
    dom = dump_dom(chromium, page_path, tmp_path / "profile", "#open")
    # the script ran to the end and created the elements (they are not in the static page)
    assert 'data-efx-rendered="' in dom
    for created in ('<details class="efx-region"', '<li class="efx-node" data-kind="effect"',
                    '<g class="efx-chain"', '<li class="efx-node" data-kind="region"'):
        assert created not in page
        assert created in dom
    # region boxes: two calls of block at the root, each opening to show block's subgraph and, inside it,
    # inner's box; opened by the #open fragment
    regions = re.findall(r'<details class="efx-region"([^>]*)>', dom)
    assert len(regions) == 4
    assert all(" open" in attrs for attrs in regions)
    assert dom.count('data-identifier="subgraph_0"') == 2 and dom.count('data-identifier="subgraph_1"') == 2
    assert '<span class="efx-region-name">region block</span>' in dom
    assert '<span class="efx-region-name">region inner</span>' in dom
    # the user's names label the box and the call; effectfx's own (body, graph attribute) come after
    assert '<span class="efx-internal">body subgraph_0, graph block_subgraph0</span>' in dom
    assert re.search(r'<div class="efx-muted">block\(token(_\w+)?, ', dom)
    assert "1 program \u00b7 " in dom
    # effect nodes labelled with their arguments, tagged with their key
    effects = re.findall(r'<li class="efx-node" data-kind="effect"[^>]*data-key="(\w+)"[^>]*>(.*?)</li>', dom)
    labels = {(key, re.sub(r"<[^>]+>", "", body)) for key, body in effects}
    assert ("memory", "memoryefxview.show_note('block')") in labels
    assert ("ordered", "orderedaten._print('inner')") in labels
    # token chains drawn per key, in the key's color
    data = page_data(page)
    for key in ("memory", "ordered"):
        color = data["colors"][key]
        assert re.search(rf'<g class="efx-chain" data-key="{key}">.*?stroke="{color}"', dom)
    assert len(set(data["colors"].values())) == 2
    # every node of every graph drawn (the nested subgraphs inside each box included)
    n_nodes = sum(len(g["nodes"]) for g in data["graphs"].values())
    assert dom.count('<li class="efx-node"') >= n_nodes
    # the lanes have a height: layout happened
    heights = [int(h) for h in re.findall(r'<svg class="efx-lanes" width="\d+" height="(\d+)"', dom)]
    assert heights and max(heights) > 100


def test_browser_renders_training_program_unlifted(chromium: str, user_file: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    form = "unlifted" if available_forms()["unlifted"] else "captured"
    page_path = tmp_path / "train.html"
    write_page(capsys, f"{user_file}:train", page_path, form)
    dom = dump_dom(chromium, page_path, tmp_path / "profile")
    assert 'data-program="train (forward)"' in dom and 'data-program="train (backward)"' in dom
    assert '<span class="efx-region-name">region block (backward)</span>' in dom
    assert re.search(r'<details class="efx-region" data-identifier="subgraph_0"', dom)
    assert re.search(r'data-kind="effect"[^>]*data-key="memory"', dom)
    if form == "unlifted":
        assert re.search(r'<li class="efx-node" data-kind="token"[^>]*data-key="memory"[^>]*>'
                         r'token_memory = make_token\(\)', dom)
