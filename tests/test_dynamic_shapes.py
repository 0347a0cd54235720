# ruff: noqa: E501  (golden graph text has long lines)
"""Symbolic shapes (Note [Symbolic shapes]): one capture serves every sequence length and batch size, exactly
as eager -- outputs, gradients, parameters after each optimizer step, and the effect log.

Real models from transformers configs (GPT-2, Llama, BERT; 4 layers, hidden 64, each layer a region with a
per-layer memory record) train over 8 distinct lengths and 2 batch sizes; the structure a symbolic body
has is a golden graph; sizes as effect arguments, guards, marks, specs, save/load and explain each get a case.
"""

from __future__ import annotations

import copy
import re
import textwrap
from pathlib import Path

import pytest
import torch

import effectfx as efx
import effectfx.testing  # noqa: F401  (registers the efxtest:: ops)
from effectfx.testing import hf
from effectfx.testing.effect_ops import recording

# (length, batch): 8 distinct lengths, 2 batch sizes, as a DataCollatorWithPadding epoch gives them
BATCHES = [(8, 2), (9, 2), (11, 2), (12, 3), (13, 2), (15, 3), (16, 2), (10, 2)]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def train_like_eager(kind: str, dynamic: bool | None, batches: list[tuple[int, int]] = BATCHES) -> object:
    """Train a compiled model and an eager copy side by side, one SGD step per batch; every loss, gradient,
    parameter and effect log must agree.  Returns the compiled model."""
    model = hf.build(kind)
    reference = copy.deepcopy(model)
    compiled = efx.compile(model, dynamic=dynamic)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    generator = torch.Generator().manual_seed(1)
    for length, batch in batches:
        ids = torch.randint(0, hf.VOCAB, (batch, length), generator=generator)
        with recording() as got:
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
        with recording() as want:
            expected = reference(input_ids=ids, labels=ids).loss
            expected.backward()
        where = f"{kind}, length {length}, batch {batch}"
        assert got == want and len(want) == hf.LAYERS, where
        assert _close(loss, expected), where
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert _close(p.grad, q.grad), f"{where}: gradient of {name}"
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert _close(p, q), f"{where}: {name} after the step"
    return compiled


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_training_over_lengths_takes_two_captures(kind: str) -> None:
    compiled = train_like_eager(kind, dynamic=None)
    assert compiled.stats.compiles == 2  # the first length, static; then one symbolic program for all
    static, symbolic = compiled.programs()
    assert not any(m.symbolic for _, m in static.forward.signature.tensor_meta)
    assert all(m.symbolic for _, m in symbolic.forward.signature.tensor_meta)
    # one body for the layer region, called by every layer, at every length
    assert [(b.region, b.calls) for b in symbolic.forward.bodies] == [("LoggedLayer.forward", hf.LAYERS)]
    assert symbolic.forward.specialized == ()  # no op pinned a size


def test_dynamic_true_captures_once_and_false_once_per_size() -> None:
    assert train_like_eager("gpt2", dynamic=True).stats.compiles == 1
    three = [(8, 2), (9, 2), (8, 3)]
    assert train_like_eager("gpt2", dynamic=False, batches=three).stats.compiles == 3


def test_a_longer_sequence_than_the_positions_fails_as_in_eager() -> None:
    model = hf.build("gpt2")
    compiled = efx.compile(model)
    for length in (8, 9):  # static, then symbolic
        ids = torch.randint(0, hf.VOCAB, (2, length))
        compiled(input_ids=ids, labels=ids)
    ids = torch.randint(0, hf.VOCAB, (2, hf.POSITIONS + 1))
    errors = []
    for run in (compiled, model):
        with recording() as log, pytest.raises(IndexError) as caught:
            run(input_ids=ids, labels=ids)
        errors.append((str(caught.value), log))
    assert errors[0] == errors[1] and errors[0][1] == []  # eager's error, and no effect ran before it
    assert compiled.stats.compiles == 2  # no guard failed: the symbolic program ran and raised


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_generation_grows_a_token_a_call_in_two_captures(kind: str) -> None:
    """``model.generate`` without a cache calls the forward on one more token each step: the first call is
    static, the second symbolic, and that program makes every later token."""
    model = hf.build(kind).eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, hf.VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    options = {"max_new_tokens": 16, "do_sample": False, "use_cache": False, "pad_token_id": 0}
    with recording() as want:
        expected = reference.generate(ids, **options)
    model.forward = compiled = efx.compile(model.forward)
    with recording() as got:
        tokens = model.generate(ids, **options)
    assert torch.equal(tokens, expected) and tokens.shape[1] == 5 + 16
    assert got == want and len(got) == 16 * hf.LAYERS
    assert compiled.stats.compiles == 2


