"""The file format of token-free Programs: saving them, and reading back what they are made of, without
pickled code.  This module knows the format, not the classes: ``Program.save`` writes through
:func:`save`, and ``efx.load`` (``effectfx.program.training.load``) builds the Programs from
:func:`load_fields`.

Format (version 1): a zip file with two members.

``program.json``::

    {"format": "effectfx-program", "version": 1, "kind": "program" | "training",
     "program": PROGRAM}                                   # kind "program"
     "forward": PROGRAM, "backward": PROGRAM,              # kind "training"
     "tangent_mask": [bool], "grad_mask": [bool], "covered_by": [[int]]}

    PROGRAM = {"name", "form": "token-free", "n_extra_outputs", "mutations": [input index],
               "history": [[pass, seconds]],
               "signature": {"spec": TREESPEC, "tensors": [[leaf index, META]],
                             "constants": [[index, VALUE]]},
               "out_spec": TREESPEC, "out_layout": [[kind, VALUE]],
               "regions": {id: {"name", "traces", "effects"}},
               "lifted": [tensor name], "root": GRAPH ID, "graphs": {GRAPH ID: GRAPH}}
    GRAPH   = {"class": str, "attrs": {attr: {"graph": GRAPH ID} | {"tensor": tensor name}}, "nodes": [NODE]}
    NODE    = {"name", "op": placeholder|get_attr|call_function|output, "target": TARGET, "args": [VALUE],
               "kwargs": {str: VALUE}, "val": META | null}
    TARGET  = "aten::add.Tensor" (an operator by qualified name and overload) | "operator.getitem" |
              "effectfx.ops.invoke_subgraph" | "effectfx.ops.cond" | "effectfx.ops.while_loop" |
              "effectfx.ops.scan" | attribute / placeholder name
    VALUE   = null | bool | int | float | str | [VALUE] (a list) | {"tuple": [VALUE]} | {"node": name} |
              {"float": "inf"|"-inf"|"nan"} | {"dtype": "float32"} | {"device": "cpu"} |
              {"layout": "strided"} | {"memory_format": "contiguous_format"}
    META    = {"shape": [int], "stride": [int], "dtype": "float32", "device": "cpu", "requires_grad": bool}
    TREESPEC = torch.utils._pytree.treespec_dumps text

``tensors.pt``: ``torch.save`` of a flat ``{name: Tensor}`` dict (loaded with ``weights_only=True``): the
lifted tensors (parameters and buffers) and any tensor attribute of a graph.

Lifted parameters are saved **by value**: the loaded program owns copies and is tied to no module.

Loading executes no code from the file: call targets resolve only to registered ``torch.ops`` operators
(checked to be an ``OpOverload``) or to the allow-list :data:`PYTHON_TARGETS`; an op of a family in
:data:`OP_FAMILIES` (``efx.callback``'s, one per effect key) is defined by its family's code, which checks
its calls (a callback's function is found by name in a module the process imported).  A subgraph shared by
many call sites is saved once and stays shared after loading.
"""

from __future__ import annotations

import io
import json
import math
import operator
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import treespec_dumps, treespec_loads

from .. import ops
from ..errors import SerializationError
from ..graph.build import Graph, graph_module
from ..graph.symbols import SIZE_TARGETS, SYM_TYPES
from ..graph.traced import Kind, OutputKind, OutputLeaf, TensorMeta
from .records import Form, InputSignature, PassRecord, RegionEntry

FORMAT = "effectfx-program"
VERSION = 1
# the higher-order ops by their table names (subgraphs are get_attr nodes, operands tuples of nodes); the
# token ops never appear in the token-free form
PYTHON_TARGETS: dict[str, Any] = {"operator.getitem": operator.getitem, **SIZE_TARGETS,
                                  **{spec.name: op for op, spec in ops.HOPS.items()}}
_PYTHON_NAMES = {id(v): k for k, v in PYTHON_TARGETS.items()}
_ENUMS: dict[str, tuple[type, dict[str, Any]]] = {
    "layout": (torch.layout, {str(v).removeprefix("torch."): v for v in (torch.strided, torch.sparse_coo)}),
    "memory_format": (torch.memory_format, {
        str(v).removeprefix("torch."): v
        for v in (torch.contiguous_format, torch.channels_last, torch.preserve_format, torch.channels_last_3d)
    }),
}


# -- saving ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OpFamily:
    """The ops of one namespace, defined on first use by name (``effectfx.interposers.callback_op``: one op
    per effect key).  A file naming one defines it again (``define(op name)``) before resolving it;
    ``on_save(node)`` and ``on_load(args)`` refuse a call the file cannot hold or this process cannot run."""

    define: Callable[[str], Any]
    on_save: Callable[[fx.Node], None]
    on_load: Callable[[tuple], None]


