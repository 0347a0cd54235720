"""``effectfx show FILE.py:FUNC``: capture a function from a file and print one form, or draw it as HTML.

Usage::

    effectfx show model.py:step                       # the functionalized form, as code
    effectfx show model.py:step --form captured       # captured | functionalized | unlifted | token-free
    effectfx show model.py:step --html step.html      # a self-contained page drawing every graph
    effectfx show model.py:model.forward --form token-free

``FUNC`` is a name in the file, or a dotted path into it (``model``, ``model.forward``, ``Net.helper``);
an ``nn.Module`` instance is captured as a module.

Example inputs -- the file says what to call ``FUNC`` with, in one of three ways (first found wins):

1. an attribute on the function itself: ``step.example_inputs = (torch.randn(4),)``;
2. a function in the file named ``example_inputs_<FUNC>`` (dots become underscores), called with no
   arguments: ``def example_inputs_step(): return (torch.randn(4),)``;
3. a module-level dict: ``EXAMPLE_INPUTS = {"step": (torch.randn(4),)}`` (keys are ``FUNC`` as written).

The value is a tuple of positional arguments; any other single value is one positional argument; a dict
``{"args": (...), "kwargs": {...}}`` gives keyword arguments too; and a zero-argument callable (e.g. a
lambda) is called first, so tensors are made fresh.  To pass one tuple as the only argument, wrap it:
``((a, b),)``.  Inputs that require grad give a training program (forward and backward graphs).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from effectfx.program.records import Form

FORMS = tuple(form.value for form in Form)  # the names ``--form`` takes
# The public pass that makes each later form from the functionalized one (added as they land).
_FORM_PASSES = {Form.UNLIFTED: "unlift_tokens", Form.TOKEN_FREE: "remove_effect_tokens"}


class ShowError(Exception):
    """A problem with what the user asked for (file, function, inputs, form): exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "example inputs: give FUNC an attribute `example_inputs`, or define `example_inputs_<FUNC>()`,\n"
        "or a dict EXAMPLE_INPUTS = {'FUNC': (args...)} in the file (see `effectfx.cli.show`)."
    )
    parser.add_argument("target", metavar="FILE.py:FUNC", help="the file and the function in it to capture")
    parser.add_argument("--form", choices=FORMS, default=Form.FUNCTIONALIZED.value,
                        help="which form to print or draw (default: functionalized)")
    parser.add_argument("--html", metavar="OUT.html", default=None,
                        help="write a self-contained HTML page drawing the graphs instead of printing")


def available_forms() -> dict[Form, bool]:
    """Per form (a key its name finds too), whether this effectfx makes it."""
    import effectfx as efx

    return {form: form not in _FORM_PASSES or callable(getattr(efx, _FORM_PASSES[form], None))
            for form in Form}


def make_form(fn: Callable[..., Any], args: tuple, kwargs: dict, form: str | Form) -> Any:
    """Capture ``fn(*args, **kwargs)`` and return the Program (or TrainingProgram) in ``form`` (a
    ``Form`` or its name)."""
    import effectfx as efx
    from effectfx.program.training import TrainingProgram

    if form not in FORMS:
        raise ShowError(f"unknown form {form!r}; choose one of {', '.join(FORMS)}.")
    form = Form(form)
    if form is Form.CAPTURED:
        return efx.capture(fn, *args, functionalize=False, **kwargs)
    pass_name = _FORM_PASSES.get(form)
    pass_ = getattr(efx, pass_name, None) if pass_name else None
    if pass_name and not callable(pass_):
        have = ", ".join(f for f, ok in available_forms().items() if ok)
        raise ShowError(f"the {form.value!r} form needs efx.{pass_name}, which this effectfx does not "
                        f"provide yet. Available forms: {have}.")
    prog = efx.capture(fn, *args, **kwargs)
    if pass_ is None:
        return prog
    if isinstance(prog, TrainingProgram):
        return prog.map(pass_)
    return pass_(prog)


