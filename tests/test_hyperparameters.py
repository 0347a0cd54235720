"""Hyperparameters are inputs once they change (Note [Float inputs]): a learning-rate schedule, a loss
scale or a temperature costs at most two captures of a compiled step, and the program computes what eager
computes with each call's value."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import effectfx as efx

STEPS = 50


def _cosine(it: int, base: float = 0.05) -> float:
    return base * 0.1 + base * 0.9 * (1 + math.cos(math.pi * it / STEPS)) / 2


class TinyGPT(nn.Module):
    """A nanoGPT-style model: embeddings, one pre-norm transformer block, a tied head."""

    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(8, dim)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj, self.heads = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim), heads
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        b, d = x.shape[0], x.shape[2]
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).chunk(3, -1))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.ln2(x))
        logits = self.head(self.lnf(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def _mlp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def _data(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    return torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
    # the per-tensor loop, chosen by the user: the step runs the multi-tensor one with a tensor lr
    "sgd-loop": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, foreach=False),
    "adam-loop": lambda ps: torch.optim.Adam(ps, lr=0.05, foreach=False),
}


def _pair(kind: str, make_opt: object) -> tuple:
    torch.manual_seed(0)
    model = _mlp() if kind == "mlp" else TinyGPT()
    twin = copy.deepcopy(model)
    loss_of = _mlp_loss if kind == "mlp" else (lambda m, x, y: m(x, y))
    return model, make_opt(model.parameters()), twin, make_opt(twin.parameters()), loss_of


def _step_fn(model: nn.Module, opt: torch.optim.Optimizer, loss_of: object) -> object:
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _assert_same(model: nn.Module, opt: torch.optim.Optimizer, twin: nn.Module, topt: torch.optim.Optimizer,
                 it: int) -> None:
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"step {it} {n}: {m}")
    for p, q in zip(model.parameters(), twin.parameters()):
        for key, v in topt.state[q].items():
            torch.testing.assert_close(opt.state[p][key], v, rtol=1e-5, atol=1e-5, check_dtype=False)


@pytest.mark.parametrize(("kind", "name"), [(k, n) for k in ("mlp", "gpt") for n in OPTIMIZERS
                                             if k == "mlp" or "loop" not in n])
def test_a_cosine_schedule_costs_two_captures(kind: str, name: str) -> None:
    model, opt, twin, topt, loss_of = _pair(kind, OPTIMIZERS[name])
    step, eager = efx.compile(_step_fn(model, opt, loss_of)), _step_fn(twin, topt, loss_of)
    x, y = _data(kind)
    for it in range(STEPS):
        for o in (opt, topt):
            for group in o.param_groups:  # (the GPT's Adam amplifies rounding at larger steps)
                group["lr"] = _cosine(it, 0.05 if kind == "mlp" else 0.002)
        torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-5, atol=1e-5)
        _assert_same(model, opt, twin, topt, it)
    assert step.stats.compiles == 2


def test_a_float_the_optimizer_needs_as_a_float_stays_specialized() -> None:
    """AdamW asks ``weight_decay != 0`` in Python: a capture with it as an input fails, so it is guarded
    by value from then on (one capture per value), while ``lr`` stays an input."""
    model, opt, twin, topt, loss_of = _pair("mlp", OPTIMIZERS["adamw"])
    step, eager = efx.compile(_step_fn(model, opt, loss_of)), _step_fn(twin, topt, loss_of)
    x, y = _data("mlp")
    for it in range(20):
        for o in (opt, topt):
            o.param_groups[0].update(lr=_cosine(it), weight_decay=0.1 if it < 10 else 0.05)
        torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-5, atol=1e-5)
        _assert_same(model, opt, twin, topt, it)
    assert step.stats.compiles == 3  # the first step, the later ones, a new weight_decay
    last = step.programs()[-1]
    entry = step.cache[next(iter(step.cache))][-1]
    assert [p[-1] for _, p in entry.floats] == [("item", "lr")] and last is entry.program


def test_a_capture_the_code_itself_fails_blames_no_float() -> None:
    """A call whose capture fails for the code's own reasons (here it raises) while ``lr`` changed raises the
    code's error, as eager does, and leaves ``lr`` an input: later schedules add no capture."""
    model, opt, twin, topt, loss_of = _pair("mlp", OPTIMIZERS["sgd"])

    def checked(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if getattr(m, "refuse", False):
            raise ValueError("this batch is refused")
        return loss_of(m, x, y)

    step, eager = efx.compile(_step_fn(model, opt, checked)), _step_fn(twin, topt, checked)
    x, y = _data("mlp")
    for it in range(8):
        for o, m in ((opt, model), (topt, twin)):
            o.param_groups[0]["lr"] = _cosine(it)
            m.refuse = it == 1  # (the capture that raises also sees lr changed)
        if it == 1:
            for f in (step, eager):
                with pytest.raises(ValueError, match="this batch is refused"):
                    f(x, y)
            continue
        torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-5, atol=1e-5)
        _assert_same(model, opt, twin, topt, it)
    assert step.stats.compiles == 2  # the first step; then lr an input (at the step after the refused one)
    assert not step._specialized


