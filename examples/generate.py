"""Greedy generation with ``efx.compile(model).generate``: a small GPT-2 (random weights from a config) whose
every layer records its memory before it runs, generated with transformers' default ``DynamicCache`` and
with a ``StaticCache``, beside eager.

The layers are ``examples/gpt2_memory.py``'s ``MemoryRecorded`` regions: the layer's name is an operand of
the effect.  With a cache, each layer's attention reads ``self.layer_idx`` to pick its cache layer -- a
number, so part of the body's identity -- and each layer gets a body of its own, traced once and reused by
every generated token.  The cache is a container of tensors (Note [Mutations]): grown by ``torch.cat``
(``DynamicCache``) or updated in place (``StaticCache``), it ends as eager's.  The token grows the cache
by one each step: after the first decode step the cache's length is a symbol (Note [Symbolic shapes]), so a
whole generation takes three captures (``DynamicCache``) or two (``StaticCache``).

Run it from the repository root: ``python examples/generate.py`` (under a minute on a CPU; needs
``transformers``, a test dependency).  Nothing is downloaded.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt2_memory import LOG, build  # noqa: E402

import effectfx as efx  # noqa: E402

TOKENS = 16


def generate(model: torch.nn.Module, ids: torch.Tensor, **options: object
             ) -> tuple[torch.Tensor, list, float]:
    LOG.clear()
    start = time.perf_counter()
    tokens = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, pad_token_id=0, use_cache=True,
                            **options)
    seconds = time.perf_counter() - start
    log = list(LOG)
    LOG.clear()
    return tokens, log, seconds


def main() -> int:
    eager = build().eval()
    ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    ok = True
    print(f"GPT-2 (4 layers, random weights), greedy generation of {TOKENS} tokens\n")
    for name, options in (("DynamicCache", {}), ("StaticCache", {"cache_implementation": "static"})):
        compiled = efx.compile(copy.deepcopy(eager))
        expected, eager_log, eager_s = generate(eager, ids, **options)
        tokens, log, seconds = generate(compiled, ids, **options)
        same = torch.equal(tokens, expected) and log == eager_log
        ok &= same
        bodies = sorted({b.identifier for p in compiled.programs() for b in p.bodies})
        print(f"{name}: tokens identical to eager: {torch.equal(tokens, expected)}; effect log identical: "
              f"{log == eager_log} ({len(log)} records); {compiled.stats.compiles} captures; "
              f"{len(bodies)} bodies; {seconds:.2f} s (eager {eager_s:.2f} s)")
    print(f"\nfirst records: {eager_log[:2]}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
