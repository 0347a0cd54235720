"""Random programs for differential fuzzing against eager PyTorch (issue 5).

A generated program is a plain data description (:class:`ProgramSpec`) that prints as standalone Python
source (:meth:`ProgramSpec.source`) -- the same text is executed to build the callable, so a printed
reproducer is exactly what ran.  A program is an ``nn.Module`` whose ``forward`` is the program body; its
regions are ``@efx.region`` methods, ``@efx.region`` functions taking the module, or plain
``@efx.region`` functions (which read closed-over constant tensors instead of parameters).

Every value in a program has shape ``(B, D)``, so any op can feed any other: elementwise ops, reductions
broadcast back (``a - a.mean(-1, keepdim=True)``), matmuls with module parameters or constants, in-place
updates of fresh intermediates, ``detach``, effect ops on the program's 1-3 keys (``efxtest::record_*``,
``log_tensor``, ``bump``) and ``efxtest::scale`` (an effect in backward only), and region calls: once,
repeatedly, chained ``r(r(a))``, in a ``for`` loop, under ``torch.no_grad()``, or with the result unused.
Region ``i`` may only call regions ``j > i`` and nesting is at most :data:`MAX_DEPTH` deep, so there is no
recursion.

:func:`programs` is the hypothesis strategy, :func:`check_program` runs one program in eager, through
every form in ``FORMS`` and through ``efx.compile`` (twice on the same inputs, once on new inputs of the
same signature) and classifies what went wrong, and :func:`shrink` is a deletion-based minimizer over the
description.
"""

from __future__ import annotations

import dataclasses
import itertools
import linecache
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st

import effectfx as efx

from . import differential
from .differential import EagerMismatch, compare, run_eager, run_program
from .effect_ops import EFFECT_KEYS

MAX_DEPTH = 3  # region nesting depth (a region called from the root is at depth 1)

# -- the ops a statement may use, as tables: name -> Python expression over ``a`` (and ``b``) ----------
UNARY = {
    "tanh": "torch.tanh({a})",
    "sin": "torch.sin({a})",
    "sigmoid": "torch.sigmoid({a})",
    "relu": "torch.relu({a})",
    "neg": "-{a}",
    "half": "{a} * 0.5",
    "square": "{a} * {a}",
    "abs": "{a}.abs()",
}
BINARY = {
    "add": "{a} + {b}",
    "sub": "{a} - {b}",
    "mul": "{a} * {b}",
    "where": "torch.where({a} > {b}, {a}, {b})",
}
REDUCE = {
    "center": "{a} - {a}.mean(-1, keepdim=True)",
    "rownorm": "{a} * {a}.sum(-1, keepdim=True).tanh()",
    "softmax": "{a}.softmax(-1)",
    "amax": "{a} + {a}.amax(-1, keepdim=True)",
    "colsum": "{a} + {a}.sum(0, keepdim=True)",
    "logsumexp": "{a}.logsumexp(-1, keepdim=True) - {a}",
}
MATMUL = {
    "matmul": "{a} @ {w}",
    "linear": "torch.nn.functional.linear({a}, {w})",
}
# effect ops by key: (name, template, has output)
RECORD_OP = {key: "record_" + key.replace(":", "_") for key in EFFECT_KEYS}
EFFECT_OPS: dict[str, list[tuple[str, str, bool]]] = {
    "memory": [
        ("record_memory", 'torch.ops.efxtest.record_memory("{label}")', False),
        ("bump", 'torch.ops.efxtest.bump({a}, "{label}")', True),
        ("scale", "torch.ops.efxtest.scale({a}, {s})", True),  # its effect happens in backward
    ],
    "stdout": [
        ("record_stdout", 'torch.ops.efxtest.record_stdout("{label}")', False),
        ("log_tensor", 'torch.ops.efxtest.log_tensor({a}, "{label}")', False),
    ],
    "collective:tp": [
        ("record_collective_tp", 'torch.ops.efxtest.record_collective_tp("{label}")', False),
    ],
}
CALL_KINDS = ("call", "unused", "chain", "loop", "nograd")
REGION_STYLES = ("method", "module_fn", "function")


