"""``efx.callback`` and ``@efx.effect``: any Python function as an effect.

Note [Callbacks]
~~~~~~~~~~~~~~~~
``efx.callback(fn, *args, key="ordered", result_shape=None, **kwargs)`` calls ``fn(*args, **kwargs)`` as an
effect on ``key``: a compiled program calls it at run time, on every call, with that call's tensors, in
eager's order among the effects of its key -- in forward, in a region (one body serves every call site
where the function is the same), in a backward formula (an ``autograd.Function``'s ``backward`` or a
``register_autograd`` formula calling ``efx.callback``: it runs where the engine runs the formula).
Outside a capture it is the call itself, so code runs the same compiled or not.  ``@efx.effect`` (or
``@efx.effect(key=..., result_shape=...)``) makes every call of the function it decorates such a callback.

*How it relates to* ``register_effect``: ``register_effect`` marks an op of your own (``torch.library``,
with its schema, fake and autograd formula) effectful on a key; ``efx.callback`` needs no op -- any Python
function, no schema -- and records a call of effectfx's op for the key (``effectfx_callback::on_<key>``,
``effectfx.interposers.callback_op``), whose graph node names the function by a string and holds the call's
other arguments as plain values.  Both are ordered on their key together: a callback on ``"memory"`` runs
between the ``"memory"`` ops eager runs it between.  Reach for ``register_effect`` when the effect needs
a gradient formula or is an op others call too; for logging, metrics, host I/O and checks, a callback.

What a call may pass, and what it gets:

* tensors (anywhere in lists, tuples and dicts) reach ``fn`` as they are at run time, detached: a callback
  is opaque to autograd, as JAX's ``io_callback`` is.  ``fn`` runs under ``no_grad`` and must not write
  them (checked: a compiled program may share their memory with other values);
* every other argument is baked into the graph: ``None``, bool, int, float, str, ``torch.dtype``,
  ``torch.device``, and lists, tuples and dicts of them (a size of a symbolic capture is pinned to its
  value, with a guard; a string a region read is baked in and guarded, Note [Region identity]).  Anything
  else is refused (:class:`~effectfx.errors.CallbackError`): the function reaches other objects itself;
* ``result_shape`` (a :class:`TensorSpec`, anything with ``shape`` and ``dtype`` such as a tensor, or lists,
  tuples and dicts of them) makes the call return tensors of those shapes, dtypes and devices -- copies of
  what ``fn`` returned, checked against it, carrying no gradient -- which later code uses as any tensor.
  Without it the call returns None in a capture (and ``fn``'s result in eager).

The function is named in the graph by ``"module:qualname"`` when that finds it (looked up when the op
runs); a lambda, closure or bound method gets an entry of this process's registry instead, so a program
calling one cannot be saved (``efx.load`` finds the others by name, their module imported first, as a
custom op's library is).  A closure over a tensor the trace made is refused: it would keep the capture's
value where eager's code sees the call's.  A method of an object a region body was handed (``self.log``)
is another function at every call site: the body serves that object only (a guard on its identity), so a
stack of layers calling their own methods gets a body per layer, as it does for the plain values a call
bakes in.

*Python's* ``random`` *module* (``effectfx.interposers.python_random``): a draw from its global generator
in captured code is refused, naming the line.  Drawing it per call as eager does would mean a Python float
that changes at run time, and a graph holds a float as a constant of its ops (``x * random.random()``
records ``mul(x, 0.37...)``) or uses it in Python control flow no graph keeps; making every such float a
tensor operand would change the ops eager runs -- and a draw used in an ``if`` still could not follow.
Draw with ``torch.rand`` (a graph node: it draws from torch's generator at run time, as eager does), or
make a callback return the draw as a tensor (``result_shape=efx.TensorSpec(())``).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map

from ..effects import DEFAULT_KEY, check_key
from ..errors import CallbackError
from ..graph.source import user_location
from ..guards.kinds import SameObject
from ..guards.labels import Label
from ..guards.reads import active_reads
from ..guards.values import Ref
from ..regions.decorator import active_tracer
from .callback_op import SizeOf, TensorSpec, call, callback_op, dumps, encode, function_name, rebuild
from .print_options import emit

__all__ = ["TensorSpec", "callback", "effect"]

_SYMBOLS = (torch.SymInt, torch.SymFloat, torch.SymBool)
_FUNCTORCH = torch._C._functorch
_PLAIN = (bool, int, float, str)


def callback(fn: Callable[..., Any], *args: Any, key: str = DEFAULT_KEY, result_shape: Any = None,
             **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)`` as an effect on ``key`` (Note [Callbacks]): in a compiled program at run
    time, on every call, in eager's order.  With ``result_shape``, returns the tensors ``fn`` returns (of
    those shapes and dtypes, without gradient); without it, None in a capture."""
    check_key(key, "efx.callback")
    if not callable(fn):
        raise CallbackError(f"efx.callback({fn!r}, ...): its first argument is the function to call.")
    tracer = active_tracer()
    if tracer is None or not tracer.builders:
        return _eager(fn, args, kwargs, result_shape)
    return _record(tracer, fn, args, kwargs, key, result_shape)


