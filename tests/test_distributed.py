"""Collectives as ordered effects, on 2 processes (gloo, 127.0.0.1).

Every scenario runs once on both ranks, in one pair of spawned processes (a module fixture: torch's import
and the first capture are paid once), and returns plain data; the tests below check it.  A rank's
scenario compares effectfx with that rank's own eager run: outputs, gradients, the effect log and the
collectives it issued (``CollectiveLog``).  A hang fails the run after a timeout instead of blocking.
"""

# ruff: noqa: E501  (golden graph text has long lines)
from __future__ import annotations

import re
import textwrap
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

import effectfx as efx
from effectfx.testing import check_against_eager, check_mutations_against_eager, recording
from effectfx.testing.differential import fresh_args
from effectfx.testing.distributed import CollectiveLog, run_ranks

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")


# -- the tensor-parallel stack: column-parallel up, row-parallel down, an all-reduce per block ------------
class CopyToParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient in backward (the tensor-parallel "f")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """All-reduce forward (in place, as Megatron does); identity backward (the tensor-parallel "g")."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ParallelBlock(nn.Module):
    def __init__(self, name: str, d: int, hidden: int, rank: int, world: int) -> None:
        super().__init__()
        self.name = name
        full_up, full_down = nn.Linear(d, hidden), nn.Linear(hidden, d, bias=False)  # same on every rank
        shard = slice(rank * hidden // world, (rank + 1) * hidden // world)
        self.up = nn.Linear(d, hidden // world)
        self.down = nn.Linear(hidden // world, d, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(full_up.weight[shard])
            self.up.bias.copy_(full_up.bias[shard])
            self.down.weight.copy_(full_down.weight[:, shard])

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.record_memory(self.name)
        h = torch.relu(self.up(CopyToParallel.apply(x)))
        y = ReduceFromParallel.apply(self.down(h))
        torch.ops.efxtest.log_tensor(y, "block out")
        return x + y


class ParallelStack(nn.Module):
    def __init__(self, rank: int, world: int, n_blocks: int = 4, d: int = 8, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(d, d)
        self.blocks = nn.Sequential(*[ParallelBlock(f"block{i}", d, hidden, rank, world)
                                      for i in range(n_blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.proj(x))


def _train(model: Callable[..., Any], params: list[torch.Tensor], xs: list[torch.Tensor]) -> dict[str, Any]:
    opt = torch.optim.SGD(params, lr=0.1)
    out: dict[str, Any] = {"outputs": [], "grads": [], "logs": [], "collectives": []}
    for x in xs:
        opt.zero_grad()
        with recording() as log, CollectiveLog() as issued:
            y = model(x)
            (y * y).mean().backward()
        out["outputs"].append(y.detach().clone())
        out["grads"].append([p.grad.clone() for p in params])
        out["logs"].append(log)
        out["collectives"].append(issued.entries)
        opt.step()
    out["params"] = [p.detach().clone() for p in params]
    return out


def scenario_tensor_parallel(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(1)
    xs = [torch.randn(3, 8) for _ in range(3)]  # the same batches on both ranks, as tensor parallelism has
    eager_model, compiled_model = ParallelStack(rank, world), ParallelStack(rank, world)
    eager = _train(eager_model, list(eager_model.parameters()), xs)
    compiled = efx.compile(compiled_model)
    got = _train(compiled, list(compiled_model.parameters()), xs)
    region = efx.explain(compiled).regions["ParallelBlock.forward"]
    exact = {key: all(torch.equal(a, b) for a, b in zip(_flat(eager[key]), _flat(got[key]), strict=True))
             for key in ("outputs", "grads", "params")}
    return {"exact": exact, "logs": (eager["logs"], got["logs"]),
            "collectives": (eager["collectives"], got["collectives"]),
            "bodies": len(region.bodies), "calls": region.calls,
            "forward_effects": region.forward_effects, "backward_effects": region.backward_effects,
            "compiles": compiled.stats.compiles, "out0": eager["outputs"][0]}


def _flat(values: list[Any]) -> list[torch.Tensor]:
    return [t for v in values for t in (v if isinstance(v, list) else [v])]


# -- the token structure (golden) -------------------------------------------------------------------------
@efx.region
def reduced_block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch.ops.efxtest.record_memory("block")
    y = x @ w
    dist.all_reduce(y)
    return y.relu()


def golden_program(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = reduced_block(reduced_block(x, w), w)
    return funcol.all_reduce(y, "sum", dist.group.WORLD) + 1


def scenario_golden(rank: int, world: int) -> tuple[tuple[str, ...], str]:
    prog = efx.capture(golden_program, torch.ones(2, 4), torch.ones(4, 4))
    return prog.token_keys, prog.code()


# -- every form, at the root and in regions, c10d and functional collectives ----------------------------------
@efx.region
def gathers(x: torch.Tensor) -> torch.Tensor:
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x * 2)
    out = torch.empty(x.shape[0] * dist.get_world_size(), *x.shape[1:])
    dist.all_gather_into_tensor(out, x)
    torch.ops.efxtest.log_tensor(out, "gathered")
    return torch.cat(pieces) + out


def many_collectives(x: torch.Tensor) -> torch.Tensor:
    y = x * (dist.get_rank() + 1)
    dist.broadcast(y, src=1)
    dist.all_reduce(y, op=dist.ReduceOp.MAX)
    z = funcol.all_gather_tensor(y, 0, dist.group.WORLD)
    z = funcol.reduce_scatter_tensor(z * 3, "sum", 0, dist.group.WORLD)
    out = torch.empty(x.shape[0], *x.shape[1:])
    dist.reduce_scatter_tensor(out, gathers(z))
    dist.barrier()
    return out + funcol.all_reduce(z, "sum", dist.group.WORLD).sin()


def writes_its_argument(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch.ops.efxtest.log_tensor(x, "before")
    dist.all_reduce(x)  # the caller's tensor is reduced in place, as in eager
    torch.ops.efxtest.log_tensor(x, "after")
    return x @ w


def scenario_forms(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    x = torch.randn(2, 3, requires_grad=True)
    with CollectiveLog() as issued:
        check_against_eager(many_collectives, x)
        check_mutations_against_eager(writes_its_argument, fresh_args((torch.randn(2, 3) + rank,
                                                                       torch.randn(3, 3, requires_grad=True))))
    keys = efx.capture(many_collectives, x).forward.token_keys
    return {"keys": keys, "issued": len(issued.entries)}


# -- DDP: refused when compiled; a compiled function inside DDP trains as eager DDP -------------------------
class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.efxtest.record_memory("inner")
        return self.lin(x).tanh()


class CallsCompiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.compiled = efx.compile(self.inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.compiled(x)


def scenario_ddp(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(rank)
    xs = [torch.randn(3, 4) for _ in range(3)]  # each rank its own batch: DDP averages the gradients
    refused = []
    ddp = DDP(Inner())
    for call in (lambda: efx.compile(ddp)(xs[0]), lambda: efx.compile(lambda x: ddp(x) * 2)(xs[0])):
        try:
            call()
            refused.append(None)
        except efx.CaptureError as exc:
            refused.append((type(exc).__name__, str(exc)))
    eager_ddp, wrapped = DDP(Inner()), DDP(CallsCompiled())
    eager = _train(eager_ddp, list(eager_ddp.parameters()), xs)
    got = _train(wrapped, list(wrapped.parameters()), xs)
    after_refusal = _train(ddp, list(ddp.parameters()), xs)  # the refused DDP still trains as eager
    # the order PyTorch's docs recommend for torch.compile: DDP around the compiled module
    around = DDP(efx.compile(Inner()))
    compiled = _train(around, list(around.parameters()), xs)
    exact = all(torch.equal(a, b) for a, b in zip(_flat(eager["grads"] + eager["params"]),
                                                 _flat(got["grads"] + got["params"]), strict=True))
    exact_around = all(torch.equal(a, b) for a, b in zip(_flat(eager["grads"] + eager["params"]),
                                                        _flat(compiled["grads"] + compiled["params"]),
                                                        strict=True))
    same = all(torch.equal(a, b) for a, b in zip(_flat(eager["params"]), after_refusal["params"], strict=True))
    return {"refused": refused, "exact": exact, "logs_equal": eager["logs"] == got["logs"],
            "after_refusal": same, "params": eager["params"], "exact_around": exact_around,
            "logs_around": compiled["logs"] == eager["logs"] and compiled["collectives"] == eager["collectives"]}


# -- FSDP2: refused at capture, before its hooks run -----------------------------------------------------------
def scenario_fsdp(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    x = torch.randn(2, 4)
    try:
        efx.compile(model)(x)
        refused = None
    except efx.CaptureError as exc:
        refused = (type(exc).__name__, str(exc))
    model(x).sum().backward()  # eager FSDP2 still works after the refusal
    return {"refused": refused, "grads": all(p.grad is not None for p in model.parameters())}


# -- FSDP2 around blocks whose inner module is compiled: exact ---------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        torch.manual_seed(1)
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inner(x))


def scenario_fsdp_inner(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(rank)
    xs = [torch.randn(3, 4) for _ in range(3)]
    runs = []
    for compiled in (False, True):
        model = nn.Sequential(Block(), Block())
        if compiled:
            for block in model:
                block.inner = efx.compile(block.inner)  # a child module: FSDP2 shards it with its block
        for block in model:
            fully_shard(block)
        fully_shard(model)
        out = _train(model, list(model.parameters()), xs)
        out["params"] = [p.full_tensor() for p in model.parameters()]
        runs.append(out)
    eager, got = runs
    return {"logs": eager["logs"] == got["logs"],
            "exact": all(torch.equal(a, b) for a, b in zip(_flat(eager["outputs"] + eager["params"]),
                                                           _flat(got["outputs"] + got["params"]), strict=True))}


# -- two process groups: two keys, and a body per group ----------------------------------------------------
class GroupBlock(nn.Module):
    def __init__(self, group: Any) -> None:
        super().__init__()
        self.group = group
        self.lin = nn.Linear(4, 4)

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        dist.all_reduce(y, group=self.group)
        return y


def scenario_groups(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    other = dist.new_group(list(range(world)))
    model = nn.Sequential(GroupBlock(dist.group.WORLD), GroupBlock(other), GroupBlock(dist.group.WORLD))
    x = torch.randn(2, 4, requires_grad=True)
    check_against_eager(model, x)
    prog = efx.capture(model, x).forward
    return {"keys": prog.token_keys, "bodies": len(prog.regions), "other": other.group_name}


# -- refusals: saving a program with a group, a collective effectfx does not record -----------------------------
def reduces_to_rank_zero(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    dist.reduce(y, dst=0)  # <- reduce
    return y


def scenario_refusals(rank: int, world: int) -> dict[str, Any]:
    import tempfile

    found = {}
    try:
        efx.capture(reduces_to_rank_zero, torch.ones(3))
    except efx.CaptureError as exc:
        found["reduce"] = (type(exc).__name__, str(exc))
    prog = efx.remove_effect_tokens(efx.capture(golden_program, torch.ones(2, 4), torch.ones(4, 4)))
    try:
        with tempfile.TemporaryDirectory() as d:
            prog.save(f"{d}/p.zip")
    except efx.EffectfxError as exc:
        found["save"] = (type(exc).__name__, str(exc))
    return found


def run(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    found = {}
    for name in names:
        try:
            found[name] = ("ok", globals()[f"scenario_{name}"](rank, world))
        except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
            found[name] = ("error", traceback.format_exc())
        dist.barrier()  # a failed scenario must not leave the other rank inside a collective of the next
    return found


SCENARIOS = ["tensor_parallel", "golden", "forms", "ddp", "fsdp", "fsdp_inner", "groups", "refusals"]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(run, SCENARIOS, timeout=150)


def result(ranks: list[dict[str, Any]], name: str) -> list[Any]:
    out = []
    for rank, found in enumerate(ranks):
        status, value = found[name]
        if status != "ok":
            pytest.fail(f"rank {rank}, scenario {name}:\n{value}")
        out.append(value)
    return out


def test_tensor_parallel_training_matches_eager_on_each_rank(ranks) -> None:
    results = result(ranks, "tensor_parallel")
    for r in results:
        assert r["exact"] == {"outputs": True, "grads": True, "params": True}
        eager_logs, got_logs = r["logs"]
        assert got_logs == eager_logs and len(eager_logs) == 3
        assert [e[1] for e in eager_logs[0] if e[0] == "record_memory"] == [f"block{i}" for i in range(4)]
        eager_coll, got_coll = r["collectives"]
        # per step: 4 forward all-reduces, then 4 in backward, each with eager's input
        assert got_coll == eager_coll and [len(c) for c in eager_coll] == [8, 8, 8]
        assert {c[:2] for step in eager_coll for c in step} == {("all_reduce", "0")}
        assert r["bodies"] == 1 and r["calls"] == 4 and r["compiles"] == 1
        assert r["forward_effects"] == ("c10d:0", "memory", "stdout")
        assert r["backward_effects"] == ("c10d:0",)
    # the all-reduce makes the ranks agree
    assert torch.equal(results[0]["out0"], results[1]["out0"])


GOLDEN = '''
def forward(self, token_c10d_0, token_memory, x, w):
    reduced_block_subgraph0 = self.reduced_block_subgraph0
    invoke_subgraph = effectfx.ops.invoke_subgraph(reduced_block_subgraph0, 'subgraph_0', token_c10d_0, token_memory, x, w)
    getitem = invoke_subgraph[0]
    getitem_1 = invoke_subgraph[1]
    getitem_2 = invoke_subgraph[2]
    invoke_subgraph_1 = effectfx.ops.invoke_subgraph(reduced_block_subgraph0, 'subgraph_0', getitem, getitem_1, getitem_2, w)
    getitem_3 = invoke_subgraph_1[0]
    getitem_4 = invoke_subgraph_1[1]
    getitem_5 = invoke_subgraph_1[2]
    _torchbind_obj0 = self._torchbind_obj0
    with_effects = effectfx.ops.with_effects(getitem_3, torch.ops.effectfx_c10d.all_reduce_group0.default, _torchbind_obj0, getitem_5, 'sum')
    getitem_6 = with_effects[0]
    getitem_7 = with_effects[1]
    add = torch.ops.aten.add.Tensor(getitem_7, 1)
    return (getitem_6, getitem_4, add)

# reduced_block_subgraph0: 'subgraph_0'
def reduced_block_subgraph0(self, token_c10d_0, token_memory, x, w):
    with_effects = effectfx.ops.with_effects(token_memory, torch.ops.efxtest.record_memory.default, 'block')
    getitem = with_effects[0]
    mm = torch.ops.aten.mm.default(x, w)
    _torchbind_obj0 = self._torchbind_obj0
    with_effects_1 = effectfx.ops.with_effects(token_c10d_0, torch.ops.effectfx_c10d.all_reduce_group0.default, _torchbind_obj0, mm, 'sum')
    getitem_1 = with_effects_1[0]
    getitem_2 = with_effects_1[1]
    relu = torch.ops.aten.relu.default(getitem_2)
    return (getitem_1, getitem, relu)
'''


def test_golden_token_structure(ranks) -> None:
    # one chain per key (c10d:0 for the group, memory): the region threads both, the functional collective
    # at the root continues the group's chain; the group is a program constant (_torchbind_obj0)
    for keys, code in result(ranks, "golden"):
        assert keys == ("c10d:0", "memory")
        assert code.strip() == textwrap.dedent(GOLDEN).strip(), code


def test_every_form_and_the_caller_s_tensor(ranks) -> None:
    for r in result(ranks, "forms"):
        assert r["keys"] == ("c10d:0", "stdout")
        assert r["issued"] > 0


def test_ddp_is_refused_and_a_compiled_function_inside_ddp_is_exact(ranks) -> None:
    results = result(ranks, "ddp")
    for r in results:
        for refused in r["refused"]:
            assert refused is not None and refused[0] == "UnsupportedParallelWrapperError"
            assert "DistributedDataParallel" in refused[1] and "test_distributed.py:" in refused[1]
            assert "inner module" in refused[1]
        assert r["exact"] and r["logs_equal"] and r["after_refusal"]
        assert r["exact_around"] and r["logs_around"]  # DDP(efx.compile(model)): bitwise eager DDP
    # DDP averaged the gradients: both ranks hold the same parameters
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


def test_fsdp2_is_refused_by_name(ranks) -> None:
    for r in result(ranks, "fsdp"):
        assert r["refused"] is not None and r["refused"][0] == "UnsupportedParallelWrapperError"
        assert "fully_shard" in r["refused"][1] and "test_distributed.py:" in r["refused"][1]
        assert r["grads"]


def test_fsdp2_around_compiled_inner_modules_is_exact(ranks) -> None:
    for r in result(ranks, "fsdp_inner"):
        assert r["logs"] and r["exact"]  # outputs and (full) parameters bitwise eager FSDP2's, each step


def test_two_groups_two_keys(ranks) -> None:
    for r in result(ranks, "groups"):
        assert r["keys"] == ("c10d:0", f"c10d:{r['other']}")
        assert r["bodies"] == 2  # the group is part of what a body bakes in: one body per group


def test_refusals_name_the_op_and_the_line(ranks) -> None:
    for r in result(ranks, "refusals"):
        kind, message = r["reduce"]
        assert kind == "UnsupportedOperatorError" and "c10d.reduce_" in message
        assert re.search(r"test_distributed.py:\d+ \(in reduces_to_rank_zero\)", message)
        kind, message = r["save"]
        assert kind == "SerializationError" and "ProcessGroup" in message
