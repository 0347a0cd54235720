"""Generated programs as data: the description, and the standalone Python source it prints as.

A program is a plain data description (:class:`ProgramSpec`) that prints as standalone Python source
(:meth:`ProgramSpec.source`) -- the same text is executed to build the callable, so a printed reproducer is
exactly what ran.  A program is an ``nn.Module`` whose ``forward`` is the program body; its regions are
``@efx.region`` methods, ``@efx.region`` functions taking the module, or plain ``@efx.region`` functions
(which read closed-over constant tensors instead of parameters).  A region may also take a list of tensors
``xs``, which it reads (``xs[-1]``, ``torch.stack(xs)``) or changes (``xs.append(v)``: the caller's list
is updated as in eager, Note [Mutations]); :meth:`ProgramSpec.refusal` names the error a program must raise.

State is updated in place (Note [Mutations]): the program module and a ``Block`` get buffers (``buf``, a
float vector, and ``calls``, an int64 counter) and a ``BatchNorm1d`` in training when a body on them uses
them; bodies update them (a running average, a count, a copy), run the BatchNorm, and read the state
afterwards (effect ops, prints, values).  A body may update a tensor argument or a fresh intermediate in
place (``x.add_(v)``, ``x.mul_(2.0)``, through a view ``x[0].add_(1.0)``); a region updating its argument
updates its caller's tensor, an intermediate with grad or an input.  Updating an input that is a leaf
requiring grad is refused, by eager and effectfx alike.

Every value has shape ``(B, D)``, so any op can feed any other.  How programs are drawn is
``effectfx.testing.generator``; how they are run against eager and minimized is ``effectfx.testing.checking``.
"""

from __future__ import annotations

import dataclasses
import itertools
import linecache
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .module_hooks import CHILDREN, HookSpec

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
# random ops at dropout's default probability, and activation checkpointing around them (Note [Random
# numbers]): every system starts from one generator state, which is compared after every call
RANDOM = {
    "dropout": "torch.nn.functional.dropout({a}, 0.5)",
    "checkpoint": "torch.utils.checkpoint.checkpoint(lambda t: torch.nn.functional.dropout(t.sin(), 0.5) "
                  "* t, {a}, use_reentrant=False)",
    "fresh": "torch.utils.checkpoint.checkpoint(lambda t: torch.nn.functional.dropout(t, 0.5).cos(), {a}, "
             "use_reentrant=False, preserve_rng_state=False)",
}
# Python print, in the shapes people write it ({p}: the printed tensor, {label}: a string)
PRINTS = {
    "plain": 'print("{label}", {p})',
    "fstring": 'print(f"{label}: {{{p}}}")',
    "stats": 'print("{label}", {p}.sum(), tuple({p}.shape), sep=" | ")',
    "format": 'print(f"{label} mean={{{p}.mean():.3f}}", end="!\\n")',
    "stderr": 'print("{label}", {p}, file=sys.stderr, flush=True)',
}
# reading the list argument ``xs`` (of ``RegionSpec.list_len`` tensors), and changing it (refused)
ITEMS = {"index": "xs[{j}]", "stack": "torch.stack(xs).sum(0)"}
CHANGES = {"append": "xs.append({a})", "setitem": "xs[0] = {a} * 1.0"}  # always a new object
# the module's state (Note [Mutations]): ``{m}.buf`` (a float vector), ``{m}.calls`` (an int64 counter),
# ``{m}.bn`` (a BatchNorm1d in training) -- of the program module, or of a Block for ``Block.step``
BUFFERS = {  # updated in place; a running average of values that may require grad reads them detached
    "ema": "{m}.buf.mul_(0.9).add_({a}.detach().mean(0) * 0.1)",
    "count": "{m}.calls.add_(1)",
    "copy": "{m}.buf.copy_({a}[0].detach())",
}
BUFFER_READS = {  # what reads the state after its updates: effect ops, prints, values
    "ping": 'torch.ops.efxfuzz.ping({m}.buf * {m}.calls, "{label}")',
    "print": 'print("{label}", {m}.buf, {m}.calls)',
    "use": "{out} = {a} + {m}.buf * {m}.calls",
    "bnstat": 'torch.ops.efxfuzz.ping({m}.bn.running_mean + {m}.bn.running_var, "{label}")',
    "bnprint": 'print("{label}", {m}.bn.running_var, {m}.bn.num_batches_tracked)',
}
# updating a tensor argument (or a fresh intermediate) in place: {a} the updated tensor
MUTATIONS = {
    "add": "{a}.add_({b})",
    "mul": "{a}.mul_({s})",
    "view": "{a}[0].add_({s})",  # through a view: the base sees it
}
# effect ops by key: (name, template, has output); "ordered" ones may appear in any program
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
    "ordered": [  # effectfx.testing.fuzz_ops
        ("ping", 'torch.ops.efxfuzz.ping({a}, "{label}")', False),  # never registered, returns nothing
        ("logged", 'torch.ops.efxfuzz.logged({a}, "{label}")', True),  # CompositeImplicitAutograd kernel
        # efx.callback (Note [Callbacks]): of a Python function, no op; the second on a key of its own
        ("noted", 'efx.callback(effectfx.testing.effect_ops.noted, {a}, "{label}")', False),
        ("shifted", 'efx.callback(effectfx.testing.effect_ops.shifted, {a}, "{label}", key="stdout", '
                    'result_shape={a})', True),
    ],
}
# effect ops reading ``a``
TENSOR_EFFECTS = frozenset({"bump", "scale", "log_tensor", "ping", "logged", "noted", "shifted"})
CALL_KINDS = ("call", "unused", "chain", "loop", "nograd")
REGION_STYLES = ("method", "module_fn", "function")