def test_an_lr_scheduler_stepped_outside_the_step() -> None:
    model, opt, twin, topt, loss_of = _pair("mlp", OPTIMIZERS["adamw"])
    scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS) for o in (opt, topt)]
    step, eager = efx.compile(_step_fn(model, opt, loss_of)), _step_fn(twin, topt, loss_of)
    x, y = _data("mlp")
    for it in range(STEPS):
        torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-5, atol=1e-5)
        for s in scheds:
            s.step()
        _assert_same(model, opt, twin, topt, it)
    assert step.stats.compiles <= 2


@pytest.mark.parametrize("name", ["sgd", "sgd-loop", "sgd-momentum", "sgd-momentum-loop", "adam", "adamw"])
def test_a_tensor_lr(name: str) -> None:
    make = {"sgd": lambda ps, lr: torch.optim.SGD(ps, lr=lr),
            "sgd-loop": lambda ps, lr: torch.optim.SGD(ps, lr=lr, foreach=False),
            "sgd-momentum-loop": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9, foreach=False),
            "sgd-momentum": lambda ps, lr: torch.optim.SGD(ps, lr=lr, momentum=0.9),
            "adam": lambda ps, lr: torch.optim.Adam(ps, lr=lr),
            "adamw": lambda ps, lr: torch.optim.AdamW(ps, lr=lr)}[name]
    model, opt, twin, topt, loss_of = _pair("mlp", lambda ps: make(ps, torch.tensor(0.1)))
    step, eager = efx.compile(_step_fn(model, opt, loss_of)), _step_fn(twin, topt, loss_of)
    x, y = _data("mlp")
    for it in range(6):
        for o in (opt, topt):
            o.param_groups[0]["lr"].fill_(0.1 / (it + 1))  # a tensor lr changes in place: no capture
        torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-5, atol=1e-5)
        _assert_same(model, opt, twin, topt, it)
    assert step.stats.compiles <= 2


class Scaled(nn.Module):
    """A loss scale and a temperature read from module attributes, as a trainer sets them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.temperature = 1.0
        self.loss_scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) / self.temperature).logsumexp(-1).mean() * self.loss_scale


def test_a_temperature_and_loss_scale_from_module_attributes() -> None:
    torch.manual_seed(0)
    model = Scaled()
    compiled = efx.compile(model)
    x = torch.randn(5, 4)
    for it in range(20):
        model.temperature, model.loss_scale = 1.0 + it / 10, 2.0 ** (it % 4)
        _assert_call_as_eager(model, compiled, x)
    assert compiled.stats.compiles == 2


def _assert_call_as_eager(model: nn.Module, compiled: object, x: torch.Tensor) -> None:
    """One call: the compiled module's output and ``model.lin``'s gradient are eager's."""
    out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    out.backward()
    g = model.lin.weight.grad.clone()
    model.zero_grad()
    model(x).backward()
    torch.testing.assert_close(g, model.lin.weight.grad, rtol=1e-5, atol=1e-5)
    model.zero_grad()


