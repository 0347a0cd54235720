"""Random programs for differential fuzzing against eager PyTorch (issue 5): the hypothesis strategies.

:func:`programs` draws a :class:`~effectfx.testing.program.ProgramSpec`: elementwise ops, reductions
broadcast back (``a - a.mean(-1, keepdim=True)``), matmuls with module parameters or constants, in-place
updates of fresh intermediates, ``detach``, effect ops on the program's 1-3 keys (``efxtest::record_*``,
``log_tensor``, ``bump``), ``efxtest::scale`` (an effect in backward only), ``efxfuzz::ping`` (never
registered, returns nothing), ``efxfuzz::logged`` (CompositeImplicitAutograd kernel), Python ``print``,
and region calls: once, repeatedly, chained ``r(r(a))``, in a ``for`` loop, under ``torch.no_grad()``, or
with the result unused; regions may take a number ``s`` and a list ``xs`` of tensors they read (and,
rarely, change: such a program must be refused).  Region ``i`` may only call regions ``j > i`` and nesting
is at most :data:`~effectfx.testing.program.MAX_DEPTH` deep, so there is no recursion.

The description and its source are ``effectfx.testing.program``; running and minimizing are
``effectfx.testing.checking``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from .effect_ops import EFFECT_KEYS
from .program import (
    BINARY,
    CALL_KINDS,
    CHANGES,
    EFFECT_OPS,
    ITEMS,
    MATMUL,
    MAX_DEPTH,
    PRINTS,
    REDUCE,
    REGION_STYLES,
    TENSOR_EFFECTS,
    UNARY,
    Body,
    ProgramSpec,
    RegionSpec,
    Stmt,
)


@dataclass
class _Context:
    name: str  # "forward" or a region name: labels effects
    module_ref: str | None
    matrices: list[str]
    callees: list[RegionSpec]
    effect_ops: list[tuple[str, str, bool]]
    blocks: bool = False  # "blocks" statements may run the sub-modules
    scalar: bool = False  # the body has a number parameter ``s``
    list_len: int = 0  # the body has a list parameter ``xs`` of this many tensors
    changes: bool = False  # the body changes ``xs`` (the program must be refused)


_DATA_KINDS = ("unary", "binary", "reduce", "matmul", "inplace", "detach", "scalar")


def _data_stmt(draw: Any, kind: str, ctx: _Context, a: str, names: list[str], out: str) -> Stmt:
    if kind == "unary":
        return Stmt(kind, draw(st.sampled_from(sorted(UNARY))), (a,), (out,))
    if kind == "binary":
        return Stmt(kind, draw(st.sampled_from(sorted(BINARY))), (a, draw(st.sampled_from(names))), (out,))
    if kind == "reduce":
        return Stmt(kind, draw(st.sampled_from(sorted(REDUCE))), (a,), (out,))
    if kind == "matmul":
        return Stmt(kind, draw(st.sampled_from(sorted(MATMUL))), (a,), (out,),
                    weight=draw(st.sampled_from(ctx.matrices)))
    if kind == "inplace":
        return Stmt(kind, draw(st.sampled_from(["mul", "add"])), (a,), (out,),
                    value=draw(st.sampled_from([0.5, 2.0, -1.0])))
    if kind == "scalar":
        return Stmt(kind, "times_s", (a,), (out,))
    return Stmt(kind, "detach", (a,), (out,))


def _call_stmt(draw: Any, kind: str, ctx: _Context, a: str, names: list[str], fresh: Any,
               exclude: frozenset[str]) -> Stmt:
    eligible: list[RegionSpec] = []
    if kind in ("chain", "loop"):
        eligible = [r for r in ctx.callees if len(r.body.params) == 1 and len(r.body.returns) == 1]
        if not eligible:
            kind = "call" if "call" not in exclude else "unused"
    callee = draw(st.sampled_from(eligible if kind in ("chain", "loop") else ctx.callees))
    args = tuple([a] + [draw(st.sampled_from(names)) for _ in callee.body.params[1:]])
    items = tuple(draw(st.sampled_from(names)) for _ in range(callee.list_len))
    if kind == "unused":
        outs: tuple[str, ...] = ()
    elif kind in ("chain", "loop"):
        outs = (next(fresh),)
    else:
        outs = tuple(next(fresh) for _ in callee.body.returns)
    value = float(draw(st.integers(2, 4))) if kind == "loop" else 0.0
    number = draw(st.sampled_from([None, 0.5, 2.0])) if callee.scalar else None
    return Stmt(kind, callee.name, args, outs, value=value, s=number, items=items)


@st.composite
def _body(draw: Any, ctx: _Context, params: tuple[str, ...], max_stmts: int, n_returns: int,
          exclude: frozenset[str]) -> Body:
    names = list(params)
    stmts: list[Stmt] = []
    fresh = (f"v{i}" for i in itertools.count())
    kinds = ["unary", "binary", "reduce", "detach", "inplace", "effect", "effect", "print"]
    if ctx.matrices:
        kinds.append("matmul")
    if ctx.callees:  # about half the statements call a region when there is one to call
        kinds += ["call", "call", "call", "unused", "chain", "chain", "loop", "loop", "nograd"]
    if ctx.blocks:
        kinds += ["blocks", "blocks"]
    if ctx.scalar:
        kinds += ["scalar", "scalar"]
    if ctx.list_len:
        kinds += ["item", "item", "item"]
    kinds = [k for k in kinds if k not in exclude]
    call_kinds = [k for k in CALL_KINDS if k not in exclude]
    effect_ops = [o for o in ctx.effect_ops if o[0] not in exclude] or ctx.effect_ops
    n = draw(st.integers(1, max_stmts))
    for i in range(n):
        # the first statement calls a region whenever there is one to call, so regions are reachable
        kind = draw(st.sampled_from(call_kinds if i == 0 and ctx.callees and call_kinds else kinds))
        a = draw(st.sampled_from(names[::-1]))  # shrinks towards the newest value
        label = f"{ctx.name}.{i}"
        if kind in _DATA_KINDS:
            stmt = _data_stmt(draw, kind, ctx, a, names, next(fresh))
        elif kind == "blocks":
            stmt = Stmt(kind, "blocks", (a,), (next(fresh),))
        elif kind == "item":
            op = draw(st.sampled_from(sorted(ITEMS)))
            j = draw(st.integers(-ctx.list_len, ctx.list_len - 1)) if op == "index" else 0
            stmt = Stmt(kind, op, (), (next(fresh),), value=float(j))
        elif kind == "print":
            stmt = Stmt(kind, draw(st.sampled_from(sorted(PRINTS))), (a,), (), label)
        elif kind == "effect":
            op, _, has_out = draw(st.sampled_from(effect_ops))
            value = draw(st.sampled_from([0.5, 2.0, 3.0])) if op == "scale" else 0.0
            stmt = Stmt(kind, op, (a,) if op in TENSOR_EFFECTS else (), (next(fresh),) if has_out else (),
                        label, value)
        else:
            stmt = _call_stmt(draw, kind, ctx, a, names, fresh, exclude)
        names.extend(stmt.outs)
        stmts.append(stmt)
    if ctx.changes:  # the caller's list would not see this: effectfx refuses the program
        stmts.append(Stmt("change", draw(st.sampled_from(sorted(CHANGES))), (draw(st.sampled_from(names)),)))
    pool = names[len(params):] or names
    returns = tuple(draw(st.sampled_from(pool[::-1])) for _ in range(n_returns))
    return Body(params, tuple(stmts), returns)


@st.composite
def programs(draw: Any, max_regions: int = 4, max_stmts: int = 6,
             exclude: frozenset[str] | tuple[str, ...] = ()) -> ProgramSpec:
    """Hypothesis strategy for :class:`ProgramSpec`.  ``exclude`` names statement kinds (``"nograd"``,
    ``"inplace"``, ``"print"``, ``"list"`` for list arguments, ``"change"`` for changing them, ...) or
    effect ops (``"scale"``, ``"logged"``, ...) that generated programs must not use."""
    exclude = frozenset(exclude)
    keys = tuple(sorted(draw(st.lists(st.sampled_from(EFFECT_KEYS), min_size=1, max_size=3, unique=True))))
    effect_ops = [op for key in (*keys, "ordered") for op in EFFECT_OPS[key]]
    inputs = tuple(draw(st.lists(st.booleans(), min_size=1, max_size=3)))
    weights = tuple(draw(st.lists(st.booleans(), min_size=0, max_size=3)))
    constants = draw(st.integers(0, 2))
    consts = [f"C{i}" for i in range(constants)]
    params_w = [f"w{i}" for i in range(len(weights))]
    n_regions = draw(st.integers(0, max_regions))
    regions: list[RegionSpec] = []
    heights: dict[str, int] = {}
    for idx in reversed(range(n_regions)):  # region idx may call regions idx+1 ...: no recursion
        name = f"r{idx}"
        style = draw(st.sampled_from(REGION_STYLES))
        module_ref = {"method": "self", "module_fn": "m", "function": None}[style]
        callees = [r for r in regions if heights[r.name] < MAX_DEPTH
                   and (module_ref is not None or r.style == "function")]
        scalar = "scalar" not in exclude and draw(st.booleans())
        list_len = 0 if "list" in exclude else draw(st.sampled_from([0, 0, 0, 1, 2, 3]))
        changes = bool(list_len) and "change" not in exclude and draw(st.integers(0, 9)) == 0
        ctx = _Context(name, module_ref, consts + (params_w if module_ref else []), callees, effect_ops,
                       scalar=scalar, list_len=list_len, changes=changes)
        n_params = draw(st.integers(1, 2))
        n_returns = draw(st.sampled_from([1, 1, 1, 2, 0]))
        body = draw(_body(ctx, tuple(f"x{i}" for i in range(n_params)), max_stmts, n_returns, exclude))
        heights[name] = 1 + max((heights[s.op] for s in body.stmts if s.kind in CALL_KINDS), default=0)
        regions.insert(0, RegionSpec(name, style, body, scalar, list_len))
    blocks: tuple[bool, ...] = ()
    block_body = None
    if "blocks" not in exclude and draw(st.booleans()):  # sub-modules sharing one region method
        blocks = tuple(draw(st.lists(st.booleans(), min_size=1, max_size=3)))
        callees = [r for r in regions if r.style == "function" and heights[r.name] < MAX_DEPTH - 1]
        ctx = _Context("step", "self", consts + ["w"], callees, effect_ops)
        block_body = draw(_body(ctx, ("x0",), max_stmts, 1, exclude))
    ctx = _Context("forward", "self", consts + params_w, list(regions), effect_ops, blocks=bool(blocks))
    n_out = draw(st.integers(1, 2))
    forward = draw(_body(ctx, tuple(f"x{i}" for i in range(len(inputs))), max_stmts + 2, n_out, exclude))
    batch = draw(st.sampled_from([2, 3]))
    seed = draw(st.integers(0, 2**16))
    return ProgramSpec(batch, 4, keys, inputs, weights, constants, tuple(regions), forward, seed,
                       blocks, block_body)


__all__ = ["programs"]