# -- the description ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stmt:
    """One statement of a body.

    kind: "unary", "binary", "reduce", "matmul", "inplace", "detach", "scalar", "effect", "print", "item"
    (reads the list argument), "change" (changes it), "blocks", "buffer" (updates the module's state),
    "bufread" (reads it), "bn" (the module's BatchNorm1d), "mutate" (updates ``args[0]`` in place), "child"
    (calls the child module ``op`` of CHILDREN) or one of CALL_KINDS ("blocks" with op "call" calls each
    block as a module, running its hooks; op "blocks" calls its region method ``step``).  op: the table entry
    (or region name for calls, or effect op name); args: variables read; outs: variables assigned; label:
    effect or print label; value: scale factor / loop count / list index; weight: the matrix of a matmul
    ("w0" a module parameter, "C0" a closed-over constant); items: the list passed to a region taking one.
    kind "random": dropout, checkpointed or not (op: an entry of RANDOM).
    """

    kind: str
    op: str
    args: tuple[str, ...]
    outs: tuple[str, ...] = ()
    label: str = ""
    value: float = 0.0
    weight: str = ""
    s: float | None = None  # calls of a region with a number parameter: the value passed as ``s=``
    items: tuple[str, ...] = ()

    def renamed(self, names: dict[str, str]) -> Stmt:
        return dataclasses.replace(self, args=tuple(names.get(a, a) for a in self.args),
                                   items=tuple(names.get(a, a) for a in self.items))


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
    list_len: int = 0  # takes a list ``xs`` of this many tensors too (0: no list)


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
    hooks: tuple[HookSpec, ...] = ()

    # -- inspection ----------------------------------------------------------------------------------
    def region(self, name: str) -> RegionSpec:
        return next(r for r in self.regions if r.name == name)

    def bodies(self) -> Iterator[tuple[str, Body]]:
        yield "forward", self.forward
        for r in self.regions:
            yield r.name, r.body
        if self.block_body is not None:
            yield "step", self.block_body

    def _calls(self, body: Body) -> Iterator[Stmt]:
        return (s for s in body.stmts if s.kind in CALL_KINDS)

    def depth(self) -> int:
        """The deepest region nesting reached from forward (0: no region calls)."""

        @_memo
        def height(name: str) -> int:
            return 1 + max((height(s.op) for s in self._calls(self.region(name).body)), default=0)

        step = 1 + max((height(s.op) for s in self._calls(self.block_body)), default=0) \
            if self.block_body is not None else 0
        return max((height(s.op) if s.kind in CALL_KINDS else step for s in self.forward.stmts
                    if s.kind in CALL_KINDS or s.kind == "blocks"), default=0)

    def reached(self) -> set[str]:
        """The regions a run calls (through forward, and the blocks' shared method when forward runs them)."""
        runs_blocks = any(s.kind == "blocks" for s in self.forward.stmts)
        bodies = (self.forward, self.block_body if runs_blocks else None)
        todo = [s.op for b in bodies if b is not None for s in self._calls(b)]
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(s.op for s in self._calls(self.region(name).body))
        return seen

    def children(self, owner: str) -> list[str]:
        """The child modules (CHILDREN) of the ``owner`` ("block" or "model"): those its bodies call and those
        a hook is on."""
        bodies = (self.block_body,) if owner == "block" else self.module_bodies()
        used = {s.op for b in bodies if b is not None for s in b.stmts if s.kind == "child"}
        prefix = "blocks." if owner == "block" else ""
        used |= {h.target[len(prefix):] for h in self.hooks if h.target in {prefix + c for c in CHILDREN}}
        return [c for c in CHILDREN if c in used]

    def sequence(self) -> int:
        """How many calls the sequence the harness changes hooks between has (0: no hook changes)."""
        last = max((max(h.added, h.removed) for h in self.hooks), default=0)
        return last + 1 if last else 0

    def mutated(self, body: Body) -> set[str]:
        """The parameters of ``body`` it updates in place, itself or through a region it calls."""
        return mutated_params(body, self.region)

    def stateful(self, bodies: tuple[Body | None, ...]) -> tuple[bool, bool]:
        """Whether the module these bodies run on needs its buffers (``buf``, ``calls``) and its BatchNorm."""
        stmts = [s for b in bodies if b is not None for s in b.stmts]
        bn = any(s.kind == "bn" or s.op in ("bnstat", "bnprint") for s in stmts)
        return any(s.kind in ("buffer", "bufread") and not s.op.startswith("bn") for s in stmts), bn

    def module_bodies(self) -> tuple[Body, ...]:
        """The bodies running on the program module (its ``forward`` and the regions taking it)."""
        return (self.forward, *(r.body for r in self.regions if r.style != "function"))

    def arguments(self, body: Body) -> set[str]:
        """The names of a region's ``body`` that may be its caller's tensors: its parameters, items of its
        list, and what a region it calls hands back unchanged."""
        found = set(body.params)
        for s in body.stmts:
            if (s.kind == "item" and s.op == "index") or (s.kind, s.op) == ("child", "ident"):
                found.update(s.outs)  # (a child Identity hands back what it is given)
            elif s.kind in CALL_KINDS:
                callee = self.region(s.op).body
                through = self.arguments(callee)
                found.update(out for out, ret in zip(s.outs, callee.returns) if ret in through)
        return found

    def refusal(self) -> str | None:
        """The error effectfx must raise on this program instead of running it, if any: updating an input
        that is a leaf requiring grad, which eager refuses.  (A region changing its list argument is
        written back to the caller's list: Note [Mutations], ``effectfx.program.containers``.)"""
        leaves = {f"x{i}" for i, rg in enumerate(self.inputs) if rg}
        return "UnsupportedMutationError" if self.mutated(self.forward) & leaves else None

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
                found.add(f"effect:{s.op}" if s.kind == "effect" else f"{s.kind}:{s.op}"
                          if s.kind in ("print", "item", "change", "buffer", "bufread", "mutate", "child",
                                        "random")
                          else s.kind)
                if (s.kind, s.op) == ("blocks", "call"):
                    found.add("blocks called as modules")
                if s.kind in CALL_KINDS:
                    calls[s.op] = calls.get(s.op, 0) + (int(s.value) if s.kind == "loop" else
                                                        2 if s.kind == "chain" else 1)
        if any(n > 1 for n in calls.values()):
            found.add("region called many times")
        found.update(f"region:{r.style}" for r in self.regions)
        if any(r.list_len for r in self.regions if r.name in self.reached()):
            found.add("list argument")
        if self.refusal():
            found.add("refused")
        if self.mutated(self.forward):
            found.add("input updated in place")
        if any(self.mutated(r.body) for r in self.regions if r.name in self.reached()):
            found.add("region updates its argument")
        def updates(body: Body | None) -> bool:
            return body is not None and any(s.kind in ("buffer", "bn") for s in body.stmts)

        if any(updates(r.body) for r in self.regions if r.name in self.reached()):
            found.add("region updates buffers")
        if any(s.kind == "blocks" for s in self.forward.stmts) and updates(self.block_body):
            found.add("blocks update their own buffers")
        numbers = {r.name: {s.s for _, b in self.bodies() for s in b.stmts if s.op == r.name}
                   for r in self.regions if r.scalar}
        if any(len(v) > 1 for v in numbers.values()):
            found.add("region called with different numbers")
        if len(set(self.blocks)) == 2:
            found.add("blocks with mixed requires_grad")
        found |= self._hook_features()
        return frozenset(found)

    def _hook_features(self) -> set[str]:
        found = set()
        in_regions = {s.op for r in self.regions if r.name in self.reached() and r.style != "function"
                      for s in r.body.stmts if s.kind == "child"}
        for h in self.hooks:
            found |= {f"hook:{h.kind}", f"hook on {h.target}", f"hook effect:{h.effect or 'none'}"}
            if h.target.startswith("blocks.") or h.target in in_regions:
                found.add("hook inside a region")
            if h.s is not None or h.effect == "bump":
                found.add("hook returns a value")
            if len(h.layers) > 1:
                found.add(f"hook sharing:{h.sharing}")
            if h.added:
                found.add("hook added between calls")
            if h.removed:
                found.add("hook removed between calls")
        return found

    def size(self) -> int:
        return sum(len(b.stmts) + 1 for _, b in self.bodies()) + len(self.inputs) + len(self.weights) \
            + len(self.blocks) + sum(len(h.modules()) for h in self.hooks)



