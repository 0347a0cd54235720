"""Prints and logs on separate effect keys, captured and run in eager order.

``aten::_print`` is an effect PyTorch itself marks ordered (key "ordered"); ``efxex::log_value`` is a custom
logging op registered on its own key, "log".  effectfx threads one token chain per key, so each chain keeps
its own order (and a backend may overlap the two); the default runtime runs nodes in capture order, so
the combined transcript equals eager's.

Run it: ``python examples/print_and_log.py`` (a few seconds on a CPU).  Draw it:
``effectfx show examples/print_and_log.py:fn --html fn.html``.  Exit status 0 when effectfx's
transcript equals eager's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

import torch

import effectfx as efx

LOG: list[str] = []


@torch.library.custom_op("efxex::log_value", mutates_args=())
def log_value(x: torch.Tensor, tag: str) -> None:
    line = f"[log] {tag}: sum={float(x.sum()):.4f}"
    LOG.append(line)
    print(line, flush=True)


@log_value.register_fake
def _(x: torch.Tensor, tag: str) -> None:
    return None


efx.register_effect(log_value, key="log")


@efx.region
def layer(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch.ops.aten._print("[print] layer: start")
    torch.ops.efxex.log_value(x, "layer input")
    y = torch.tanh(x @ w)
    torch.ops.efxex.log_value(y, "layer output")
    torch.ops.aten._print("[print] layer: end")
    return y


def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch.ops.aten._print("[print] fn: begin")
    y = layer(layer(x, w), w)
    torch.ops.efxex.log_value(y, "result")
    torch.ops.aten._print("[print] fn: done")
    return y.sum()


# example inputs for `effectfx show examples/print_and_log.py:fn [--form ...] [--html fn.html]`
EXAMPLE_INPUTS = {"fn": lambda: (torch.randn(3, 4), torch.randn(4, 4) * 0.5)}


@contextlib.contextmanager
def transcript() -> Iterator[list[str]]:
    """Collect everything written to file descriptor 1 (Python's prints and C++'s ``aten::_print``)."""
    lines: list[str] = []
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield lines
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            lines.extend(tmp.read().decode().splitlines())


def main() -> int:
    torch.manual_seed(0)
    x, w = torch.randn(3, 4), torch.randn(4, 4) * 0.5

    prog = efx.capture(fn, x, w)
    print("# the functionalized program: one token chain per key ('log' and 'ordered')")
    print(prog)
    print(f"\nregion effects: { {k: sorted(v) for k, v in prog.region_effects.items()} }")

    with transcript() as eager:
        expected = fn(x, w)
    with transcript() as captured:
        got = prog(x, w)
    compiled_fn = efx.compile(fn)
    with transcript() as compiled:
        got_compiled = compiled_fn(x, w)

    width = max(len(line) for line in [*eager, "eager"])
    print(f"\n{'eager':<{width}}   effectfx (captured program)")
    for a, b in zip(eager, captured):
        print(f"{a:<{width}}   {b}")
    same = eager == captured == compiled
    same_out = torch.equal(expected, got) and torch.equal(expected, got_compiled)
    n_print = sum(line.startswith("[print]") for line in eager)
    n_log = sum(line.startswith("[log]") for line in eager)
    print(f"\n{n_print} prints (key 'ordered') and {n_log} logs (key 'log'); transcripts identical "
          f"(capture and efx.compile): {same}; outputs equal: {same_out}")
    return 0 if same and same_out else 1


if __name__ == "__main__":
    raise SystemExit(main())