# -- the description ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stmt:
    """One statement of a body.

    kind: "unary", "binary", "reduce", "matmul", "inplace", "detach", "effect" or one of CALL_KINDS.
    op: the table entry (or region name for calls, or effect op name); args: variables read;
    outs: variables assigned; label: effect label; value: scale factor / loop count; weight: the
    matrix of a matmul ("w0" a module parameter, "C0" a closed-over constant).
    """

    kind: str
    op: str
    args: tuple[str, ...]
    outs: tuple[str, ...] = ()
    label: str = ""
    value: float = 0.0
    weight: str = ""
    s: float | None = None  # calls of a region with a number parameter: the value passed as ``s=``

    def renamed(self, names: dict[str, str]) -> Stmt:
        return dataclasses.replace(self, args=tuple(names.get(a, a) for a in self.args))


@dataclass(frozen=True)
class Body:
    params: tuple[str, ...]
    stmts: tuple[Stmt, ...]
    returns: tuple[str, ...]


@dataclass(frozen=True)
class RegionSpec:
    name: str
    style: str  # "method" (self.rK), "module_fn" (rK(m, ...)) or "function" (rK(...))
    body: Body
    scalar: bool = False  # takes a number ``s`` too: each value passed is another cache key (body)


@dataclass(frozen=True)
class ProgramSpec:
    batch: int
    width: int
    keys: tuple[str, ...]
    inputs: tuple[bool, ...]  # requires_grad of each input x0, x1, ...
    weights: tuple[bool, ...]  # requires_grad of each module parameter w0, w1, ...
    constants: int  # closed-over constant matrices C0, C1, ...
    regions: tuple[RegionSpec, ...]
    forward: Body
    seed: int = 0
    blocks: tuple[bool, ...] = ()  # requires_grad of each sub-module's weight (self.blocks[i].w)
    block_body: Body | None = None  # the body of Block.step, an @efx.region method shared by the blocks

    # -- inspection ----------------------------------------------------------------------------------
    def region(self, name: str) -> RegionSpec:
        return next(r for r in self.regions if r.name == name)

    def bodies(self) -> Iterator[tuple[str, Body]]:
        yield "forward", self.forward
        for r in self.regions:
            yield r.name, r.body
        if self.block_body is not None:
            yield "step", self.block_body

    def depth(self) -> int:
        """The deepest region nesting reached from forward (0: no region calls)."""

        @_memo
        def height(name: str) -> int:
            return 1 + max((height(s.op) for s in self.region(name).body.stmts if s.kind in CALL_KINDS),
                           default=0)

        step = 1 + max((height(s.op) for s in self.block_body.stmts if s.kind in CALL_KINDS), default=0) \
            if self.block_body is not None else 0
        return max((height(s.op) if s.kind in CALL_KINDS else step for s in self.forward.stmts
                    if s.kind in CALL_KINDS or s.kind == "blocks"), default=0)

    def features(self) -> frozenset[str]:
        """What this program exercises (for coverage counts in the fuzz summary)."""
        found = {f"keys={len(self.keys)}", f"depth={self.depth()}"}
        if any(self.inputs) or any(self.weights):
            found.add("requires_grad")
        if len(set(self.inputs + self.weights)) == 2:
            found.add("mixed requires_grad")
        calls: dict[str, int] = {}
        for _, body in self.bodies():
            for s in body.stmts:
                found.add(s.kind if s.kind not in ("effect",) else f"effect:{s.op}")
                if s.kind in CALL_KINDS:
                    calls[s.op] = calls.get(s.op, 0) + (int(s.value) if s.kind == "loop" else
                                                        2 if s.kind == "chain" else 1)
        if any(n > 1 for n in calls.values()):
            found.add("region called many times")
        found.update(f"region:{r.style}" for r in self.regions)
        numbers = {r.name: {s.s for _, b in self.bodies() for s in b.stmts if s.op == r.name}
                   for r in self.regions if r.scalar}
        if any(len(v) > 1 for v in numbers.values()):
            found.add("region called with different numbers")
        if len(set(self.blocks)) == 2:
            found.add("blocks with mixed requires_grad")
        return frozenset(found)

    def size(self) -> int:
        return sum(len(b.stmts) + 1 for _, b in self.bodies()) + len(self.inputs) + len(self.weights) \
            + len(self.blocks)

    # -- source --------------------------------------------------------------------------------------
    def source(self) -> str:
        return _render(self)

    def build(self, variant: int = 0, filename: str | None = None) -> tuple[torch.nn.Module, tuple]:
        """Execute :meth:`source` in a fresh namespace: a new module class and new region objects every
        time.  ``variant`` picks different input values of the same signature."""
        return build_source(self.source(), variant, filename)


