"""Tensor parallelism under effectfx: 2 processes, each holding half of every block, an all-reduce per block.

Each block is Megatron-style: a column-parallel ``up`` projection (each rank a slice of the hidden units),
a row-parallel ``down`` projection whose partial sums are all-reduced in forward ("g"), and the gradient of
the block's input all-reduced in backward ("f").  ``dist.all_reduce`` becomes an ordered effect on the key
``c10d:0`` (one token chain per process group), beside the block's own logging effect on ``log``; the four
blocks share one region body.  Every rank trains 3 steps in eager and 3 through ``efx.compile`` and
compares losses, gradients, its effect log and the collectives it issued.

Run it: ``python examples/tensor_parallel.py`` (two gloo processes on 127.0.0.1, about 20 s on a CPU).
Exit status 0 when every rank matches its own eager run exactly.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import effectfx as efx
from effectfx.testing.distributed import CollectiveLog, run_ranks

LOG: list[tuple[str, int]] = []


@torch.library.custom_op("tpex::log_block", mutates_args=())
def log_block(name: str, rank: int) -> None:
    LOG.append((name, rank))


log_block.register_fake(lambda name, rank: None)
efx.register_effect(log_block, key="log")


class CopyToParallel(torch.autograd.Function):  # "f": identity forward, all-reduce the gradient
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):  # "g": all-reduce the partial sums, identity backward
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Block(nn.Module):
    def __init__(self, name: str, d: int, hidden: int) -> None:
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        self.name, self.rank = name, rank
        full_up, full_down = nn.Linear(d, hidden), nn.Linear(hidden, d, bias=False)  # same on every rank
        part = slice(rank * hidden // world, (rank + 1) * hidden // world)
        self.up, self.down = nn.Linear(d, hidden // world), nn.Linear(hidden // world, d, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(full_up.weight[part])
            self.up.bias.copy_(full_up.bias[part])
            self.down.weight.copy_(full_down.weight[:, part])

    @efx.region
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.ops.tpex.log_block(self.name, self.rank)
        h = torch.relu(self.up(CopyToParallel.apply(x)))
        return x + ReduceFromParallel.apply(self.down(h))


class Model(nn.Module):
    def __init__(self, n_blocks: int = 4, d: int = 16, hidden: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(d, d)
        self.blocks = nn.Sequential(*[Block(f"block{i}", d, hidden) for i in range(n_blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(x))


def train(model: nn.Module, call: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, list]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run: dict[str, list] = {"losses": [], "grads": [], "logs": [], "collectives": []}
    for x, target in batches:
        opt.zero_grad()
        del LOG[:]
        with CollectiveLog() as issued:
            loss = ((call(x) - target) ** 2).mean()
            loss.backward()
        run["losses"].append(loss.item())
        run["grads"].append([p.grad.clone() for p in model.parameters()])
        run["logs"].append(list(LOG))
        run["collectives"].append(issued.entries)
        opt.step()
    return run


def rank_main(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(1)
    target = torch.randn(4, 16)
    batches = [(torch.randn(4, 16), target) for _ in range(3)]  # every rank sees the same batch
    eager_model, compiled_model = Model(), Model()
    eager = train(eager_model, eager_model, batches)
    compiled = efx.compile(compiled_model)
    got = train(compiled_model, compiled, batches)
    region = efx.explain(compiled).regions["Block.forward"]
    # the functionalized form shows the tokens (efx.compile runs the token-free one); capture runs nothing
    body = efx.capture(compiled_model, batches[0][0]).forward.code().split("\n# Block_forward")[1]
    return {
        "losses": (eager["losses"], got["losses"]),
        "grads_equal": all(torch.equal(a, b) for step_e, step_g in zip(eager["grads"], got["grads"])
                           for a, b in zip(step_e, step_g)),
        "logs_equal": eager["logs"] == got["logs"], "n_effects": sum(len(s) for s in eager["logs"]),
        "collectives_equal": eager["collectives"] == got["collectives"],
        "n_collectives": sum(len(s) for s in eager["collectives"]),
        "bodies": len(region.bodies), "calls": region.calls,
        "keys": (region.forward_effects, region.backward_effects),
        "body": body.split("\n", 1)[-1] if rank == 0 else "",
    }


def main() -> int:
    results = run_ranks(rank_main, world_size=2, timeout=300)
    print("the block's region body (rank 0; forward), all-reduce on token chain c10d:0:")
    print(results[0]["body"].strip().replace("\n\n", "\n"))
    print()
    ok = True
    for rank, r in enumerate(results):
        eager_losses, got_losses = r["losses"]
        same = eager_losses == got_losses and r["grads_equal"] and r["logs_equal"] and r["collectives_equal"]
        ok &= same
        print(f"rank {rank}: losses eager {[round(v, 5) for v in eager_losses]}")
        print(f"        effectfx {[round(v, 5) for v in got_losses]}  equal: {eager_losses == got_losses}")
        print(f"        gradients equal: {r['grads_equal']}; effect log identical: {r['logs_equal']} "
              f"({r['n_effects']} effects); collectives identical: {r['collectives_equal']} "
              f"({r['n_collectives']} all-reduces over 3 steps)")
        print(f"        region Block.forward: {r['bodies']} body, {r['calls']} calls; forward effects "
              f"{list(r['keys'][0])}, backward effects {list(r['keys'][1])}")
    print(f"\nevery rank matches its eager run: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
