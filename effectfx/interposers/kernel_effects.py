"""Whether the Python kernel of a CompositeImplicitAutograd effect op may have side effects of its own.

Capture runs such a kernel once, on fake tensors, to learn the op's results
(``effectfx.interposers.composite``); the program runs it again on every call, with real values, exactly as
eager.  What the kernel does through ops and ``print`` is exact (its ops run on fakes, its prints are
silenced: both happen at run time only), but anything else its Python does -- append to a list, bump a
counter, write a file, log -- happened once more, at capture, with fake tensors.  Capture cannot avoid that,
so it says so (``CaptureSideEffectWarning``).
Which kernels: a kernel whose code effectfx cannot *prove* free of such effects.  The proof reads the code
of each frame of the kernel's own (not torch's, not effectfx's) that the kernel's ops were dispatched from,
the functions those call by name, and the code nested in them: it holds when they write no global, no
enclosing function's variable, no attribute and no item (of anything: an argument may be shared), import
nothing, and every global or free variable they read is ``print`` or another builtin without effects,
torch (its modules, functions, ops and classes: their Python is trusted), ``math``/``operator``/
``itertools``, an immutable value (numbers, strings, tuples of them, dtypes, devices), or a function the
same holds for.  Anything else -- a list, an object, ``open``, ``logging`` -- defeats the proof: the warning
may then be one a careful reader would not need, never one that is missing for such code.  A C++ kernel
(``aten::absolute``) runs no Python.
"""

from __future__ import annotations

import builtins
import dis
import enum
import os
import types
from typing import Any

import torch

_TRUSTED = (os.path.dirname(torch.__file__) + os.sep,)
_EFFECTFX = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TESTING = _EFFECTFX + "testing" + os.sep  # effectfx's own test ops: examined like the user's
_DECOMPOSE = torch._ops.OpOverload.decompose.__code__

_PURE_BUILTINS = frozenset({
    "print", "len", "range", "isinstance", "issubclass", "int", "float", "bool", "str", "complex", "bytes",
    "tuple", "list", "dict", "set", "frozenset", "min", "max", "sum", "abs", "round", "zip", "enumerate",
    "map", "filter", "sorted", "reversed", "any", "all", "getattr", "hasattr", "type", "repr", "format",
    "divmod", "pow", "slice", "iter", "next", "hash", "callable", "chr", "ord", "hex", "oct", "bin", "ascii",
    "object", "super", "NotImplemented", "Ellipsis", "None", "True", "False", "ValueError", "TypeError",
    "RuntimeError", "KeyError", "IndexError", "AssertionError", "NotImplementedError", "Exception",
})
_PURE_MODULES = frozenset({"torch", "math", "operator", "itertools"})
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size,
              torch.layout, torch.memory_format, enum.Enum, type(Ellipsis))
_WRITES = {
    "STORE_GLOBAL": "assigns the global {!r}", "DELETE_GLOBAL": "deletes the global {!r}",
    "STORE_ATTR": "sets an attribute ({!r})", "DELETE_ATTR": "deletes an attribute ({!r})",
    "STORE_SUBSCR": "sets an item", "DELETE_SUBSCR": "deletes an item", "STORE_SLICE": "sets a slice",
    "DELETE_DEREF": "deletes the variable {!r}", "IMPORT_NAME": "imports {!r}",
}
_MISSING = object()


def _trusted(filename: str) -> bool:
    return (filename.startswith(_TRUSTED) or filename.startswith("<frozen ")
            or (filename.startswith(_EFFECTFX) and not filename.startswith(_TESTING)))


def kernel_frames(frame: types.FrameType | None) -> list[types.FrameType]:
    """The frames of the kernel's own Python between ``frame`` (where one of its ops was dispatched) and
    the ``decompose`` that runs the kernel at capture; none when ``frame`` is not inside such a kernel."""
    found = []
    while frame is not None:
        if frame.f_code is _DECOMPOSE:
            return found
        if not _trusted(frame.f_code.co_filename):
            found.append(frame)
        frame = frame.f_back
    return []


def frame_effect(frame: types.FrameType) -> str | None:
    """Why the code running in ``frame`` may have Python side effects of its own, or None if it has none."""
    code = frame.f_code
    free = {name: frame.f_locals.get(name, _MISSING) for name in code.co_freevars}
    return _code_effect(code, frame.f_globals, frame.f_builtins, free, set())


def _code_effect(code: types.CodeType, globals_: dict, builtins_: Any, free: dict[str, Any],
                 seen: set[types.CodeType]) -> str | None:
    if code in seen:
        return None
    seen.add(code)
    for ins in dis.get_instructions(code):
        what = _WRITES.get(ins.opname)
        if what is not None:
            return what.format(ins.argval)
        if ins.opname == "STORE_DEREF" and ins.argval in code.co_freevars:
            return f"assigns the variable {ins.argval!r} of an enclosing function"
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            why = _global_effect(ins.argval, globals_, builtins_, seen)
        elif ins.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF") and ins.argval in free:
            why = _value_effect(ins.argval, free[ins.argval], seen)
        else:
            continue
        if why is not None:
            return why
    for const in code.co_consts:  # lambdas, comprehensions and functions defined inside
        if isinstance(const, types.CodeType):
            why = _code_effect(const, globals_, builtins_, free, seen)
            if why is not None:
                return why
    return None


def _global_effect(name: str, globals_: dict, builtins_: Any, seen: set[types.CodeType]) -> str | None:
    if name in globals_:
        return _value_effect(name, globals_[name], seen)
    table = builtins_ if isinstance(builtins_, dict) else vars(builtins)
    if name in table and name not in _PURE_BUILTINS:
        return f"calls {name}()"
    return None  # a NameError when it runs, if ever


def _value_effect(name: str, value: Any, seen: set[types.CodeType]) -> str | None:
    if value is _MISSING or _immutable(value):
        return None
    if isinstance(value, types.ModuleType):
        return None if value.__name__.split(".")[0] in _PURE_MODULES else f"uses the module {name!r}"
    module = getattr(value, "__module__", None) or type(value).__module__ or ""
    if module.split(".")[0] == "torch":
        return None
    if isinstance(value, types.FunctionType):
        closure = value.__closure__ or ()
        free = {}
        for var, cell in zip(value.__code__.co_freevars, closure):
            try:
                free[var] = cell.cell_contents
            except ValueError:  # an empty cell: assigned later by the enclosing function
                free[var] = _MISSING
        table = value.__globals__.get("__builtins__", builtins)
        return _code_effect(value.__code__, value.__globals__, table, free, seen)
    if isinstance(value, types.BuiltinFunctionType):
        owner = getattr(value, "__self__", None)
        if owner is builtins:
            return None if value.__name__ in _PURE_BUILTINS else f"calls {name}()"
        if isinstance(owner, types.ModuleType) and owner.__name__ in _PURE_MODULES:  # math.sqrt
            return None
    return f"uses {name!r} (a {type(value).__name__})"


def _immutable(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE)