class Repeated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.times = 1
        self.scale = 2.0  # (1.0 would hide a baked-in count)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times):
            x = x * self.scale
        return x


def test_ints_still_specialize() -> None:
    model = Repeated()
    compiled = efx.compile(model)
    x = torch.ones(3)
    for times in (1, 2, 3):
        model.times = times
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled.stats.compiles == 3


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = 0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if self.p > 0.4 else x  # needs the float itself: specialized, as before


def test_a_float_the_code_needs_as_a_float_specializes() -> None:
    model = Branchy()
    compiled = efx.compile(model)
    x = torch.ones(3)
    for p in (0.5, 0.3, 0.6, 0.2):
        model.p = p
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled.stats.compiles == 4
    assert all(not e.floats for es in compiled.cache.values() for e in es)


def test_explain_names_the_float_inputs() -> None:
    model, opt, _, _, loss_of = _pair("mlp", OPTIMIZERS["sgd"])
    step = efx.compile(_step_fn(model, opt, loss_of))
    x, y = _data("mlp")
    for it in range(3):
        opt.param_groups[0]["lr"] = _cosine(it)
        step(x, y)
    text = str(efx.explain(step))
    assert "float inputs: SGD.param_groups[0]['lr']" in text


GOLDEN = """\
def forward(self, x, lifted):
    mul = torch.ops.aten.mul.Tensor(x, lifted)
    return (mul,)"""


class Temperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.temperature


def test_golden_the_float_is_an_input() -> None:
    model = Temperature()
    compiled = efx.compile(model)
    x = torch.ones(3)
    for t in (1.0, 0.5, 0.25):
        model.temperature = t
        torch.testing.assert_close(compiled(x), x * t)
    assert compiled.stats.compiles == 2
    print(compiled.programs()[-1].code())
    assert compiled.programs()[-1].code() == GOLDEN