# -- the structure: a golden graph of a symbolic body -----------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.name = name

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.record_memory(self.name)
        b, s, h = x.shape
        return torch.relu(self.lin(x)).view(b, s, 2, h // 2).sum(-1)


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Block("a"), Block("b")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.cat([self.a(x), self.a(x)], -1))


GOLDEN = """
def forward(self, token, x, a_lin_weight, a_lin_bias, b_lin_weight, b_lin_bias):
    block_forward_subgraph0 = self.Block_forward_subgraph0
    invoke_subgraph = effectfx.ops.invoke_subgraph(block_forward_subgraph0, 'subgraph_0', token, x, 'a', a_lin_weight, a_lin_bias)
    getitem = invoke_subgraph[0]
    getitem_1 = invoke_subgraph[1]
    invoke_subgraph_1 = effectfx.ops.invoke_subgraph(block_forward_subgraph0, 'subgraph_0', getitem, x, 'a', a_lin_weight, a_lin_bias)
    getitem_2 = invoke_subgraph_1[0]
    getitem_3 = invoke_subgraph_1[1]
    cat = torch.ops.aten.cat.default([getitem_1, getitem_3], -1)
    invoke_subgraph_2 = effectfx.ops.invoke_subgraph(block_forward_subgraph0, 'subgraph_0', getitem_2, cat, 'b', b_lin_weight, b_lin_bias)
    getitem_4 = invoke_subgraph_2[0]
    getitem_5 = invoke_subgraph_2[1]
    return (getitem_4, getitem_5)

# Block_forward_subgraph0: 'subgraph_0'
def Block_forward_subgraph0(self, token, x, name, lin_weight, lin_bias):
    with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.record_memory.default, name)
    getitem = with_effects[0]
    sym_size_int = torch.ops.aten.sym_size.int(x, 1)
    sym_size_int_1 = torch.ops.aten.sym_size.int(x, 0)
    mul = sym_size_int * sym_size_int_1
    view = torch.ops.aten.view.default(x, [mul, 4])
    t = torch.ops.aten.t.default(lin_weight)
    addmm = torch.ops.aten.addmm.default(lin_bias, view, t)
    view_1 = torch.ops.aten.view.default(addmm, [sym_size_int_1, sym_size_int, 4])
    relu = torch.ops.aten.relu.default(view_1)
    view_2 = torch.ops.aten.view.default(relu, [sym_size_int_1, sym_size_int, 2, 2])
    sum_1 = torch.ops.aten.sum.dim_IntList(view_2, [-1])
    return (getitem, sum_1)
"""


def test_golden_symbolic_region_body() -> None:
    """Sizes are read inside the body from its own operand (``sym_size``), never passed: one body for
    every batch and length, its graph interface the static one's (Note [Symbolic shapes])."""
    model = Two()
    x = torch.randn(3, 5, 4)
    spec = {"x": {0: torch.export.Dim("batch"), 1: torch.export.Dim("length")}}
    with torch.no_grad():  # an inference program: the golden text is the forward alone
        prog = efx.capture(model, x, dynamic_shapes=spec)
    assert prog.code().strip() == textwrap.dedent(GOLDEN).strip()
    for shape in [(3, 5, 4), (2, 9, 4), (7, 2, 4)]:
        x = torch.randn(shape)
        with recording() as got:
            out = prog(x)
        with recording() as want:
            expected = model(x)
        assert got == want == [("record_memory", n) for n in "aab"] and _close(out, expected)


@pytest.mark.parametrize("input_grad", [True, False])
def test_every_form_of_a_symbolic_training_program_verifies_and_matches_eager(input_grad: bool) -> None:
    """Without grad on the input, the first call of region ``a`` is promoted: its backward is the body's
    without the input's gradient (``_backward_skip0``), a variant under the same identifier."""
    model = Two()
    spec = {"x": {0: torch.export.Dim("b"), 1: torch.export.Dim("s")}}
    example = torch.randn(3, 5, 4, requires_grad=input_grad)
    functionalized = efx.capture(model, example, dynamic_shapes=spec)
    forms = {"captured": efx.capture(model, example, functionalize=False, dynamic_shapes=spec),
             "functionalized": functionalized, "unlifted": efx.unlift_tokens(functionalized),
             "token-free": efx.remove_effect_tokens(functionalized)}
    weight = model.a.lin.weight
    for name, prog in forms.items():
        efx.verify(prog)
        for shape in [(2, 7, 4), (5, 3, 4)]:
            x = torch.randn(shape, requires_grad=input_grad)
            wrt = [weight, x] if input_grad else [weight]
            with recording() as got:
                out = prog(x)
                grads = torch.autograd.grad(out.sum(), wrt)
            with recording() as want:
                expected = model(x)
                expected_grads = torch.autograd.grad(expected.sum(), wrt)
            assert got == want and _close(out, expected), (name, shape)
            assert all(_close(a, b) for a, b in zip(grads, expected_grads)), (name, shape)


