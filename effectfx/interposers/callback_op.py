"""The effect op a call of ``efx.callback`` becomes (Note [Callbacks], ``effectfx.interposers.callback``), one
op per effect key::

    effectfx_callback::on_<key>(str fn, str args, Tensor[] tensors, str results) -> Tensor[]

* ``fn`` names the function: ``"module:qualname"`` when that name finds it, looked up when the op runs (a
  loaded program finds it in the loading process, whose code imported the module first, as it imports the
  library of any custom op); else ``"<qualname>#<n>"``, an entry of this process's registry (a lambda, a
  closure, a bound method), which a program file cannot hold;
* ``args`` is the call's ``[args, kwargs]`` as JSON, plain values baked in (None, bool, int, float, str,
  dtypes, devices, and lists, tuples and dicts of them), each tensor a slot ``{"tensor": i}`` standing for
  ``tensors[i]``;
* ``results`` is ``result_shape`` as JSON, each tensor ``{"result": [shape, dtype, device]}``; ``""``: none.

The effect registry is per op, so each key gets an op of its own, defined on first use (as collectives get
one per process group, ``effectfx.interposers.collectives``).  Its name spells the key reversibly (``_``
doubled, every other character that is not a letter or digit as ``_`` and two hex digits:
``collective:tp`` is ``on_collective_3atp``), so a program file naming the op defines it again on load
(``effectfx.program.serialize.OP_FAMILIES``).
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..effects import register_effect
from ..errors import CallbackError, SerializationError
from ..graph.source import definition
from ..program.serialize import OP_FAMILIES, OpFamily

NAMESPACE = "effectfx_callback"
SCHEMA = "(str fn, str args, Tensor[] tensors, str results) -> Tensor[]"


@dataclass(frozen=True)
class TensorSpec:
    """A tensor a callback returns, for ``result_shape=`` (JAX's ``ShapeDtypeStruct``): its shape, dtype and
    device.  Any object with ``shape`` and ``dtype`` stands for one too (a tensor: ``result_shape=x``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    device: torch.device | str = "cpu"

    def __post_init__(self) -> None:  # (a symbolic size stays one: a size of the call's tensors, SizeOf)
        shape = tuple(s if isinstance(s, (torch.SymInt, SizeOf)) else int(s) for s in self.shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "device", torch.device(self.device))

    def __repr__(self) -> str:
        return f"TensorSpec({self.shape}, {self.dtype}, {self.device})"


@dataclass(frozen=True)
class SizeOf:
    """A size of a result that is size ``dim`` of the call's tensor ``tensor`` (kept symbolic in a graph)."""

    tensor: int
    dim: int


# -- the ops, one per key ---------------------------------------------------------------------------------
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
_OPS: dict[str, Any] = {}
_LOCK = threading.RLock()


def _op_name(key: str) -> str:
    return "on_" + "".join(c if c.isalnum() and c.isascii() else "__" if c == "_" else f"_{ord(c):02x}"
                           for c in key)


def _key_of(name: str) -> str:
    text, key, i = name.removeprefix("on_"), [], 0
    while i < len(text):
        if text[i] != "_":
            key.append(text[i])
            i += 1
        elif text[i + 1] == "_":
            key.append("_")
            i += 2
        else:
            key.append(chr(int(text[i + 1:i + 3], 16)))
            i += 3
    return "".join(key)


def callback_op(key: str) -> Any:
    """The op recording callbacks on effect key ``key`` (defined and registered on first use)."""
    op = _OPS.get(key)
    if op is not None:
        return op
    with _LOCK:
        if key not in _OPS:
            name = _op_name(key)
            _LIB.define(name + SCHEMA)
            _LIB.impl(name, _kernel, "CompositeExplicitAutograd")
            _LIB.impl(name, functools.partial(_below_autograd, key), "Autograd")
            torch.library.register_fake(f"{NAMESPACE}::{name}", _fake, lib=_LIB)
            torch.library.register_vmap(f"{NAMESPACE}::{name}", _no_vmap, lib=_LIB)
            op = getattr(getattr(torch.ops, NAMESPACE), name).default
            register_effect(op, key=key)
            _OPS[key] = op
    return _OPS[key]


def _below_autograd(key: str, *args: Any) -> Any:
    """Autograd's kernel: the callback is opaque to autograd (its results carry no gradient, as JAX's
    io_callback's do not), whatever its arguments require."""
    with torch._C._AutoDispatchBelowAutograd():
        return _OPS[key](*args)


def _no_vmap(info: Any, in_dims: tuple, fn: str, *args: Any) -> Any:
    raise CallbackError(
        f"efx.callback's function {fn} called in a program run under torch.vmap: eager would hand it the "
        "batched tensors themselves, which a compiled program cannot make. Call the compiled function "
        "without vmap.")


def _kernel(fn: str, args: str, tensors: list[torch.Tensor], results: str) -> list[torch.Tensor]:
    tensors = [t.detach() for t in tensors]  # (as eager's efx.callback hands them over)
    positional, keywords = _parsed(args)
    call_args, call_kwargs = decode(positional, tensors), {k: decode(v, tensors) for k, v in keywords.items()}
    return call(resolve(fn), call_args, call_kwargs, results_of(results, tensors), tensors, fn)[1]


def _fake(fn: str, args: str, tensors: list[torch.Tensor], results: str) -> list[torch.Tensor]:
    return [torch.empty(s.shape, dtype=s.dtype, device=s.device)
            for s in flat_results(results_of(results, tensors))]


# -- running the function: compiled (the kernel) and eager (efx.callback outside a capture) alike ---------
def call(fn: Callable[..., Any], args: Any, kwargs: dict, spec: Any, tensors: list[torch.Tensor],
         name: str) -> tuple[Any, list[torch.Tensor]]:
    """``fn(*args, **kwargs)`` without autograd, its tensor arguments ``tensors`` (detached) checked to be
    left unwritten; ``(what fn returned, its tensors)`` -- copies, checked against ``spec`` (None: no
    tensor results)."""
    versions = [t._version for t in tensors]
    with torch.no_grad():
        out = fn(*args, **kwargs)
    if any(t._version != v for t, v in zip(tensors, versions)):
        raise CallbackError(
            f"efx.callback's function {name} wrote one of its tensor arguments in place. A compiled program "
            "hands it values it may share with other ops, so a callback only reads them: write a copy "
            "(x.clone()) and return it through result_shape=.")
    if spec is None:
        return out, []
    leaves: list[torch.Tensor] = []
    _match(spec, out, leaves, name, "its result")
    return out, [t.detach().clone() for t in leaves]


def _match(spec: Any, value: Any, leaves: list[torch.Tensor], name: str, where: str) -> None:
    if isinstance(spec, TensorSpec):
        if (isinstance(value, torch.Tensor) and tuple(value.shape) == spec.shape and value.dtype == spec.dtype
                and value.device == spec.device):
            leaves.append(value)
            return
        got = (f"a tensor of shape {tuple(value.shape)}, {value.dtype} on {value.device}"
               if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")
        raise CallbackError(f"efx.callback's function {name} returned {got} as {where}, where result_shape "
                            f"says {spec}.")
    if isinstance(spec, dict):
        if not isinstance(value, dict) or set(value) != set(spec):
            raise CallbackError(f"efx.callback's function {name} returned {type(value).__name__} as {where}, "
                                f"where result_shape says a dict with keys {sorted(map(repr, spec))}.")
        for k, s in spec.items():
            _match(s, value[k], leaves, name, f"{where}[{k!r}]")
        return
    if not isinstance(value, (list, tuple)) or len(value) != len(spec):
        raise CallbackError(f"efx.callback's function {name} returned {type(value).__name__} as {where}, "
                            f"where result_shape says a {type(spec).__name__} of {len(spec)}.")
    for i, (s, v) in enumerate(zip(spec, value)):
        _match(s, v, leaves, name, f"{where}[{i}]")


def flat_results(spec: Any) -> list[TensorSpec]:
    """The tensors of a result structure, in order."""
    if spec is None:
        return []
    if isinstance(spec, TensorSpec):
        return [spec]
    return [leaf for s in (spec.values() if isinstance(spec, dict) else spec) for leaf in flat_results(s)]


def rebuild(spec: Any, leaves: list[torch.Tensor]) -> Any:
    """The result structure ``spec`` with its tensors taken from ``leaves`` in order."""
    it = iter(leaves)

    def build(s: Any) -> Any:
        if isinstance(s, TensorSpec):
            return next(it)
        if isinstance(s, dict):
            return {k: build(v) for k, v in s.items()}
        return type(s)(build(v) for v in s)

    return build(spec)


# -- the JSON of arguments and results --------------------------------------------------------------------
def encode(value: Any, tensors: list[torch.Tensor], plain: Callable[[Any, str], Any], where: str) -> Any:
    """``value`` as JSON data; its tensors appended to ``tensors``; ``plain(v, where)`` gives every other
    leaf as a plain value (``None``, bool, int, float, str), or raises."""
    kind = type(value)
    if kind in (list, tuple):
        items = [encode(v, tensors, plain, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if kind is list else {"tuple": items}
    if kind is dict:
        return {"dict": [[encode(k, tensors, plain, f"{where} (a key)"), encode(v, tensors, plain,
                                                                                f"{where}[{k!r}]")]
                         for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"tensor": len(tensors) - 1}
    if isinstance(value, TensorSpec):
        return {"result": [encode(list(value.shape), tensors, plain, f"{where}.shape"),
                           str(value.dtype).removeprefix("torch."), str(value.device)]}
    if kind is torch.dtype:
        return {"dtype": str(value).removeprefix("torch.")}
    if kind is torch.device:
        return {"device": str(value)}
    value = plain(value, where)
    if isinstance(value, SizeOf):
        return {"size": [value.tensor, value.dim]}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": str(value)}
    return value


def decode(data: Any, tensors: list[torch.Tensor]) -> Any:
    """The value :func:`encode` made ``data`` of, fresh containers each time."""
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    (kind, payload), = data.items()
    if kind == "tensor":
        return tensors[payload]
    if kind == "tuple":
        return tuple(decode(v, tensors) for v in payload)
    if kind == "dict":
        return {decode(k, tensors): decode(v, tensors) for k, v in payload}
    if kind == "result":
        return TensorSpec(tuple(decode(payload[0], tensors)), getattr(torch, payload[1]), payload[2])
    if kind == "size":
        return tensors[payload[0]].shape[payload[1]]
    if kind == "dtype":
        return getattr(torch, payload)
    if kind == "device":
        return torch.device(payload)
    return float(payload)  # "float": a float JSON has no number for


@functools.lru_cache(maxsize=4096)
def _parsed(text: str) -> Any:
    return json.loads(text)


def dumps(data: Any) -> str:
    return json.dumps(data, separators=(",", ":"), allow_nan=False)


def results_of(text: str, tensors: list[torch.Tensor]) -> Any:
    """The result structure ``text`` spells for a call of ``tensors`` (None for ``""``)."""
    return decode(_parsed(text), tensors) if text else None


# -- functions by name --------------------------------------------------------------------------------------
_LOCAL: dict[str, Callable[..., Any]] = {}  # "<qualname>#<n>" -> the function (kept alive: programs call it)
_LOCAL_NAMES: dict[tuple[int, ...], str] = {}  # the function's ids (a bound method's: self's and function's)


def _identity(fn: Any) -> tuple[int, ...]:
    self = getattr(fn, "__self__", None)
    return (id(self), id(fn.__func__)) if self is not None and hasattr(fn, "__func__") else (id(fn),)


def _lookup(name: str) -> Any:
    module, _, qualname = name.partition(":")
    found: Any = sys.modules[module]
    for part in qualname.split("."):
        found = getattr(found, part)
    return getattr(found, "__effectfx_effect__", found)  # an @efx.effect function: the function it wraps


def importable_name(fn: Any) -> str | None:
    """``"module:qualname"`` if that name finds ``fn`` in its imported module, else None."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    name = f"{module}:{qualname}"
    try:
        found = _lookup(name)
    except (KeyError, AttributeError):
        return None
    return name if found is fn or _identity(found) == _identity(fn) else None


def function_name(fn: Callable[..., Any]) -> str:
    """The name the graph calls ``fn`` by: importable, or an entry of this process's registry."""
    name = importable_name(fn)
    if name is not None:
        return name
    with _LOCK:
        name = _LOCAL_NAMES.get(_identity(fn))
        if name is None:
            qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
            name = _LOCAL_NAMES[_identity(fn)] = f"{qualname}#{len(_LOCAL)}"
            _LOCAL[name] = fn
    return name


def resolve(name: str) -> Callable[..., Any]:
    """The function the graph names ``name``."""
    if "#" in name:
        fn = _LOCAL.get(name)
        if fn is None:
            raise CallbackError(f"efx.callback's function {name} is not known in this process: a lambda, "
                                "closure or bound method is called only by the process that captured it.")
        return fn
    try:
        return _lookup(name)
    except (KeyError, AttributeError):
        module = name.partition(":")[0]
        why = f"module {module} has no such name" if module in sys.modules else f"{module} is not imported"
        raise CallbackError(
            f"efx.callback's function {name!r} is not found: a program calls a callback's function by its "
            f"module and qualified name, and {why}. Import the module that defines it before loading (or "
            "calling) the program.") from None


# -- a program file: a callback is saved by its function's name ----------------------------------------------
def _on_save(node: fx.Node) -> None:
    name = node.args[0]
    if "#" not in name:
        return
    fn = _LOCAL.get(name)
    where = node.meta.get("location")
    raise SerializationError(
        f"cannot save the call of efx.callback's function {name.split('#')[0]}"
        + (f" (defined at {definition(fn)})" if fn is not None else "")
        + (f", called at {where}" if where else "") + ": a program file names a callback's function by its "
        "module and qualified name, and this one has none that finds it (a lambda, a closure, a local "
        "function or a bound method). Define it at module level (or decorate a module-level function with "
        "@efx.effect), or keep this program in memory instead of saving it.")


def _on_load(args: tuple) -> None:
    if "#" in args[0]:  # (never saved so: _on_save refuses it)
        raise SerializationError(f"the file calls {args[0]!r}, a function only its capturing process knew.")
    resolve(args[0])


def _define(name: str) -> None:
    if not _OP_NAME.match(name):
        raise SerializationError(f"{NAMESPACE}::{name} is not an op of efx.callback (on_<effect key>).")
    callback_op(_key_of(name))


_OP_NAME = re.compile(r"^on_([A-Za-z0-9]|__|_[0-9a-f]{2})+$")
OP_FAMILIES[NAMESPACE] = OpFamily(define=_define, on_save=_on_save, on_load=_on_load)