class Affine(nn.Module):
    """A tuple of floats on a module (a scale and a shift), set before every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.affine = (1.0, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale, shift = self.affine
        return (self.lin(x) * scale + shift).sum()


def test_a_tuple_of_floats_is_a_tuple_of_inputs() -> None:
    torch.manual_seed(0)
    model = Affine()
    compiled = efx.compile(model)
    x = torch.randn(5, 4)
    for it in range(8):
        model.affine = (1.0 + it / 4, -it / 8)
        _assert_call_as_eager(model, compiled, x)
    assert compiled.stats.compiles == 2
    entry = compiled.cache[next(iter(compiled.cache))][-1]
    assert [p[-1] for _, p in entry.floats] == [("index", 0), ("index", 1)]
    model.affine = (1.0, 2.0, 3.0)  # another length: another program (and eager's error)
    with pytest.raises(ValueError, match="too many values to unpack"):
        compiled(x)


def test_adam_betas_that_change_stay_values() -> None:
    """torch.optim's Adam reads ``betas`` as Python scalars (``_foreach_lerp_``'s weight, ``addcmul``'s
    value: a tensor there is ``.item()``): a capture with them as inputs fails, so they are guarded by
    value after it, while ``lr`` is an input (Note [Float inputs])."""
    model, opt, twin, topt, loss_of = _pair("mlp", OPTIMIZERS["adam"])
    step, eager = efx.compile(_step_fn(model, opt, loss_of)), _step_fn(twin, topt, loss_of)
    x, y = _data("mlp")
    for it in range(8):
        for o in (opt, topt):
            o.param_groups[0].update(lr=_cosine(it), betas=(0.9, 0.999) if it < 4 else (0.8, 0.99))
        torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-5, atol=1e-5)
        _assert_same(model, opt, twin, topt, it)
    assert step.stats.compiles == 3  # the first step, lr an input, the new betas
    entry = step.cache[next(iter(step.cache))][-1]
    assert [p[-1] for p in entry.float_paths] == [("item", "lr")]


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_dynamic_true_takes_lr_as_an_input_from_the_first_call(name: str) -> None:
    model, opt, twin, topt, loss_of = _pair("mlp", OPTIMIZERS[name])
    step, eager = efx.compile(_step_fn(model, opt, loss_of), dynamic=True), _step_fn(twin, topt, loss_of)
    x, y = _data("mlp")
    for it in range(10):
        for o in (opt, topt):
            o.param_groups[0]["lr"] = _cosine(it)
        torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-5, atol=1e-5)
        _assert_same(model, opt, twin, topt, it)
    # the first step's program (it creates the optimizer's state) and the later steps': the cosine cost none
    assert step.stats.compiles == 2
    assert all(e.float_paths for es in step.cache.values() for e in es)
    assert not any("lr" in why for es in step.cache.values() for e in es for why in e.why[:-1])


def test_dynamic_true_keeps_a_float_the_optimizer_needs() -> None:
    """A changed weight_decay (AdamW's ``!= 0``) costs one capture per value; lr stays an input throughout."""
    model, opt, twin, topt, loss_of = _pair("mlp", OPTIMIZERS["adamw"])
    step, eager = efx.compile(_step_fn(model, opt, loss_of), dynamic=True), _step_fn(twin, topt, loss_of)
    x, y = _data("mlp")
    for it in range(8):
        for o in (opt, topt):
            o.param_groups[0].update(lr=_cosine(it), weight_decay=0.1 if it < 4 else 0.05)
        torch.testing.assert_close(step(x, y), eager(x, y), rtol=1e-5, atol=1e-5)
        _assert_same(model, opt, twin, topt, it)
    assert step.stats.compiles == 3  # the first step, the later ones, a new weight_decay


# -- property: floats used every way, changed at random between calls ----------------------------------------
USES = {  # how the code uses attribute f{i}: as a tensor would (an input once it changes) or as a float
    "arith": "x = x * self.f{i} + self.f{i}",
    "clamp": "x = torch.clamp(x, max=self.f{i} + 1.0)",  # (clamp.Tensor takes a cell)
    "branch": "x = x * 2 if self.f{i} > 0.5 else x - 1",  # needs the float: specialized
    "python": "x = x * float(self.f{i} * 2)",  # float() of a cell: specialized
}


def _floats_module(uses: list[str]) -> nn.Module:
    lines = "\n".join("        " + USES[u].format(i=i) for i, u in enumerate(uses))
    source = f"def forward(self, x):\n    if True:\n{lines}\n    return x.sum()\n"
    scope: dict = {"torch": torch}
    exec(compile(source, "<floats>", "exec"), scope)
    model = type("Floats", (nn.Module,), {"forward": scope["forward"]})()
    for i in range(len(uses)):
        setattr(model, f"f{i}", 1.0)
    return model


@settings(max_examples=25, deadline=None)
@given(uses=st.lists(st.sampled_from(sorted(USES)), min_size=1, max_size=3),
       values=st.lists(st.lists(st.sampled_from([0.25, 1.0, 1.5, 3.0]), min_size=3, max_size=3),
                       min_size=2, max_size=6))
def test_floats_changed_between_calls_compute_what_eager_computes(uses: list[str], values: list[list[float]]
                                                                  ) -> None:
    model = _floats_module(uses)
    compiled = efx.compile(model)
    x = torch.linspace(-1, 1, 3, requires_grad=True)
    for call in values:
        for i in range(len(uses)):
            setattr(model, f"f{i}", call[i])
        got = compiled(x)
        (g,) = torch.autograd.grad(got, x)
        want = model(x)
        (w,) = torch.autograd.grad(want, x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(g, w)
    if all(u in ("arith", "clamp") for u in uses):  # a tensor can stand for each: one capture more per float
        changed = sum(len({call[i] for call in values}) > 1 for i in range(len(uses)))
        assert compiled.stats.compiles <= 1 + changed