# -- sizes as effect arguments ----------------------------------------------------------------------------
SIZES: list[int] = []


@torch.library.custom_op("efxdyn::record_size", mutates_args=())
def record_size(n: int, label: str) -> None:
    SIZES.append(n)
    torch.ops.efxtest.record_memory(f"{label}:{n}")


record_size.register_fake(lambda n, label: None)
efx.register_effect(record_size, key="memory")


@efx.region
def sized(x: torch.Tensor) -> torch.Tensor:
    record_size(x.shape[0] * 10 + x.shape[1], "sized")
    return x * 2


def test_a_size_given_to_an_effect_is_each_call_s_and_never_specializes() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        record_size(x.shape[1], "root")
        return sized(x) + 1

    compiled = efx.compile(fn, dynamic=True)
    for shape in [(2, 3), (4, 5), (3, 7)]:
        x = torch.randn(shape)
        with recording() as got:
            out = compiled(x)
        with recording() as want:
            expected = fn(x)
        assert got == want and _close(out, expected)
    assert compiled.stats.compiles == 1
    (prog,) = compiled.programs()
    assert prog.signature.shape_guards == ("L['t0'].stride()[0] == L['t0'].size()[1]",
                                           "L['t0'].stride()[1] == 1", "L['t0'].storage_offset() == 0",
                                           "2 <= L['t0'].size()[0]", "2 <= L['t0'].size()[1]")


# -- guards, marks, specs, save/load, explain ----------------------------------------------------------------
def double_rows(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0) * x.shape[0]


def test_a_call_that_breaks_a_guard_is_refused_by_a_program_and_recaptured_by_compile() -> None:
    prog = efx.capture(double_rows, torch.randn(4, 3), dynamic_shapes={"x": (torch.export.Dim("n"), None)})
    x = torch.randn(6, 3)
    assert _close(prog(x), double_rows(x))
    with pytest.raises(efx.SignatureMismatchError, match=re.escape("assumed (2 <= input0.size()[0])")):
        prog(torch.randn(1, 3))  # size 1 specializes, as torch's symbols do
    with pytest.raises(efx.SignatureMismatchError, match="input 0 was captured as"):
        prog(torch.randn(4, 5))  # a static size
    compiled = efx.compile(double_rows)
    for rows in (4, 6, 8, 1, 5):
        x = torch.randn(rows, 3)
        assert _close(compiled(x), double_rows(x))
    # static for 4; symbolic for 6, 8 and 5; size 1 breaks the symbolic program's guard: its own capture
    assert compiled.stats.compiles == 3


def test_mark_dynamic_and_mark_static() -> None:
    x = torch.randn(4, 6)
    efx.mark_dynamic(x, 1)
    compiled = efx.compile(lambda t: t.softmax(-1) * t.shape[1])
    compiled(x)
    (prog,) = compiled.programs()
    meta = prog.signature.tensor_meta[0][1]
    assert type(meta.shape[0]) is int and meta.symbolic  # only the marked size is a symbol
    y = torch.randn(4, 9)
    assert _close(compiled(y), y.softmax(-1) * 9) and compiled.stats.compiles == 1
    z = torch.randn(5, 6)
    efx.mark_static(z, 1)
    everything = efx.compile(lambda t: t * 2, dynamic=True)
    everything(z)
    shape = everything.programs()[0].signature.tensor_meta[0][1].shape
    assert type(shape[0]) is not int and shape[1] == 6


def test_save_and_load_keep_symbols_and_guards(tmp_path: Path) -> None:
    model = Two()
    with torch.no_grad():
        prog = efx.capture(model, torch.randn(3, 5, 4),
                           dynamic_shapes={"x": {0: torch.export.Dim("b"), 1: torch.export.Dim("s")}})
    path = tmp_path / "two.efx"
    efx.remove_effect_tokens(prog).save(path)
    loaded = efx.load(path)
    assert loaded.signature.shape_guards == prog.signature.shape_guards
    for shape in [(2, 9, 4), (6, 3, 4)]:
        x = torch.randn(shape)
        with recording() as got:
            out = loaded(x)
        with recording() as want:
            expected = model(x)
        assert got == want and _close(out, expected)
    with pytest.raises(efx.SignatureMismatchError, match="symbolic capture assumed"):
        loaded(torch.randn(1, 3, 4))


def test_explain_names_symbolic_inputs_and_guards() -> None:
    compiled = efx.compile(double_rows)
    compiled(torch.randn(4, 3))
    compiled(torch.randn(6, 3))
    text = str(efx.explain(compiled))
    assert "symbolic sizes (automatic dynamic: sizes changed)" in text
    assert re.search(r"symbolic sizes: x float32\[s\d+, s\d+\]", text)  # every size of a changed tensor
    assert "shape guards:" in text and "2 <= x.size()[0]" in text