def effect(fn: Callable[..., Any] | None = None, *, key: str = DEFAULT_KEY,
           result_shape: Any = None) -> Any:
    """``@efx.effect`` / ``@efx.effect(key=..., result_shape=...)``: every call of the decorated function is
    an :func:`callback` on ``key`` (Note [Callbacks])."""
    check_key(key, "@efx.effect")

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(f)
        def effectful(*args: Any, **kwargs: Any) -> Any:
            return callback(f, *args, key=key, result_shape=result_shape, **kwargs)

        effectful.__effectfx_effect__ = f  # type: ignore[attr-defined]  (its name finds f: callback_op)
        return effectful

    return decorate if fn is None else decorate(fn)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _eager(fn: Callable[..., Any], args: tuple, kwargs: dict, result_shape: Any) -> Any:
    tensors: list[torch.Tensor] = []

    def detach(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach())
            return tensors[-1]
        return value

    args, kwargs = tree_map(detach, (args, kwargs))
    spec = None if result_shape is None else _spec(result_shape, _name(fn))
    out, leaves = call(fn, args, kwargs, spec, tensors, _name(fn))
    return out if spec is None else rebuild(spec, leaves)


def _record(tracer: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, key: str,
            result_shape: Any) -> Any:
    name = function_name(fn)
    _check_closure(fn, name)
    _pin_owner(fn)
    tensors: list[torch.Tensor] = []
    plain = _plain(tracer, name, tensors)
    data = [encode(list(args), tensors, plain, "args"),
            {k: encode(v, tensors, plain, f"kwargs[{k!r}]") for k, v in kwargs.items()}]
    if any(_FUNCTORCH.is_functorch_wrapped_tensor(t) for t in tensors):
        raise CallbackError(
            f"efx.callback({name}, ...) at {user_location()} under a torch.func transform (vmap, grad, ...): "
            "eager hands the function the transform's wrapped tensors, which a compiled program cannot make. "
            "Call it outside the transform.")
    spec = None if result_shape is None else _spec(result_shape, name)
    results = "" if spec is None else dumps(encode(spec, [], plain, "result_shape"))
    out = emit(tracer, callback_op(key), (name, dumps(data), tensors, results))
    return None if spec is None else rebuild(spec, list(out))