def _memo(fn: Callable[[str], int]) -> Callable[[str], int]:
    cache: dict[str, int] = {}

    def wrapper(name: str) -> int:
        if name not in cache:
            cache[name] = fn(name)
        return cache[name]

    return wrapper


_COUNTER = itertools.count()


def build_source(src: str, variant: int = 0, filename: str | None = None) -> tuple[torch.nn.Module, tuple]:
    filename = filename or f"<efxfuzz program {next(_COUNTER)}>"
    # register the text so tracebacks and effectfx's "at file:line" messages show the generated code
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"__name__": "efxfuzz_generated"}
    exec(compile(src, filename, "exec"), namespace)  # noqa: S102 - the program under test
    return namespace["make"](variant)


# -- rendering -----------------------------------------------------------------------------------------
def _call_expr(spec: ProgramSpec, name: str, module_ref: str | None, args: tuple[str, ...],
               s: float | None = None) -> str:
    style = spec.region(name).style
    joined = ", ".join(args) + (f", s={s!r}" if s is not None else "")
    if style == "method":
        return f"{module_ref}.{name}({joined})"
    if style == "module_fn":
        return f"{name}({module_ref}, {joined})"
    return f"{name}({joined})"


def _weight_expr(weight: str, module_ref: str | None) -> str:
    return weight if weight.startswith("C") else f"{module_ref}.{weight}"  # C0, self.w0, m.w1, self.w


def _stmt_lines(spec: ProgramSpec, s: Stmt, module_ref: str | None) -> list[str]:
    a = s.args[0] if s.args else ""
    out = ", ".join(s.outs)
    if s.kind == "unary":
        return [f"{out} = {UNARY[s.op].format(a=a)}"]
    if s.kind == "scalar":
        return [f"{out} = {a} * s"]
    if s.kind == "binary":
        return [f"{out} = {BINARY[s.op].format(a=a, b=s.args[1])}"]
    if s.kind == "reduce":
        return [f"{out} = {REDUCE[s.op].format(a=a)}"]
    if s.kind == "matmul":
        return [f"{out} = {MATMUL[s.op].format(a=a, w=_weight_expr(s.weight, module_ref))}"]
    if s.kind == "inplace":
        return [f"{out} = {a} * 1.0", f"{out}.{s.op}_({s.value!r})"]
    if s.kind == "detach":
        return [f"{out} = {a}.detach()"]
    if s.kind == "blocks":  # every sub-module's region method in turn: one body, N weights
        return [f"{out} = {a}", f"for blk in {module_ref}.blocks:", f"    {out} = blk.step({out})"]
    if s.kind == "effect":
        template = next(t for name, t, _ in itertools.chain(*EFFECT_OPS.values()) if name == s.op)
        expr = template.format(a=a, label=s.label, s=s.value)
        return [f"{out} = {expr}" if s.outs else expr]
    call = _call_expr(spec, s.op, module_ref, s.args, s.s)
    if s.kind == "unused":
        return [call]
    if s.kind == "call":
        return [f"{out} = {call}" if s.outs else call]
    if s.kind == "chain":
        return [f"{out} = {_call_expr(spec, s.op, module_ref, (call,), s.s)}"]
    if s.kind == "loop":
        return [f"{out} = {a}", f"for _ in range({int(s.value)}):",
                f"    {out} = {_call_expr(spec, s.op, module_ref, (out,), s.s)}"]
    if s.kind == "nograd":
        return ["with torch.no_grad():", f"    {out} = {call}" if s.outs else f"    {call}"]
    raise ValueError(f"unknown statement kind {s.kind!r}")


