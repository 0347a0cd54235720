"""How a generated program (``effectfx.testing.program``) prints: the standalone Python source that is
also what runs, so a printed reproducer is exactly what ran."""

from __future__ import annotations

import itertools

import torch

from .module_hooks import CHILDREN, HOOK_EFFECTS, HOOK_KINDS, HookSpec
from .program import (
    BINARY,
    BUFFER_READS,
    BUFFERS,
    CHANGES,
    EFFECT_OPS,
    ITEMS,
    MATMUL,
    MUTATIONS,
    PRINTS,
    RANDOM,
    REDUCE,
    UNARY,
    Body,
    ProgramSpec,
    RegionSpec,
    Stmt,
    build_source,
)


def _call_expr(spec: ProgramSpec, s: Stmt, module_ref: str | None, args: tuple[str, ...]) -> str:
    region = spec.region(s.op)
    joined = ", ".join(args + ((f"[{', '.join(s.items)}]",) if region.list_len else ())
                       + ((f"s={s.s!r}",) if s.s is not None else ()))
    if region.style == "method":
        return f"{module_ref}.{s.op}({joined})"
    if region.style == "module_fn":
        return f"{s.op}({module_ref}, {joined})"
    return f"{s.op}({joined})"


def _weight_expr(weight: str, module_ref: str | None) -> str:
    return weight if weight.startswith("C") else f"{module_ref}.{weight}"  # C0, self.w0, m.w1, self.w


def _stmt_lines(spec: ProgramSpec, s: Stmt, module_ref: str | None, arguments: set[str]) -> list[str]:
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
    if s.kind == "random":
        return [f"{out} = {RANDOM[s.op].format(a=a)}"]
    if s.kind == "item":
        return [f"{out} = {ITEMS[s.op].format(j=int(s.value))}"]
    if s.kind == "change":
        return [CHANGES[s.op].format(a=a)]
    if s.kind == "print":
        # a region's argument is printed detached: eager would show the *caller's* grad_fn, which one body
        # shared by every call cannot know (effectfx warns; see UnfaithfulPrintWarning)
        return [PRINTS[s.op].format(label=s.label, p=f"{a}.detach()" if a in arguments else a)]
    if s.kind == "buffer":
        return [BUFFERS[s.op].format(m=module_ref, a=a)]
    if s.kind == "bufread":
        return [BUFFER_READS[s.op].format(m=module_ref, a=a, out=out, label=s.label)]
    if s.kind == "bn":
        return [f"{out} = {module_ref}.bn({a})"]
    if s.kind == "mutate":
        return [MUTATIONS[s.op].format(a=a, b=s.args[1] if len(s.args) > 1 else "", s=s.value)]
    if s.kind == "blocks":  # every sub-module's region method in turn: one body, N weights
        call = f"blk({out})" if s.op == "call" else f"blk.step({out})"  # as a module: its hooks run
        return [f"{out} = {a}", f"for blk in {module_ref}.blocks:", f"    {out} = {call}"]
    if s.kind == "child":
        return [f"{out} = {module_ref}.{s.op}({a})"]
    if s.kind == "effect":
        template = next(t for name, t, _ in itertools.chain(*EFFECT_OPS.values()) if name == s.op)
        expr = template.format(a=a, label=s.label, s=s.value)
        return [f"{out} = {expr}" if s.outs else expr]
    call = _call_expr(spec, s, module_ref, s.args)
    if s.kind == "unused":
        return [call]
    if s.kind == "call":
        return [f"{out} = {call}" if s.outs else call]
    if s.kind == "chain":
        return [f"{out} = {_call_expr(spec, s, module_ref, (call,))}"]
    if s.kind == "loop":
        return [f"{out} = {a}", f"for _ in range({int(s.value)}):",
                f"    {out} = {_call_expr(spec, s, module_ref, (out,))}"]
    if s.kind == "nograd":
        return ["with torch.no_grad():", f"    {out} = {call}" if s.outs else f"    {call}"]
    raise ValueError(f"unknown statement kind {s.kind!r}")


def _body_lines(spec: ProgramSpec, body: Body, module_ref: str | None, indent: str,
                region: bool = True) -> list[str]:
    lines, arguments = [], spec.arguments(body) if region else set()
    for s in body.stmts:
        lines.extend(indent + line for line in _stmt_lines(spec, s, module_ref, arguments))
    lines.append(indent + ("return " + ", ".join(body.returns) if body.returns else "return None"))
    return lines


def _params(r: RegionSpec, first: tuple[str, ...] = ()) -> str:
    extra = (("xs",) if r.list_len else ()) + (("s=1.0",) if r.scalar else ())
    return ", ".join(first + r.body.params + extra)