def _plain(tracer: Any, name: str, tensors: list[torch.Tensor]) -> Callable[[Any, str], Any]:
    """What a non-tensor leaf of a call's arguments is baked in as, or its refusal; a symbolic size of a
    result that is a size of one of the call's ``tensors`` stays symbolic (:class:`SizeOf`)."""

    symbolic = tracer.shape_env is not None

    def plain(value: Any, where: str) -> Any:
        if symbolic and type(value) is int and where.startswith("result_shape"):
            # a symbol pinned to a number after an earlier trace named it as a size of a tensor: a retrace
            # (Note [Partial backward]) sees the number where that trace saw the symbol, and must record the
            # same call -- a static size of a tensor is named as that size too
            for i, t in enumerate(tensors):
                for d, size in enumerate(t.shape):
                    if type(size) is int and size == value:
                        return SizeOf(i, d)
        if value is None or type(value) in _PLAIN:
            return value
        if isinstance(value, Label):
            return str(value)  # a use of its value: baked in and guarded (Note [Region identity])
        if isinstance(value, torch.SymInt) and where.startswith("result_shape"):
            expr = value.node.expr
            for i, t in enumerate(tensors):
                for d, size in enumerate(t.shape):
                    if isinstance(size, torch.SymInt) and size.node.expr == expr:
                        return SizeOf(i, d)
        if isinstance(value, _SYMBOLS):
            pinned = value.node.pytype(value)  # (guards: the program serves this value only)
            tracer.specialized.append(f"efx.callback's {where} at {user_location()} made {value.node.expr} = "
                                      f"{pinned}")
            return pinned
        raise CallbackError(
            f"efx.callback({name}, ...) at {user_location()}: {where} is a {type(value).__qualname__}, "
            "neither a tensor nor a plain value. A compiled program passes a callback its tensors as they "
            "are at run time and bakes every other argument into its graph: None, bool, int, float, str, "
            "torch.dtype, torch.device, and lists, tuples and dicts of them. Let the function reach other "
            "objects itself (a module-level object it reads).")

    return plain


def _spec(value: Any, name: str, where: str = "result_shape") -> Any:
    """``result_shape`` as a structure of :class:`TensorSpec` (in lists, tuples and dicts)."""
    kind = type(value)
    if kind in (list, tuple):
        return kind(_spec(v, name, f"{where}[{i}]") for i, v in enumerate(value))
    if kind is dict:
        return {k: _spec(v, name, f"{where}[{k!r}]") for k, v in value.items()}
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or not isinstance(dtype, torch.dtype):
        raise CallbackError(
            f"efx.callback({name}, ...): {where} is a {kind.__qualname__}; result_shape describes tensors: "
            "an efx.TensorSpec(shape, dtype, device), anything with shape and dtype (a tensor), or lists, "
            "tuples and dicts of them.")
    device = torch.device(getattr(value, "device", "cpu"))
    device = torch.device("cpu") if device.type == "meta" else device
    return TensorSpec(tuple(shape), dtype, device)


def _pin_owner(fn: Any) -> None:
    """A method of an object a region body was handed (``self.log`` of its module) is another function at
    each call site the body serves: the body serves that object only (a guard on its identity)."""
    owner = getattr(fn, "__self__", None)
    if owner is None or isinstance(owner, (type, types.ModuleType)):
        return
    for reads in active_reads():
        path = reads.paths.get(id(owner))
        if reads.structural and path is not None and path[0][0] != "id":
            reads.guards[path] = SameObject(path, Ref(owner))


def _check_closure(fn: Any, name: str) -> None:
    """Refuse a function that closes over (or defaults to) a tensor the trace made: the program would call
    it with the capture's fake where eager's code sees the call's value; a region's string it closes over is
    baked in (Note [Region identity])."""
    inner = getattr(fn, "__func__", fn)
    values: list[Any] = []
    for cell in getattr(inner, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # a cell not yet assigned
            continue
    values += [*(getattr(inner, "__defaults__", None) or ()), *(getattr(inner, "__kwdefaults__", None) or {})
               .values()]
    if isinstance(fn, functools.partial):
        values += [*fn.args, *fn.keywords.values()]
    for leaf in tree_flatten(values)[0]:
        if isinstance(leaf, FakeTensor):
            raise CallbackError(
                f"efx.callback({name}, ...) at {user_location()}: the function closes over a tensor the "
                "captured code computed; a compiled program would call it with the capture's value on every "
                "call. Pass the tensor as an argument of efx.callback instead.")
        if isinstance(leaf, Label):
            str(leaf)