def _body_lines(spec: ProgramSpec, body: Body, module_ref: str | None, indent: str) -> list[str]:
    lines = []
    for s in body.stmts:
        lines.extend(indent + line for line in _stmt_lines(spec, s, module_ref))
    if not body.returns:
        lines.append(indent + "return None")
    else:
        lines.append(indent + "return " + ", ".join(body.returns))
    return lines


def _render(spec: ProgramSpec) -> str:
    lines = [
        '"""A program generated by effectfx.testing.generator (python -m effectfx fuzz)."""',
        "import torch",
        "",
        "import effectfx as efx",
        "import effectfx.testing  # noqa: F401  (registers the efxtest:: effect ops)",
        "",
        f"B, D = {spec.batch}, {spec.width}",
        f"_g = torch.Generator().manual_seed({spec.seed})",
    ]
    lines += [f"C{i} = torch.randn(D, D, generator=_g) / D ** 0.5" for i in range(spec.constants)]
    for r in spec.regions:
        if r.style == "method":
            continue
        params = (("m",) if r.style == "module_fn" else ()) + r.body.params + (("s=1.0",) if r.scalar else ())
        lines += ["", "", "@efx.region", f"def {r.name}({', '.join(params)}):"]
        lines += _body_lines(spec, r.body, "m" if r.style == "module_fn" else None, "    ")
    if spec.block_body is not None:
        lines += ["", "", "class Block(torch.nn.Module):", "    def __init__(self, seed, requires_grad):",
                  "        super().__init__()", "        g = torch.Generator().manual_seed(seed)",
                  "        self.w = torch.nn.Parameter(torch.randn(D, D, generator=g) / D ** 0.5, "
                  "requires_grad=requires_grad)", "", "    @efx.region",
                  f"    def step(self, {', '.join(spec.block_body.params)}):"]
        lines += _body_lines(spec, spec.block_body, "self", "        ")
    lines += ["", "", "class Fuzzed(torch.nn.Module):", "    def __init__(self):",
              "        super().__init__()", f"        g = torch.Generator().manual_seed({spec.seed + 1})"]
    if spec.blocks:
        blocks = ", ".join(f"Block({spec.seed + 10 + i}, {rg})" for i, rg in enumerate(spec.blocks))
        lines.append(f"        self.blocks = torch.nn.ModuleList([{blocks}])")
    for i, rg in enumerate(spec.weights):
        lines.append(f"        self.w{i} = torch.nn.Parameter(torch.randn(D, D, generator=g) / D ** 0.5, "
                     f"requires_grad={rg})")
    for r in spec.regions:
        if r.style != "method":
            continue
        params = r.body.params + (("s=1.0",) if r.scalar else ())
        lines += ["", "    @efx.region", f"    def {r.name}(self, {', '.join(params)}):"]
        lines += _body_lines(spec, r.body, "self", "        ")
    lines += ["", f"    def forward(self, {', '.join(spec.forward.params)}):"]
    lines += _body_lines(spec, spec.forward, "self", "        ")
    lines += ["", "", "def make(variant=0):", "    model = Fuzzed()",
              f"    g = torch.Generator().manual_seed({spec.seed + 2} + 1000 * variant)",
              "    args = ("]
    lines += [f"        torch.randn(B, D, generator=g).requires_grad_({rg})," for rg in spec.inputs]
    lines += ["    )", "    return model, args", ""]
    return "\n".join(lines)


def reproducer_source(spec: ProgramSpec, note: str = "", backend: str = "eager") -> str:
    """A standalone script that rebuilds the program and runs the differential check."""
    comment = "".join(f"# {line}\n" for line in note.splitlines())
    return (
        comment + spec.source()
        + "\n\nif __name__ == \"__main__\":\n"
        "    from effectfx.testing.generator import check_model\n\n"
        f"    outcome = check_model(make, backend={backend!r})\n"
        "    print(outcome.report())\n"
        "    raise SystemExit(1 if outcome.failures else 0)\n"
    )