OP_FAMILIES: dict[str, OpFamily] = {}  # op namespace -> its family


def _family(target: Any) -> OpFamily | None:
    return OP_FAMILIES.get(target.namespace) if isinstance(target, torch._ops.OpOverload) else None


class _Saver:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.graph_ids: dict[int, str] = {}
        self.graphs: dict[str, dict] = {}

    def tensor(self, t: torch.Tensor, prefix: str) -> str:
        name = f"{prefix}{len(self.tensors)}"
        self.tensors[name] = t.detach().clone()
        return name

    def program(self, prog: Any, prefix: str) -> dict:
        if prog.state_writes:
            raise SerializationError(
                f"{prog.name!r} is a training step: it writes gradients and optimizer state of live "
                "objects after each run (Note [Training step]), which a file cannot hold. Save the model's "
                "and the optimizer's state_dict() instead, and compile the step again after loading them."
            )
        if prog.python_state is not None:
            raise SerializationError(
                f"{prog.name!r} writes Python state of live objects after each run (Note [Python state]: "
                f"{', '.join(w.what for w in prog.python_state.writes[:3])}), which a file cannot hold. Save "
                "the program of code that returns those values instead."
            )
        if prog.input_hooks:
            raise SerializationError(
                f"{prog.name!r} registers tensor hooks (Python functions) on its inputs at each run "
                "(effectfx.interposers.tensor_hooks), which a file cannot hold. Register them outside."
            )
        if prog.form is not Form.TOKEN_FREE:
            raise SerializationError(
                f"{prog.name!r} is in the {prog.form} form; only the token-free form is saved. Run "
                "efx.remove_effect_tokens(prog) first (or use a program from efx.compile)."
            )
        self.graphs = {}
        root = self.graph(prog.graph_module)
        return {
            "name": prog.name, "form": prog.form.value, "n_extra_outputs": prog.n_extra_outputs,
            "mutations": list(prog.mutations),
            "history": [[r.name, r.seconds] for r in prog.history],
            "signature": {
                "spec": _dumps_spec(prog.signature.spec),
                "tensors": [[i, _meta(m)] for i, m in prog.signature.tensor_meta],
                "constants": [[i, _value(v)] for i, v in prog.signature.constants],
                "aliases": list(prog.signature.aliases),
                "views": list(prog.signature.views),
                "shape_guards": list(prog.signature.shape_guards),
            },
            "out_spec": _dumps_spec(prog.out_spec),
            "out_layout": [[kind.value, _value(v)] for kind, v in prog.out_layout],
            "regions": {ident: {"name": e.name, "traces": e.traces,
                                "effects": sorted(e.effects) if e.effects is not None else None}
                        for ident, e in prog.regions.items()},
            "lifted": [self.tensor(t, f"{prefix}lifted.") for t in prog.lifted],
            "root": root, "graphs": self.graphs,
        }

    def graph(self, gm: fx.GraphModule) -> str:
        if id(gm) in self.graph_ids and self.graph_ids[id(gm)] in self.graphs:
            return self.graph_ids[id(gm)]
        gid = self.graph_ids[id(gm)] = f"g{len(self.graph_ids)}"
        entry: dict[str, Any] = {"class": type(gm).__name__, "attrs": {}, "nodes": []}
        self.graphs[gid] = entry
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                value = getattr(gm, node.target)
                entry["attrs"][node.target] = (
                    {"graph": self.graph(value)} if isinstance(value, fx.GraphModule)
                    else {"tensor": self.tensor(value, "attr.")} if isinstance(value, torch.Tensor)
                    else _unsupported_constant(node, value)
                )
            entry["nodes"].append(self.node(node))
        return gid

    def node(self, node: fx.Node) -> dict:
        if node.op not in ("placeholder", "get_attr", "call_function", "output"):
            _unsupported(f"node {node.name} with op {node.op}")
        target: Any = node.target
        if node.op == "call_function":
            target = _target_name(target, node)
            if (family := _family(node.target)) is not None:
                family.on_save(node)
        val = node.meta.get("val")
        return {"name": node.name, "op": node.op, "target": target,
                "args": [_value(a) for a in node.args],
                "kwargs": {k: _value(v) for k, v in node.kwargs.items()},
                "val": _meta(TensorMeta.of(val)) if isinstance(val, torch.Tensor) else None}  # (a size: None)


def _unsupported(what: str) -> Any:
    raise SerializationError(f"cannot save {what}: the program format has no encoding for it.")