def load_file(path: str | Path) -> Any:
    """Import a user's Python file as a fresh module (its directory is importable while it runs)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ShowError(f"no such file: {path}")
    name = "_effectfx_show_" + "".join(c if c.isalnum() else "_" for c in path.stem)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ShowError(f"cannot import {path}: not a Python file?")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    finally:
        try:
            sys.path.remove(str(path.parent))
        except ValueError:
            pass
    return module


def resolve(module: Any, func: str) -> Any:
    obj = module
    for part in func.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
            raise ShowError(f"{module.__file__} has no {func!r} ({part!r} not found). "
                            f"Callables in the file: {', '.join(names) or 'none'}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ShowError(f"{func!r} in {module.__file__} is a {type(obj).__name__}, not a function.")
    return obj


def _normalize(value: Any, where: str) -> tuple[tuple, dict]:
    if callable(value) and not isinstance(value, (torch.Tensor, torch.nn.Module)):
        value = value()
    if isinstance(value, dict) and value and set(value) <= {"args", "kwargs"}:
        args = value.get("args", ())
        kwargs = value.get("kwargs", {})
        if not isinstance(args, (tuple, list)) or not isinstance(kwargs, dict):
            raise ShowError(f"{where}: 'args' must be a tuple and 'kwargs' a dict.")
        return tuple(args), dict(kwargs)
    if isinstance(value, tuple):
        return value, {}
    return (value,), {}


def example_inputs(module: Any, func: str, obj: Any) -> tuple[tuple, dict]:
    """The example inputs the file provides for ``func`` (see the module docstring for the convention)."""
    value = getattr(obj, "example_inputs", None)  # bound methods see their function's attributes
    if value is not None:
        return _normalize(value, f"{func}.example_inputs")
    maker = getattr(module, "example_inputs_" + func.replace(".", "_"), None)
    if maker is not None:
        return _normalize(maker, f"example_inputs_{func.replace('.', '_')}()")
    table = getattr(module, "EXAMPLE_INPUTS", None)
    if isinstance(table, dict) and func in table:
        return _normalize(table[func], f"EXAMPLE_INPUTS[{func!r}]")
    raise ShowError(
        f"{module.__file__} gives no example inputs for {func!r}. Add one of:\n"
        f"  {func}.example_inputs = (torch.randn(4),)\n"
        f"  def example_inputs_{func.replace('.', '_')}(): return (torch.randn(4),)\n"
        f"  EXAMPLE_INPUTS = {{{func!r}: (torch.randn(4),)}}"
    )


def split_target(target: str) -> tuple[str, str]:
    path, sep, func = target.rpartition(":")
    if not sep or not path or not func:
        raise ShowError(f"expected FILE.py:FUNC, got {target!r}")
    return path, func


def show(target: str, form: str | Form = Form.FUNCTIONALIZED, html: str | None = None) -> str:
    """Do what ``effectfx show`` does; returns the text it prints."""
    path, func = split_target(target)
    module = load_file(path)
    obj = resolve(module, func)
    args, kwargs = example_inputs(module, func, obj)
    prog = make_form(obj, args, kwargs, form)
    if html is None:
        return str(prog)
    from effectfx.viz import program_json, render_html

    data = program_json(prog, title=f"{Path(path).name}:{func}")
    Path(html).write_text(render_html(data), encoding="utf-8")
    n_nodes = sum(len(g["nodes"]) for g in data["graphs"].values())
    return (f"wrote {html}: {form} form of {func}, {len(data['graphs'])} graphs, {n_nodes} nodes, "
            f"effect keys: {', '.join(data['keys']) or 'none'}")


def run(args: argparse.Namespace) -> int:
    from effectfx.errors import EffectfxError

    try:
        print(show(args.target, args.form, args.html))
    except ShowError as exc:
        print(f"effectfx show: {exc}", file=sys.stderr)
        return 2
    except EffectfxError as exc:
        print(f"effectfx show: capture failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