def mutated_params(body: Body, region: Callable[[str], RegionSpec]) -> set[str]:
    """The parameters of ``body`` it updates in place, itself or through a region it calls (``region``
    looks a region up by name)."""
    found = {s.args[0] for s in body.stmts if s.kind == "mutate"}
    for s in body.stmts:
        if s.kind in CALL_KINDS:
            callee = region(s.op).body
            written = mutated_params(callee, region)
            found.update(a for a, p in zip(s.args, callee.params) if p in written)
    return found & set(body.params)


def _memo(fn: Callable[[str], int]) -> Callable[[str], int]:
    cache: dict[str, int] = {}

    def wrapper(name: str) -> int:
        if name not in cache:
            cache[name] = fn(name)
        return cache[name]

    return wrapper


_COUNTER = itertools.count()


def load_source(src: str, filename: str | None = None) -> dict[str, Any]:
    """Execute a program's source in a fresh namespace (new classes, new region objects) and return it."""
    filename = filename or f"<efxfuzz program {next(_COUNTER)}>"
    # register the text so tracebacks and effectfx's "at file:line" messages show the generated code
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"__name__": "efxfuzz_generated"}
    exec(compile(src, filename, "exec"), namespace)  # noqa: S102 - the program under test
    return namespace


def build_source(src: str, variant: int = 0, filename: str | None = None, batch: int | None = None
                 ) -> tuple[torch.nn.Module, tuple]:
    """The model and arguments ``make(variant)`` of a program's source builds; with ``batch``, arguments of
    that batch size (``make`` reads the module-level ``B`` when it runs; the model depends on ``D`` only)."""
    namespace = load_source(src, filename)
    if batch is not None:
        namespace["B"] = batch
    return namespace["make"](variant)