def _state_lines(spec: ProgramSpec, bodies: tuple[Body | None, ...], indent: str) -> list[str]:
    buffers, bn = spec.stateful(bodies)
    lines = []
    if buffers:
        lines += [f'{indent}self.register_buffer("buf", torch.randn(D, generator=g))',
                  f'{indent}self.register_buffer("calls", torch.zeros((), dtype=torch.int64))']
    if bn:
        lines.append(f"{indent}self.bn = torch.nn.BatchNorm1d(D)")
    return lines


def _children_lines(spec: ProgramSpec, owner: str) -> list[str]:
    return [f"        self.{c} = {CHILDREN[c]}" for c in spec.children(owner)]


def _module_expr(path: str) -> str:
    """``model.blocks[0].lin`` for the path ``blocks.0.lin`` (``model`` for ``model``)."""
    if path == "model":
        return "model"
    return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split("."))


def _hook_lines(spec: ProgramSpec, i: int, h: HookSpec) -> list[str]:
    """The factory of hook ``i``: ``hook<i>(name, s)`` makes the function registered (a closure over the
    label and the number)."""
    params = HOOK_KINDS[h.kind][1]
    many = h.target == "model" and h.kind == "forward" and len(spec.forward.returns) > 1  # ``out``: a tuple
    got = {"forward": "out", "pre": "args", "backward": "grad_input"}[h.kind]
    t = {"forward": "out[0]" if many else "out", "pre": "args[0]", "backward": "g"}[h.kind]
    seen = {"forward": "out", "pre": "args[0]", "backward": "grad_output"}[h.kind]
    does = [{"": "", "log": f"logs {seen}", "record": "records its name", "ping": f"pings {seen}",
             "bump": f"bumps {seen}"}[h.effect]]
    does += [f"returns {'grad_input' if h.kind == 'backward' else seen} times s"] if h.s is not None else []
    what = {"forward": "forward hook", "pre": "forward pre-hook", "backward": "full backward hook"}[h.kind]
    lines = ["", "", f"def hook{i}(name, s):",
             f'    """A {what} on {h.target}: {", ".join(d for d in does if d)}."""',
             f"    def hook({params}):"]
    body: list[str] = []
    if h.effect:
        call = HOOK_EFFECTS[h.effect][0].format(t=t)
        if h.effect == "bump":  # replaces the tensor it got
            rest = "" if t == "out" else f", *{got}[1:]"
            body.append(f"{got} = {call}" if t == "out" else f"{got} = ({call}{rest})")
        elif h.kind == "backward" and "{t}" in HOOK_EFFECTS[h.effect][0]:
            body += ["for g in grad_output:", "    if g is not None:", f"        {call}"]
        else:
            body.append(call)
    if h.s is not None:
        body.append({"forward": "return tuple(o * s for o in out)" if many else "return out * s",
                     "pre": "return (args[0] * s, *args[1:])",
                     "backward": "return tuple(None if g is None else g * s for g in grad_input)"}[h.kind])
    elif h.effect == "bump":
        body.append(f"return {got}")
    lines += [f"        {line}" for line in body or ["pass"]]
    return lines + ["    return hook"]


def _register_lines(spec: ProgramSpec) -> list[str]:
    lines = ["", "", "def register(model, hook):",
             '    """Registers hook ``hook`` on its modules; returns the handles (make, between call it)."""']
    for i, h in enumerate(spec.hooks):
        method = HOOK_KINDS[h.kind][0]
        lines.append(f"    if hook == {i}:")
        if h.sharing == "one" and len(h.layers) > 1:
            made = f'hook{i}("hook{i} {h.target}", {h.s!r})'
            lines.append(f"        shared = {made}  # one function on every layer")
        calls = []
        for layer, path in h.modules():
            if h.sharing == "one" and len(h.layers) > 1:
                made = "shared"
            else:  # "own": the layer's path and number; "equal": the same values on every layer
                own = layer is None or h.sharing == "own"
                number = h.s * (layer + 1) if own and layer is not None and h.s is not None else h.s
                made = f'hook{i}("hook{i} {path if own else h.target}", {number!r})'
            calls.append(f"{_module_expr(path)}.{method}({made})")
        lines.append("        return [" + (",\n                ".join(calls)) + "]")
    lines.append("    raise ValueError(hook)")
    return lines


def _between_lines(spec: ProgramSpec) -> list[str]:
    lines = ["", "", "def between(model, call):",
             '    """Before call ``call`` (1, 2, ...) of a sequence the harness registers and removes hooks,',
             '    on the eager model and on the compiled one alike (effectfx.testing.sequence)."""']
    for call in range(1, spec.sequence()):
        removed = [i for i, h in enumerate(spec.hooks) if h.removed == call]
        added = [i for i, h in enumerate(spec.hooks) if h.added == call]
        if removed or added:
            lines.append(f"    if call == {call}:")
        for i in removed:
            lines += [f"        for handle in model.hook_handles.pop({i}):", "            handle.remove()"]
        lines += [f"        model.hook_handles[{i}] = register(model, {i})" for i in added]
    return lines