# -- the strategy --------------------------------------------------------------------------------------
@dataclass
class _Context:
    name: str  # "forward" or a region name: labels effects
    module_ref: str | None
    matrices: list[str]
    callees: list[RegionSpec]
    effect_ops: list[tuple[str, str, bool]]
    blocks: bool = False  # "blocks" statements may run the sub-modules
    scalar: bool = False  # the body has a number parameter ``s``


_DATA_KINDS = ("unary", "binary", "reduce", "matmul", "inplace", "detach", "scalar")


@st.composite
def _body(draw: Any, ctx: _Context, params: tuple[str, ...], max_stmts: int, n_returns: int,
          exclude: frozenset[str]) -> Body:
    names = list(params)
    stmts: list[Stmt] = []
    fresh = (f"v{i}" for i in itertools.count())
    kinds = ["unary", "binary", "reduce", "detach", "inplace", "effect", "effect"]
    if ctx.matrices:
        kinds.append("matmul")
    if ctx.callees:  # about half the statements call a region when there is one to call
        kinds += ["call", "call", "call", "unused", "chain", "chain", "loop", "loop", "nograd"]
    if ctx.blocks:
        kinds += ["blocks", "blocks"]
    if ctx.scalar:
        kinds += ["scalar", "scalar"]
    kinds = [k for k in kinds if k not in exclude]
    call_kinds = [k for k in CALL_KINDS if k not in exclude]
    n = draw(st.integers(1, max_stmts))
    for i in range(n):
        # the first statement calls a region whenever there is one to call, so regions are reachable
        kind = draw(st.sampled_from(call_kinds if i == 0 and ctx.callees and call_kinds else kinds))
        a = draw(st.sampled_from(names[::-1]))  # shrinks towards the newest value
        label = f"{ctx.name}.{i}"
        if kind in _DATA_KINDS:
            out = next(fresh)
            if kind == "unary":
                stmt = Stmt(kind, draw(st.sampled_from(sorted(UNARY))), (a,), (out,))
            elif kind == "binary":
                stmt = Stmt(kind, draw(st.sampled_from(sorted(BINARY))), (a, draw(st.sampled_from(names))),
                            (out,))
            elif kind == "reduce":
                stmt = Stmt(kind, draw(st.sampled_from(sorted(REDUCE))), (a,), (out,))
            elif kind == "matmul":
                stmt = Stmt(kind, draw(st.sampled_from(sorted(MATMUL))), (a,), (out,),
                            weight=draw(st.sampled_from(ctx.matrices)))
            elif kind == "inplace":
                stmt = Stmt(kind, draw(st.sampled_from(["mul", "add"])), (a,), (out,),
                            value=draw(st.sampled_from([0.5, 2.0, -1.0])))
            elif kind == "scalar":
                stmt = Stmt(kind, "times_s", (a,), (out,))
            else:
                stmt = Stmt(kind, "detach", (a,), (out,))
            names.append(out)
        elif kind == "blocks":
            stmt = Stmt(kind, "blocks", (a,), (next(fresh),))
            names.extend(stmt.outs)
        elif kind == "effect":
            op, _, has_out = draw(st.sampled_from([o for o in ctx.effect_ops if o[0] not in exclude]
                                                  or ctx.effect_ops))
            outs = (next(fresh),) if has_out else ()
            value = draw(st.sampled_from([0.5, 2.0, 3.0])) if op == "scale" else 0.0
            stmt = Stmt(kind, op, (a,) if op in ("bump", "scale", "log_tensor") else (), outs, label, value)
            names.extend(outs)
        else:
            if kind in ("chain", "loop"):
                eligible = [r for r in ctx.callees if len(r.body.params) == 1 and len(r.body.returns) == 1]
                if not eligible:
                    kind = "call" if "call" not in exclude else "unused"
            pool = eligible if kind in ("chain", "loop") else ctx.callees
            callee = draw(st.sampled_from(pool))
            args = tuple([a] + [draw(st.sampled_from(names)) for _ in callee.body.params[1:]])
            if kind == "unused":
                outs: tuple[str, ...] = ()
            elif kind in ("chain", "loop"):
                outs = (next(fresh),)
            else:
                outs = tuple(next(fresh) for _ in callee.body.returns)
            value = float(draw(st.integers(2, 4))) if kind == "loop" else 0.0
            number = draw(st.sampled_from([None, 0.5, 2.0])) if callee.scalar else None
            stmt = Stmt(kind, callee.name, args, outs, value=value, s=number)
            names.extend(outs)
        stmts.append(stmt)
    pool = names[len(params):] or names
    returns = tuple(draw(st.sampled_from(pool[::-1])) for _ in range(n_returns))
    return Body(params, tuple(stmts), returns)


