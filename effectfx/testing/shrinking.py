"""Minimizing a generated program that fails: a greedy, deletion-based shrinker over the
description (``effectfx.testing.program``), most drastic candidates first -- a whole region, a statement, a
simpler call shape, a return, an input's ``requires_grad``, an input, a parameter, a constant, the blocks,
a hook, a simpler hook.  Whether a candidate still fails is the caller's (``checking.fails_like``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

from .module_hooks import HookSpec
from .program import CALL_KINDS, Body, ProgramSpec, Stmt
from .render import render


def _delete_stmt(body: Body, index: int) -> Body:
    """``body`` without statement ``index``; later reads of its outputs read its first argument."""
    gone = body.stmts[index]
    fallback = gone.args[0] if gone.args else body.params[0]
    names = {out: fallback for out in gone.outs}
    stmts = tuple(s.renamed(names) for s in body.stmts[:index] + body.stmts[index + 1:])
    # in-place statements re-read nothing else; returns follow the renaming too
    return Body(body.params, stmts, tuple(names.get(r, r) for r in body.returns))


def _map_bodies(spec: ProgramSpec, fn: Callable[[Body], Body]) -> ProgramSpec:
    return dataclasses.replace(
        spec, forward=fn(spec.forward),
        regions=tuple(dataclasses.replace(r, body=fn(r.body)) for r in spec.regions),
        block_body=fn(spec.block_body) if spec.block_body is not None else None,
    )


def _without_calls(body: Body, pred: Callable[[Stmt], bool]) -> Body:
    while True:
        index = next((i for i, s in enumerate(body.stmts) if pred(s)), None)
        if index is None:
            return body
        body = _delete_stmt(body, index)


def _replace_body(spec: ProgramSpec, where: str, body: Body) -> ProgramSpec:
    if where == "forward":
        return dataclasses.replace(spec, forward=body)
    if where == "step":
        return dataclasses.replace(spec, block_body=body)
    return dataclasses.replace(spec, regions=tuple(
        dataclasses.replace(r, body=body) if r.name == where else r for r in spec.regions))


def _drop_input(spec: ProgramSpec, i: int, instead: int) -> ProgramSpec:
    """``spec`` without input ``x<i>``: reads of it read ``x<instead>``, later inputs move down."""
    names = {f"x{i}": f"x{instead - (instead > i)}"}
    names.update({f"x{k}": f"x{k - 1}" for k in range(i + 1, len(spec.inputs))})
    forward = spec.forward
    stmts = tuple(s.renamed(names) for s in forward.stmts)
    returns = tuple(names.get(r, r) for r in forward.returns)
    return dataclasses.replace(spec, inputs=spec.inputs[:i] + spec.inputs[i + 1:],
                               forward=Body(forward.params[:-1], stmts, returns))


def _simpler_calls(s: Stmt) -> list[Stmt]:
    simpler = []
    if s.kind == "loop" and s.value > 1:
        simpler.append(dataclasses.replace(s, value=s.value - 1))
    if s.kind in ("chain", "loop", "nograd"):
        simpler.append(dataclasses.replace(s, kind="call"))
    if s.s is not None:
        simpler.append(dataclasses.replace(s, s=None))
    return simpler


def _candidates(spec: ProgramSpec) -> Iterator[ProgramSpec]:
    """Simpler variants of ``spec``, the most drastic first."""
    for r in spec.regions:  # drop a whole region (and its calls)
        without = _map_bodies(spec, lambda b, n=r.name: _without_calls(b, lambda s: s.op == n
                                                                        and s.kind in CALL_KINDS))
        yield dataclasses.replace(without, regions=tuple(x for x in without.regions if x.name != r.name))
    for where, body in list(spec.bodies()):
        for i in reversed(range(len(body.stmts))):  # drop one statement
            yield _replace_body(spec, where, _delete_stmt(body, i))
        for i, s in enumerate(body.stmts):  # simpler call shapes
            for new in _simpler_calls(s):
                stmts = body.stmts[:i] + (new,) + body.stmts[i + 1:]
                yield _replace_body(spec, where, dataclasses.replace(body, stmts=stmts))
        if len(body.returns) > 1 and where == "forward":
            for i in range(len(body.returns)):
                yield _replace_body(spec, where, dataclasses.replace(
                    body, returns=body.returns[:i] + body.returns[i + 1:]))
    for i, rg in enumerate(spec.inputs):
        if rg:
            yield dataclasses.replace(spec, inputs=spec.inputs[:i] + (False,) + spec.inputs[i + 1:])
    for i in range(len(spec.inputs)):  # drop an input; reads of it read another input
        for j in range(len(spec.inputs)):
            if j != i:
                yield _drop_input(spec, i, j)
    for i, rg in enumerate(spec.weights):
        if rg:
            yield dataclasses.replace(spec, weights=spec.weights[:i] + (False,) + spec.weights[i + 1:])
    if spec.weights:  # drop the last parameter and the matmuls reading it
        last = f"w{len(spec.weights) - 1}"
        without = _map_bodies(spec, lambda b: _without_calls(b, lambda s: s.weight == last))
        yield dataclasses.replace(without, weights=spec.weights[:-1])
    if spec.constants:
        last = f"C{spec.constants - 1}"
        without = _map_bodies(spec, lambda b: _without_calls(b, lambda s: s.weight == last))
        yield dataclasses.replace(without, constants=spec.constants - 1)
    yield from _hook_candidates(spec)
    if spec.blocks:  # drop the sub-modules, or the last one, or a requires_grad
        without = _map_bodies(spec, lambda b: _without_calls(b, lambda s: s.kind == "blocks"))
        yield dataclasses.replace(without, blocks=(), block_body=None, hooks=_on_blocks(spec, 0))
        if len(spec.blocks) > 1:
            yield dataclasses.replace(spec, blocks=spec.blocks[:-1],
                                      hooks=_on_blocks(spec, len(spec.blocks) - 1))
        for i, rg in enumerate(spec.blocks):
            if rg:
                yield dataclasses.replace(spec, blocks=spec.blocks[:i] + (False,) + spec.blocks[i + 1:])
    if spec.batch > 2:
        yield dataclasses.replace(spec, batch=2)


def _on_blocks(spec: ProgramSpec, n: int) -> tuple[HookSpec, ...]:
    """The hooks of ``spec`` when only its first ``n`` blocks are left."""
    hooks = (dataclasses.replace(h, layers=tuple(i for i in h.layers if i < n)) for h in spec.hooks)
    return tuple(h for h in hooks if h.layers or not h.target.startswith("blocks"))


def _simpler_hooks(h: HookSpec) -> Iterator[HookSpec]:
    if h.removed:
        yield dataclasses.replace(h, removed=0)
    if h.added and h.target != "model":  # (a hook on the program module is only ever added late)
        yield dataclasses.replace(h, added=0, removed=0)
    if h.s is not None and h.effect:  # only one of what it does
        yield dataclasses.replace(h, s=None)
        yield dataclasses.replace(h, effect="")
    if len(h.layers) > 1:
        yield dataclasses.replace(h, layers=h.layers[:1])
    if h.sharing != "own":
        yield dataclasses.replace(h, sharing="own")


def _hook_candidates(spec: ProgramSpec) -> Iterator[ProgramSpec]:
    for i, h in enumerate(spec.hooks):  # drop a hook, or make it simpler
        yield dataclasses.replace(spec, hooks=spec.hooks[:i] + spec.hooks[i + 1:])
        for new in _simpler_hooks(h):
            yield dataclasses.replace(spec, hooks=spec.hooks[:i] + (new,) + spec.hooks[i + 1:])


def shrink(spec: ProgramSpec, still_fails: Callable[[ProgramSpec], bool], budget_seconds: float = 120.0,
           max_tries: int = 400) -> ProgramSpec:
    """Greedy deletion-based minimization: keep taking the first simpler variant that still fails."""
    deadline = time.monotonic() + budget_seconds
    tries = 0
    improved = True
    seen: set[str] = set()
    while improved and time.monotonic() < deadline and tries < max_tries:
        improved = False
        for candidate in _candidates(spec):
            if time.monotonic() >= deadline or tries >= max_tries:
                break
            src = render(candidate)
            if src in seen:
                continue
            seen.add(src)
            tries += 1
            try:
                failing = still_fails(candidate)
            except Exception:
                failing = False
            if failing:
                spec, improved = candidate, True
                break
    return spec


__all__ = ["shrink"]