def _hooks_lines(spec: ProgramSpec) -> list[str]:
    if not spec.hooks:
        return []
    lines = [line for i, h in enumerate(spec.hooks) for line in _hook_lines(spec, i, h)]
    lines += _register_lines(spec)
    return lines + (_between_lines(spec) if spec.sequence() else [])


def render(spec: ProgramSpec) -> str:
    lines = [
        '"""A program generated by effectfx.testing.generator (python -m effectfx fuzz)."""',
        "import sys",
        "",
        "import torch",
        "",
        "import effectfx as efx",
        "import effectfx.testing  # noqa: F401  (registers the efxtest:: effect ops)",
        "import effectfx.testing.fuzz_ops  # noqa: F401  (registers the efxfuzz:: ops)",
        "",
        f"B, D = {spec.batch}, {spec.width}",
        f"_g = torch.Generator().manual_seed({spec.seed})",
    ]
    lines += [f"C{i} = torch.randn(D, D, generator=_g) / D ** 0.5" for i in range(spec.constants)]
    if "lin" in spec.children("block") + spec.children("model"):
        lines += ["", "", "def linear(g):", '    """A torch.nn.Linear(D, D) with weights from ``g``."""',
                  "    lin = torch.nn.utils.skip_init(torch.nn.Linear, D, D)", "    with torch.no_grad():",
                  "        lin.weight.copy_(torch.randn(D, D, generator=g) / D ** 0.5)",
                  "        lin.bias.copy_(torch.randn(D, generator=g) / D ** 0.5)", "    return lin"]
    for r in spec.regions:
        if r.style == "method":
            continue
        module = ("m",) if r.style == "module_fn" else ()
        lines += ["", "", "@efx.region", f"def {r.name}({_params(r, module)}):"]
        lines += _body_lines(spec, r.body, "m" if r.style == "module_fn" else None, "    ")
    if spec.block_body is not None:
        lines += ["", "", "class Block(torch.nn.Module):", "    def __init__(self, seed, requires_grad):",
                  "        super().__init__()", "        g = torch.Generator().manual_seed(seed)",
                  "        self.w = torch.nn.Parameter(torch.randn(D, D, generator=g) / D ** 0.5, "
                  "requires_grad=requires_grad)", *_state_lines(spec, (spec.block_body,), "        "),
                  *_children_lines(spec, "block"), "", "    @efx.region",
                  f"    def step(self, {', '.join(spec.block_body.params)}):"]
        lines += _body_lines(spec, spec.block_body, "self", "        ")
        lines += ["", "    forward = step  # blk(x): the region, with the module's hooks around it"]
    lines += ["", "", "class Fuzzed(torch.nn.Module):", "    def __init__(self):",
              "        super().__init__()", f"        g = torch.Generator().manual_seed({spec.seed + 1})"]
    if spec.blocks:
        blocks = ", ".join(f"Block({spec.seed + 10 + i}, {rg})" for i, rg in enumerate(spec.blocks))
        lines.append(f"        self.blocks = torch.nn.ModuleList([{blocks}])")
    for i, rg in enumerate(spec.weights):
        lines.append(f"        self.w{i} = torch.nn.Parameter(torch.randn(D, D, generator=g) / D ** 0.5, "
                     f"requires_grad={rg})")
    lines += _state_lines(spec, spec.module_bodies(), "        ")
    lines += _children_lines(spec, "model")
    for r in spec.regions:
        if r.style == "method":
            lines += ["", "    @efx.region", f"    def {r.name}({_params(r, ('self',))}):"]
            lines += _body_lines(spec, r.body, "self", "        ")
    lines += ["", f"    def forward(self, {', '.join(spec.forward.params)}):"]
    lines += _body_lines(spec, spec.forward, "self", "        ", region=False)
    lines += _hooks_lines(spec)
    lines += ["", "", "def make(variant=0):", "    model = Fuzzed()",
              f"    g = torch.Generator().manual_seed({spec.seed + 2} + 1000 * variant)",
              "    args = ("]
    lines += [f"        torch.randn(B, D, generator=g).requires_grad_({rg})," for rg in spec.inputs]
    lines.append("    )")
    if spec.hooks:
        first = tuple(i for i, h in enumerate(spec.hooks) if not h.added)
        lines.append(f"    model.hook_handles = {{hook: register(model, hook) for hook in {first!r}}}"
                     if first else "    model.hook_handles = {}")
    lines += ["    return model, args", ""]
    return "\n".join(lines)


def build(spec: ProgramSpec, variant: int = 0, filename: str | None = None) -> tuple[torch.nn.Module, tuple]:
    """Execute :func:`render`'s source in a fresh namespace: a new module class and new region objects
    every time.  ``variant`` picks different input values of the same signature."""
    return build_source(render(spec), variant, filename)
