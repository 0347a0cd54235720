"""Random programs for differential fuzzing against eager PyTorch: the hypothesis strategies.

:func:`programs` draws a :class:`~effectfx.testing.program.ProgramSpec`: elementwise ops, reductions
broadcast back (``a - a.mean(-1, keepdim=True)``), matmuls with module parameters or constants, in-place
updates of fresh intermediates, ``detach``, dropout (alone, checkpointed, checkpointed without preserving
the generator's state), effect ops on the program's 1-3 keys (``efxtest::record_*``, ``log_tensor``,
``bump``), ``efxtest::scale`` (an effect in backward only), ``efxfuzz::ping`` (never
registered, returns nothing), ``efxfuzz::logged`` (CompositeImplicitAutograd kernel), Python ``print``,
and region calls: once, repeatedly, chained ``r(r(a))``, in a ``for`` loop, under ``torch.no_grad()``, or
with the result unused; regions may take a number ``s`` and a list ``xs`` of tensors they read (and,
rarely, change: such a program must be refused).  Bodies on a module may update its buffers and run its
BatchNorm, and read the state afterwards; any body may update an argument or an intermediate in place --
only one that nothing aliases and no op saved for backward (the tensors eager would let change), and a
region doing so is called on distinct such tensors of its caller, once at a time.  Bodies on a module call
its children (a ``Linear``, an ``Identity``) and the root calls the blocks as modules or through their
region method; module hooks (forward, pre-forward, full backward) on the blocks, their children and the
program module's children log per-layer (or shared) labels and scale what they return, registered by
``make`` or between two calls of a sequence -- and then also on the program module itself (``_hooks``).
Rarely the root updates an input that is a leaf requiring grad: such a program must be refused.  Region
``i`` may only call regions ``j > i`` and nesting is at most :data:`~effectfx.testing.program.MAX_DEPTH`
deep, so there is no recursion.  Effect statements also call Python functions through ``efx.callback``
(Note [Callbacks]): ``effect_ops.noted`` on "ordered", ``effect_ops.shifted`` with a result on "stdout".

The description and its source are ``effectfx.testing.program`` (printed by ``render``); running is
``effectfx.testing.checking`` (and ``sequence``), minimizing ``effectfx.testing.shrinking``.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from .effect_ops import EFFECT_KEYS
from .module_hooks import CHILDREN, HOOK_EFFECTS, HookSpec
from .program import (
    BINARY,
    BUFFER_READS,
    BUFFERS,
    CALL_KINDS,
    CHANGES,
    EFFECT_OPS,
    ITEMS,
    MATMUL,
    MAX_DEPTH,
    MUTATIONS,
    PRINTS,
    RANDOM,
    REDUCE,
    REGION_STYLES,
    TENSOR_EFFECTS,
    UNARY,
    Body,
    ProgramSpec,
    RegionSpec,
    Stmt,
    mutated_params,
)


@dataclass
class _Context:
    name: str  # "forward" or a region name: labels effects
    module_ref: str | None
    matrices: list[str]
    callees: list[RegionSpec]
    effect_ops: list[tuple[str, str, bool]]
    blocks: bool = False  # "blocks" statements may run the sub-modules
    children: int = 0  # "child" statements may call the module's children (CHILDREN): how often
    scalar: bool = False  # the body has a number parameter ``s``
    list_len: int = 0  # the body has a list parameter ``xs`` of this many tensors
    changes: bool = False  # the body changes ``xs`` (the program must be refused)
    state: bool = False  # the module has buffers the body may update and read
    bn: bool = False  # ... and a BatchNorm1d it may run (in training)
    mutable: frozenset[str] = frozenset()  # the parameters the body may update in place
    leaves: tuple[str, ...] = ()  # parameters that are leaves requiring grad (updating one: refused)
    # callee -> the positions of the parameters it updates in place
    mutates: dict[str, frozenset[int]] = dataclasses.field(default_factory=dict)


# Updating a tensor in place is only generated where eager allows it: on a tensor that nothing aliases and
# no op saved for backward.  Outputs of these ops are such fresh tensors ...
def _fresh_output(s: Stmt) -> bool:
    if s.kind == "unary":
        return s.op not in ("tanh", "sigmoid", "relu")  # saved for their backward
    if s.kind == "reduce":
        return s.op != "softmax"
    return (s.kind in ("binary", "scalar", "inplace", "matmul", "bn", "random")
            or (s.kind, s.op) == ("bufread", "use"))


# ... and these reads neither save nor alias what they read (the others make it no longer updatable)
def _harmless_read(s: Stmt) -> bool:
    if s.kind == "unary":
        return s.op in ("neg", "half", "tanh", "sigmoid", "relu")
    if s.kind == "binary":
        return s.op != "mul"
    if s.kind == "reduce":
        return s.op in ("center", "colsum", "softmax")
    if s.kind == "effect":
        return s.op == "ping"
    return s.kind in ("scalar", "inplace", "print", "buffer", "bufread", "mutate")


_DATA_KINDS = ("unary", "binary", "reduce", "matmul", "inplace", "detach", "scalar", "random")


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
    if kind == "random":
        return Stmt(kind, draw(st.sampled_from(sorted(RANDOM))), (a,), (out,))
    return Stmt(kind, "detach", (a,), (out,))


def _call_stmt(draw: Any, kind: str, ctx: _Context, a: str, names: list[str], fresh: Any,
               exclude: frozenset[str], updatable: list[str], first: bool = False) -> Stmt | None:
    # a region updating its arguments is called once at a time (not chained, looped or under no_grad), on
    # distinct updatable tensors of the caller; None when no region can be called
    def fits(r: RegionSpec) -> bool:
        written = ctx.mutates.get(r.name, frozenset())
        return not written or (kind in ("call", "unused") and len(written) <= len(updatable) < len(names))

    eligible: list[RegionSpec] = []
    if kind in ("chain", "loop"):
        eligible = [r for r in ctx.callees
                    if len(r.body.params) == 1 and len(r.body.returns) == 1 and fits(r)]
        if not eligible:
            kind = "call" if "call" not in exclude else "unused"
    candidates = eligible if kind in ("chain", "loop") else [r for r in ctx.callees if fits(r)]
    if not candidates:
        return None
    # a body's first call is, half the time, of the deepest region it may call (``ctx.callees`` come
    # deepest first): nesting is reached as often as regions nest
    callee = candidates[0] if first and draw(st.booleans()) else draw(st.sampled_from(candidates))
    written = sorted(ctx.mutates.get(callee.name, frozenset()))
    chosen = draw(st.lists(st.sampled_from(updatable), min_size=len(written), max_size=len(written),
                           unique=True)) if written else []
    others = [n for n in names if n not in chosen]
    picked = iter(chosen)
    args = tuple(next(picked) if i in written else a if i == 0 and a not in chosen
                 else draw(st.sampled_from(others)) for i in range(len(callee.body.params)))
    items = tuple(draw(st.sampled_from(others)) for _ in range(callee.list_len))
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
    kinds = ["unary", "binary", "reduce", "detach", "inplace", "effect", "effect", "print", "random"]
    if ctx.matrices:
        kinds.append("matmul")
    if ctx.callees:  # about half the statements call a region when there is one to call
        kinds += ["call", "call", "call", "unused", "chain", "chain", "loop", "loop", "nograd"]
    if ctx.blocks:
        kinds += ["blocks"] * 4
    kinds += ["child"] * ctx.children
    if ctx.scalar:
        kinds += ["scalar", "scalar"]
    if ctx.list_len:
        kinds += ["item", "item", "item"]
    if ctx.state:
        kinds += ["buffer", "buffer", "bufread", "bufread"] + (["bn", "bn"] if ctx.bn else [])
    kinds += ["mutate", "mutate"]
    kinds = [k for k in kinds if k not in exclude]
    buffer_reads = sorted(op for op in BUFFER_READS if ctx.bn or not op.startswith("bn"))
    prints = sorted(op for op in PRINTS if op not in exclude)  # (all of PRINTS unless one is excluded)
    if not prints:
        kinds = [k for k in kinds if k != "print"]
    updatable = [p for p in params if p in ctx.mutable]
    call_kinds = [k for k in CALL_KINDS if k not in exclude]
    effect_ops = [o for o in ctx.effect_ops if o[0] not in exclude] or ctx.effect_ops
    n = draw(st.integers(1, max_stmts))
    for i in range(n):
        # the first statement calls a region whenever there is one to call, so regions are reachable
        kind = draw(st.sampled_from(call_kinds if i == 0 and ctx.callees and call_kinds else kinds))
        a = draw(st.sampled_from(names[::-1]))  # shrinks towards the newest value
        label = f"{ctx.name}.{i}"
        if kind == "mutate":
            # eager refuses it: so must effectfx
            leaf = bool(ctx.leaves) and "leaf" not in exclude and draw(st.integers(0, 19)) == 0
            if leaf or updatable:
                own = [p for p in updatable if p in params]  # a region's own argument, half the time
                pool = list(ctx.leaves) if leaf else own if own and draw(st.booleans()) else updatable[::-1]
                target = draw(st.sampled_from(pool))
                op = draw(st.sampled_from(sorted(MUTATIONS)))
                others = [n for n in names if n != target]
                if op == "add" and not others:
                    op = "mul"
                read = (draw(st.sampled_from(others[::-1])),) if op == "add" else ()
                stmt = Stmt(kind, op, (target, *read), value=draw(st.sampled_from([2.0, 0.5, -1.0])))
            else:
                kind = "inplace"
        elif kind == "buffer":
            op = draw(st.sampled_from(sorted(BUFFERS)))
            stmt = Stmt(kind, op, () if op == "count" else (a,))
        elif kind == "bufread":
            op = draw(st.sampled_from(buffer_reads))
            stmt = Stmt(kind, op, (a,) if op == "use" else (), (next(fresh),) if op == "use" else (), label)
        elif kind == "bn":
            stmt = Stmt(kind, "bn", (a,), (next(fresh),))
        if kind in ("mutate", "buffer", "bufread", "bn"):
            pass
        elif kind in _DATA_KINDS:
            stmt = _data_stmt(draw, kind, ctx, a, names, next(fresh))
        elif kind == "blocks":  # (op "call": each block as a module, its hooks around its region)
            stmt = Stmt(kind, draw(st.sampled_from(["blocks", "call", "call"])), (a,), (next(fresh),))
        elif kind == "child":
            stmt = Stmt(kind, draw(st.sampled_from(sorted(CHILDREN))), (a,), (next(fresh),))
        elif kind == "item":
            op = draw(st.sampled_from(sorted(ITEMS)))
            j = draw(st.integers(-ctx.list_len, ctx.list_len - 1)) if op == "index" else 0
            stmt = Stmt(kind, op, (), (next(fresh),), value=float(j))
        elif kind == "print":
            stmt = Stmt(kind, draw(st.sampled_from(prints)), (a,), (), label)
        elif kind == "effect":
            op, _, has_out = draw(st.sampled_from(effect_ops))
            value = draw(st.sampled_from([0.5, 2.0, 3.0])) if op == "scale" else 0.0
            stmt = Stmt(kind, op, (a,) if op in TENSOR_EFFECTS else (), (next(fresh),) if has_out else (),
                        label, value)
        else:
            call = _call_stmt(draw, kind, ctx, a, names, fresh, exclude, updatable, first=i == 0)
            stmt = call if call is not None else _data_stmt(draw, "unary", ctx, a, names, next(fresh))
        if not _harmless_read(stmt):
            updatable = [n for n in updatable if n not in stmt.args + stmt.items]
        if _fresh_output(stmt):
            updatable.extend(stmt.outs)
        names.extend(stmt.outs)
        stmts.append(stmt)
    if ctx.changes:  # the caller's list would not see this: effectfx refuses the program
        stmts.append(Stmt("change", draw(st.sampled_from(sorted(CHANGES))), (draw(st.sampled_from(names)),)))
    pool = names[len(params):] or names
    returns = tuple(draw(st.sampled_from(pool[::-1])) for _ in range(n_returns))
    return Body(params, tuple(stmts), returns)


def _mutates(regions: list[RegionSpec]) -> dict[str, frozenset[int]]:
    """Region name -> the positions of the parameters it updates in place."""
    by_name = {r.name: r for r in regions}
    return {r.name: frozenset(i for i, p in enumerate(r.body.params)
                              if p in mutated_params(r.body, by_name.__getitem__)) for r in regions}


def _deepest_first(regions: list[RegionSpec], heights: dict[str, int]) -> list[RegionSpec]:
    return sorted(regions, key=lambda r: -heights[r.name])


def _state(draw: Any, module: bool, exclude: frozenset[str]) -> dict[str, bool]:
    """Whether a body on a module updates and reads its buffers (a third of them), and runs its BatchNorm."""
    state = module and "buffer" not in exclude and draw(st.integers(0, 2)) == 0
    return {"state": state, "bn": state and "bn" not in exclude and draw(st.booleans())}


@st.composite
def programs(draw: Any, max_regions: int = 4, max_stmts: int = 6,
             exclude: frozenset[str] | tuple[str, ...] = ()) -> ProgramSpec:
    """Hypothesis strategy for :class:`ProgramSpec`.  ``exclude`` names statement kinds (``"nograd"``,
    ``"inplace"``, ``"print"``, ``"random"`` for dropout and checkpointing, ``"list"`` for list arguments,
    ``"change"`` for changing them, ``"buffer"`` for buffer updates, ``"bn"`` for BatchNorm, ``"mutate"`` for
    updating arguments in place, ``"leaf"`` for updating an input that is a leaf requiring grad (refused),
    ``"child"`` for child modules, ``"hook"`` for module hooks, ``"backward_hook"`` for full backward hooks,
    ``"late_hook"`` for hooks registered or removed between calls, ...), effect ops (``"scale"``,
    ``"logged"``, ...) or prints (``"stats"``, ... of ``PRINTS``) that generated programs must not use."""
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
        callees = [r for r in _deepest_first(regions, heights) if heights[r.name] < MAX_DEPTH
                   and (module_ref is not None or r.style == "function")]
        scalar = "scalar" not in exclude and draw(st.booleans())
        list_len = 0 if "list" in exclude else draw(st.sampled_from([0, 0, 0, 1, 2, 3]))
        changes = bool(list_len) and "change" not in exclude and draw(st.integers(0, 9)) == 0
        n_params = draw(st.integers(1, 2))
        mutates = _mutates(regions)
        ctx = _Context(name, module_ref, consts + (params_w if module_ref else []), callees, effect_ops,
                       scalar=scalar, list_len=list_len, changes=changes, mutates=mutates,
                       mutable=frozenset(f"x{i}" for i in range(n_params)),
                       children=2 if module_ref is not None else 0,
                       **_state(draw, module_ref is not None, exclude))
        n_returns = draw(st.sampled_from([1, 1, 1, 2, 0]))
        body = draw(_body(ctx, tuple(f"x{i}" for i in range(n_params)), max_stmts, n_returns, exclude))
        heights[name] = 1 + max((heights[s.op] for s in body.stmts if s.kind in CALL_KINDS), default=0)
        regions.insert(0, RegionSpec(name, style, body, scalar, list_len))
    blocks: tuple[bool, ...] = ()
    block_body = None
    if "blocks" not in exclude and draw(st.booleans()):  # sub-modules sharing one region method
        n_blocks = draw(st.sampled_from([1, 2, 2, 3, 3]))  # (several, mostly: per-layer hooks)
        blocks = tuple(draw(st.lists(st.booleans(), min_size=n_blocks, max_size=n_blocks)))
        callees = [r for r in regions if r.style == "function" and heights[r.name] < MAX_DEPTH - 1]
        ctx = _Context("step", "self", consts + ["w"], callees, effect_ops, mutates=_mutates(callees),
                       children=5, **_state(draw, True, exclude))
        block_body = draw(_body(ctx, ("x0",), max_stmts, 1, exclude))
    ctx = _Context("forward", "self", consts + params_w, _deepest_first(regions, heights), effect_ops,
                   blocks=bool(blocks),
                   mutates=_mutates(regions), children=2,
                   mutable=frozenset(f"x{i}" for i, rg in enumerate(inputs) if not rg),
                   leaves=tuple(f"x{i}" for i, rg in enumerate(inputs) if rg), **_state(draw, True, exclude))
    n_out = draw(st.integers(1, 2))
    forward = draw(_body(ctx, tuple(f"x{i}" for i in range(len(inputs))), max_stmts + 2, n_out, exclude))
    batch = draw(st.sampled_from([2, 3]))
    seed = draw(st.integers(0, 2**16))
    spec = ProgramSpec(batch, 4, keys, inputs, weights, constants, tuple(regions), forward, seed,
                       blocks, block_body)
    return dataclasses.replace(spec, hooks=_hooks(draw, spec, exclude))


def _hooks(draw: Any, spec: ProgramSpec, exclude: frozenset[str]) -> tuple[HookSpec, ...]:
    """Module hooks on the blocks and the children the bodies call; with ``late``, some registered or
    removed between calls, and then maybe on the program module itself (only ever added late)."""
    if "hook" in exclude:
        return ()
    late = "late_hook" not in exclude
    # modules the program calls (weighted: hooks inside the blocks' region first)
    runs = {s.op for s in spec.forward.stmts if s.kind == "blocks"}
    targets = (["blocks"] * 3 if "call" in runs else []) \
        + ([f"blocks.{c}" for c in spec.children("block")] * 4 if runs else []) + spec.children("model") * 2
    counts = ([1, 1, 2, 3] if runs else [0, 1, 1, 2, 3]) if targets else [0, 0, 0, 1] if late else [0]
    n = draw(st.sampled_from(counts))
    effects = [e for e, (_, key) in HOOK_EFFECTS.items() if (key in spec.keys or key == "ordered")
               and e not in exclude]
    hooks = []
    for _ in range(n):
        target = draw(st.sampled_from(targets + (["model"] if late and n < 3 else [])))
        kinds = ["forward", "forward", "pre"]
        # (an input updated in place after a backward hook's wrapper made it a view: eager refuses it)
        if "backward_hook" not in exclude and (target != "model" or not spec.mutated(spec.forward)):
            kinds.append("backward")
        kind = draw(st.sampled_from(kinds))
        effect = draw(st.sampled_from(["", *(e for e in effects if kind != "backward" or e != "bump")]))
        s = draw(st.sampled_from([0.5, 2.0, -1.0] if not effect else [None, None, 0.5, 2.0, -1.0]))
        layers: tuple[int, ...] = ()
        if target.startswith("blocks"):  # every layer, two times in three
            picked = draw(st.lists(st.integers(0, len(spec.blocks) - 1), min_size=1, unique=True))
            layers = tuple(range(len(spec.blocks))) if draw(st.integers(0, 2)) else tuple(sorted(picked))
        sharing = draw(st.sampled_from(["own", "equal", "one"])) if len(layers) > 1 else "own"
        added = draw(st.sampled_from([1, 2] if target == "model" else [0, 0, 0, 1, 2] if late else [0]))
        removed = draw(st.sampled_from([0, 0, added + 1])) if late else 0
        hooks.append(HookSpec(target, kind, effect, s, sharing, layers, added, removed))
    return tuple(hooks)


__all__ = ["programs"]