def _unsupported_constant(node: fx.Node, value: Any) -> Any:
    """Refuse a program constant that is not a tensor (a ProcessGroup, a torchbind object), naming it, the
    ops that use it and the user's line."""
    what = type(value).__name__
    if isinstance(value, torch.ScriptObject):
        what = f"torchbind object {value._type().qualified_name()}"
    users = [u.args[1] if u.target is ops.with_effects else u.target for u in node.users]
    names = sorted({str(t) for t in users}) or ["nothing"]
    where = next((u.meta["location"] for u in node.users if u.meta.get("location")), None)
    raise SerializationError(
        f"cannot save the program constant {node.target!r}: a {what}, passed to {', '.join(names)}"
        + (f" at {where}" if where else "") + ". It exists only in this process (a process group, a "
        "torchbind object) and the program format stores graphs and tensors. Keep this program in memory "
        "(efx.compile or the Program itself) instead of saving it."
    )


def _target_name(target: Any, node: fx.Node) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target._schema.name}.{target._overloadname}"
    name = _PYTHON_NAMES.get(id(target))
    if name is None:
        _unsupported(f"the call target {target!r} of {node.name} (only torch.ops operators and "
                     f"{sorted(PYTHON_TARGETS)} are allowed)")
    return name  # type: ignore[return-value]


def _value(v: Any) -> Any:
    if isinstance(v, fx.Node):
        return {"node": v.name}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": str(v)}
    if isinstance(v, list):
        return [_value(x) for x in v]
    if isinstance(v, tuple):
        return {"tuple": [_value(x) for x in v]}
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    for kind, (cls, _) in _ENUMS.items():
        if isinstance(v, cls):
            return {kind: str(v).removeprefix("torch.")}
    return _unsupported(f"the value {v!r} ({type(v).__name__})")


def _meta(m: TensorMeta) -> dict:
    # a symbolic size is saved as its expression ("s27*8"): a loaded program checks it by its shape guards
    return {"shape": _dims(m.shape), "stride": _dims(m.stride), "dtype": str(m.dtype).removeprefix("torch."),
            "device": str(m.device), "requires_grad": m.requires_grad}


def _dims(values: tuple) -> list:
    return [str(v) if isinstance(v, SYM_TYPES) else v for v in values]


def _dumps_spec(spec: Any) -> str:
    try:
        return treespec_dumps(spec)
    except Exception as e:  # types pytree cannot serialize (user classes)
        raise SerializationError(f"cannot save the argument/result structure {spec}: {e}") from e


def save(prog: Any, path: str | Path) -> None:
    """Write a token-free Program or TrainingProgram (which has a ``backward`` Program) to ``path`` (see the
    module docstring for the format)."""
    saver = _Saver()
    doc: dict[str, Any] = {"format": FORMAT, "version": VERSION}
    if hasattr(prog, "backward"):
        doc.update(kind="training", forward=saver.program(prog.forward, "forward."),
                   backward=saver.program(prog.backward, "backward."),
                   tangent_mask=list(prog.tangent_mask), grad_mask=list(prog.grad_mask),
                   covered_by=[sorted(c) for c in prog.covered_by])
    else:
        doc.update(kind="program", program=saver.program(prog, ""))
    buffer = io.BytesIO()
    torch.save(saver.tensors, buffer)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("program.json", json.dumps(doc, indent=1))
        zf.writestr("tensors.pt", buffer.getvalue())


# -- loading --------------------------------------------------------------------------------------
def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise SerializationError(f"unknown dtype {name!r} in the file.")
    return value


def _named(kind: type[Kind], name: str) -> Any:
    """The member of a string-valued enum (a form, an output leaf's kind) the file names."""
    try:
        return kind(name)
    except ValueError:
        raise SerializationError(f"unknown {kind.__name__} {name!r} in the file.") from None