@st.composite
def programs(draw: Any, max_regions: int = 4, max_stmts: int = 6,
             exclude: frozenset[str] | tuple[str, ...] = ()) -> ProgramSpec:
    """Hypothesis strategy for :class:`ProgramSpec`.  ``exclude`` names statement kinds (``"nograd"``,
    ``"inplace"``, ...) or effect ops (``"scale"``, ...) that generated programs must not use."""
    exclude = frozenset(exclude)
    keys = tuple(sorted(draw(st.lists(st.sampled_from(EFFECT_KEYS), min_size=1, max_size=3, unique=True))))
    effect_ops = [op for key in keys for op in EFFECT_OPS[key]]
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
        ctx = _Context(name, module_ref, consts + (params_w if module_ref else []), callees, effect_ops,
                       scalar=scalar)
        n_params = draw(st.integers(1, 2))
        n_returns = draw(st.sampled_from([1, 1, 1, 2, 0]))
        body = draw(_body(ctx, tuple(f"x{i}" for i in range(n_params)), max_stmts, n_returns, exclude))
        heights[name] = 1 + max((heights[s.op] for s in body.stmts if s.kind in CALL_KINDS), default=0)
        regions.insert(0, RegionSpec(name, style, body, scalar))
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


# -- running one program ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Failure:
    """One way effectfx disagreed with eager (or refused a supported program)."""

    where: str  # the form, "compile call N", "compile new inputs", "eager"
    kind: str  # "outputs differ", "effect logs differ", ..., "error: CaptureError"
    detail: str

    @property
    def label(self) -> str:
        where = "compile" if self.where.startswith("compile") else self.where
        return f"{self.kind} [{where}]"


@dataclass
class Outcome:
    failures: list[Failure] = field(default_factory=list)
    comparisons: int = 0
    effects_compared: int = 0
    seconds: float = 0.0

    @property
    def generator_error(self) -> bool:
        return any(f.where == "eager" for f in self.failures)

    def kinds(self) -> frozenset[str]:
        return frozenset(f.label for f in self.failures)

    def report(self) -> str:
        if not self.failures:
            return f"ok: {self.comparisons} comparisons, {self.effects_compared} effects compared"
        return "\n\n".join(f"{f.label}\n{f.detail}" for f in self.failures)


_MISMATCH_KINDS = ("capture ran effects", "outputs differ", "gradients differ", "effect logs differ")


def _classify(where: str, exc: BaseException) -> list[Failure]:
    if isinstance(exc, EagerMismatch):
        text = str(exc)
        kinds = [k for k in _MISMATCH_KINDS if k in text] or ["mismatch"]
        return [Failure(where, k, text) for k in kinds]
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    return [Failure(where, f"error: {type(exc).__name__}", tb)]


