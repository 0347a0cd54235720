"""Collectives as ordered effects, on 2 processes (gloo, 127.0.0.1): issue 13 items 4-5.

Every scenario runs once on both ranks, in one pair of spawned processes (a module fixture: torch's import
and the first capture are paid once), and returns plain data; the tests below check it.  A rank's
scenario compares effectfx with that rank's own eager run: outputs, gradients, the effect log and the
collectives it issued (``CollectiveLog``).  A hang fails the run after a timeout instead of blocking.
"""

# ruff: noqa: E501  (golden graph text has long lines)
from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import effectfx as efx
from effectfx.testing import recording
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


def run(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    found = {}
    for name in names:
        try:
            found[name] = ("ok", globals()[f"scenario_{name}"](rank, world))
        except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
            found[name] = ("error", traceback.format_exc())
        dist.barrier()  # a failed scenario must not leave the other rank inside a collective of the next
    return found


SCENARIOS = ["tensor_parallel"]


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