def _load_value(v: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(v, list):
        return [_load_value(x, env) for x in v]
    if not isinstance(v, dict):
        return v
    (kind, payload), = v.items()
    if kind == "node":
        return env[payload]
    if kind == "tuple":
        return tuple(_load_value(x, env) for x in payload)
    if kind == "float":
        return float(payload)
    if kind == "dtype":
        return _dtype(payload)
    if kind == "device":
        return torch.device(payload)
    if kind in _ENUMS:
        return _ENUMS[kind][1][payload]
    raise SerializationError(f"unknown value encoding {kind!r} in the file.")


def _load_target(name: str) -> Any:
    if name in PYTHON_TARGETS:
        return PYTHON_TARGETS[name]
    if "::" not in name or "." not in name.split("::", 1)[1]:
        raise SerializationError(f"call target {name!r} is neither a torch operator nor allowed.")
    ns, rest = name.split("::", 1)
    op_name, overload = rest.rsplit(".", 1)
    if ns in OP_FAMILIES:
        OP_FAMILIES[ns].define(op_name)
    try:
        op = getattr(getattr(getattr(torch.ops, ns), op_name), overload)
    except (AttributeError, RuntimeError) as e:
        raise SerializationError(
            f"operator {name!r} is not registered; import the library that defines it before loading."
        ) from e
    if not isinstance(op, torch._ops.OpOverload):
        raise SerializationError(f"{name!r} is not an operator overload.")
    return op


def _load_meta(m: dict) -> TensorMeta:
    return TensorMeta(tuple(m["shape"]), tuple(m["stride"]), _dtype(m["dtype"]), torch.device(m["device"]),
                      bool(m["requires_grad"]))


class _Loader:
    def __init__(self, doc: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.doc = doc
        self.tensors = tensors
        self.built: dict[str, fx.GraphModule] = {}

    def graph(self, gid: str) -> fx.GraphModule:
        if gid in self.built:
            return self.built[gid]
        spec = self.doc["graphs"][gid]
        holder = torch.nn.Module()
        for attr, ref in spec["attrs"].items():
            value = self.graph(ref["graph"]) if "graph" in ref else self.tensors[ref["tensor"]]
            setattr(holder, attr, value)
        graph = Graph()
        env: dict[str, fx.Node] = {}
        for n in spec["nodes"]:
            target = _load_target(n["target"]) if n["op"] == "call_function" else n["target"]
            args = tuple(_load_value(a, env) for a in n["args"])
            kwargs = {k: _load_value(v, env) for k, v in n["kwargs"].items()}
            if n["op"] == "call_function" and (family := _family(target)) is not None:
                family.on_load(args)
            if n["op"] == "output":
                node = graph.output(args[0])
            else:
                node = graph.create_node(n["op"], target, args, kwargs, name=n["name"])
            if n["val"] is not None and not (m := _load_meta(n["val"])).symbolic:
                node.meta["val"] = torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")
            env[n["name"]] = node
        gm = graph_module(holder, graph, spec["class"])
        gm.runtime_calls = "direct"  # a loaded program is token-free and runs as efx.compile's graphs do
        gm.meta["effectfx_token_keys"] = ()
        self.built[gid] = gm
        return gm

    def program(self, p: dict) -> dict[str, Any]:
        """The fields of the Program ``p`` describes, as ``Program(**fields)`` takes them."""
        self.doc = p
        self.built = {}
        sig = p["signature"]
        signature = InputSignature(
            treespec_loads(sig["spec"]),
            tuple((i, _load_meta(m)) for i, m in sig["tensors"]),
            tuple((i, _load_value(v, {})) for i, v in sig["constants"]),
            tuple(sig.get("aliases", ())),
            tuple(sig.get("views", ())),
            tuple(sig.get("shape_guards", ())),
        )
        return dict(
            graph_module=self.graph(p["root"]), signature=signature,
            lifted=tuple(self.tensors[n] for n in p["lifted"]), out_spec=treespec_loads(p["out_spec"]),
            out_layout=tuple(OutputLeaf(_named(OutputKind, kind), _load_value(v, {}))
                             for kind, v in p["out_layout"]),
            form=_named(Form, p["form"]),
            token_keys=(),
            regions={ident: RegionEntry(r["name"], r["traces"],
                                        frozenset(r["effects"]) if r["effects"] is not None else None)
                     for ident, r in p["regions"].items()},
            history=(*(PassRecord(name, s) for name, s in p["history"]), PassRecord("load", 0.0)),
            n_extra_outputs=p["n_extra_outputs"], name=p["name"], mutations=tuple(p.get("mutations", ())),
        )


def load_fields(path: str | Path) -> tuple[str, Any]:
    """What the program file at ``path`` holds: ``("program", fields)`` or ``("training", (forward fields,
    backward fields, the TrainingProgram's own))``; runs no code from the file (module docstring)."""
    with zipfile.ZipFile(path) as zf:
        doc = json.loads(zf.read("program.json"))
        tensors = torch.load(io.BytesIO(zf.read("tensors.pt")), weights_only=True)
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise SerializationError(f"{path} is not an effectfx program file of version {VERSION}.")
    loader = _Loader(doc, tensors)
    if doc["kind"] == "training":
        return "training", (loader.program(doc["forward"]), loader.program(doc["backward"]), dict(
            tangent_mask=tuple(doc["tangent_mask"]), grad_mask=tuple(doc["grad_mask"]),
            covered_by=tuple(frozenset(c) for c in doc.get("covered_by", ()))))
    return "program", loader.program(doc["program"])