def check_model(make: Callable[[int], tuple[torch.nn.Module, tuple]],
                forms: tuple[str, ...] | None = None, calls: int = 2, backend: str = "eager") -> Outcome:
    """Run ``make()``'s model in eager, through every form in ``FORMS`` (``calls`` times each) and through
    ``efx.compile`` (``calls`` times, then once on ``make(1)``'s inputs and once after an in-place update of
    the parameters, neither of which may recompile)."""
    outcome = Outcome()
    start = time.perf_counter()
    model, args = make(0)
    try:
        eager = run_eager(model, args)
    except Exception as exc:  # the generator made an invalid program
        outcome.failures.extend(_classify("eager", exc))
        return outcome

    def check(where: str, run: Callable[[], list[differential.RunResult]],
              expected: differential.RunResult) -> None:
        try:
            for result in run():
                outcome.comparisons += 1
                compare(where, expected, result)
                outcome.effects_compared += len(expected.log)
        except Exception as exc:
            outcome.failures.extend(_classify(where, exc))

    for name in forms if forms is not None else tuple(differential.FORMS):
        check(name, lambda name=name: run_program(differential.FORMS[name], model, args, {}, calls), eager)
    cfn = efx.compile(model, backend=backend)
    check("compile", lambda: run_program(lambda f, a, k: cfn, model, args, {}, calls), eager)
    _, new_args = make(1)
    try:
        eager_new = run_eager(model, new_args)
    except Exception as exc:
        outcome.failures.extend(_classify("eager", exc))
        return outcome
    check("compile new inputs", lambda: run_program(lambda f, a, k: cfn, model, new_args, {}, 1), eager_new)
    with torch.no_grad():  # an optimizer step: parameters change in place, the program reads them anew
        for p in model.parameters():
            p.mul_(-0.5)
    eager_updated = run_eager(model, args)
    check("compile updated parameters", lambda: run_program(lambda f, a, k: cfn, model, args, {}, 1),
          eager_updated)
    if not outcome.failures and cfn.stats.compiles != 1:
        outcome.failures.append(Failure("compile", "recompiled for the same signature",
                                        f"{cfn.stats.compiles} compiles for one signature"))
    outcome.seconds = time.perf_counter() - start
    return outcome


def check_program(spec: ProgramSpec, forms: tuple[str, ...] | None = None, calls: int = 2,
                  backend: str = "eager") -> Outcome:
    src = spec.source()
    return check_model(lambda variant: build_source(src, variant), forms, calls, backend)


# -- shrinking ---------------------------------------------------------------------------------------
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
            simpler = []
            if s.kind == "loop" and s.value > 1:
                simpler.append(dataclasses.replace(s, value=s.value - 1))
            if s.kind in ("chain", "loop", "nograd"):
                simpler.append(dataclasses.replace(s, kind="call"))
            if s.s is not None:
                simpler.append(dataclasses.replace(s, s=None))
            for new in simpler:
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
    if spec.blocks:  # drop the sub-modules, or the last one, or a requires_grad
        without = _map_bodies(spec, lambda b: _without_calls(b, lambda s: s.kind == "blocks"))
        yield dataclasses.replace(without, blocks=(), block_body=None)
        if len(spec.blocks) > 1:
            yield dataclasses.replace(spec, blocks=spec.blocks[:-1])
        for i, rg in enumerate(spec.blocks):
            if rg:
                yield dataclasses.replace(spec, blocks=spec.blocks[:i] + (False,) + spec.blocks[i + 1:])
    if spec.batch > 2:
        yield dataclasses.replace(spec, batch=2)


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
            src = candidate.source()
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


def fails_like(kinds: frozenset[str], forms: tuple[str, ...] | None = None,
               backend: str = "eager") -> Callable[[ProgramSpec], bool]:
    """A ``still_fails`` predicate for :func:`shrink`: the candidate fails with one of ``kinds``."""

    def predicate(candidate: ProgramSpec) -> bool:
        outcome = check_program(candidate, forms, backend=backend)
        return not outcome.generator_error and bool(outcome.kinds() & kinds)

    return predicate


__all__ = [
    "MAX_DEPTH", "Body", "Failure", "Outcome", "ProgramSpec", "RegionSpec", "Stmt", "build_source",
    "check_model", "check_program", "fails_like", "programs", "reproducer_source", "shrink",
]
