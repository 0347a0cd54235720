"""A compiled program's guards as a C++ tree and generated code (``effectfx.guards.check``): the same
verdict as the interpretation (``guards_hold``) on every state -- each guard kind, a real model's guards
under changes that break each kind of guard, and generated guards over generated objects (hypothesis)."""

from __future__ import annotations

import collections
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import effectfx as efx
import effectfx.testing  # noqa: F401  (registers the efxtest:: ops)
from effectfx.guards import kinds
from effectfx.guards.check import GuardChecker, failed_guards, guards_hold
from effectfx.guards.hooks import GLOBAL
from effectfx.guards.kinds import Absent, Equals, Guard, Hooks, IsStr, Keys, OfType, SameObject, guard_on
from effectfx.guards.values import MISSING, Ref
from effectfx.testing import hf


def _ready(guards: tuple) -> GuardChecker:
    """A checker past its first two calls (which interpret): the third made its C++ tree and code, as a
    program's checker is made while its guards hold."""
    check = GuardChecker(guards)
    assert [check() for _ in range(3)] == [True] * 3 and check.run is not None
    return check


def _both(check: GuardChecker) -> tuple[bool, bool]:
    """The checker's verdict now and the interpretation's."""
    return check(), guards_hold(check.guards)


CHANGES: dict[str, Callable[[torch.nn.Module], None]] = {
    "a config value": lambda m: setattr(m.config, "use_cache", not m.config.use_cache),
    "a submodule replaced": lambda m: setattr(m.transformer.h[1].layer, "mlp",
                                              type(m.transformer.h[1].layer.mlp)(256, m.config)),
    "an attribute found missing now present": lambda m: setattr(m.config, "is_causal", True),
    "a tuple value": lambda m: setattr(m.transformer.ln_f, "normalized_shape", (32,)),
    "a layer's name": lambda m: setattr(m.transformer.h[0], "name", "renamed"),
    "training mode": lambda m: m.eval(),
    "an instance forward assigned": lambda m: (lambda mlp: setattr(mlp, "forward", types.MethodType(
        lambda self, x: type(self).forward(self, x), mlp)))(m.transformer.h[1].layer.mlp),
    "the layers reordered": lambda m: (lambda t: t.update({"0": t.pop("0")}))(m.transformer.h._modules),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_real_model_s_guards_agree_and_fail(change: str) -> None:
    model = hf.build("gpt2")
    compiled = efx.compile(model)
    compiled(**hf.batch("gpt2", torch.Generator().manual_seed(0)))
    (entry,) = [e for entries in compiled.compiled.cache.values() for e in entries]
    check = _ready(entry.guards)
    CHANGES[change](model)
    verdict = _both(check)
    assert verdict[0] == verdict[1]
    if change != "a layer's name":  # a label: an operand of the body, not a guard
        assert verdict == (False, False)


class Obj:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class Mod(torch.nn.Module):
    pass


VALUES = st.one_of(st.integers(-2, 2), st.booleans(), st.sampled_from(["a", "b"]), st.none(),
                   st.tuples(st.integers(0, 2), st.integers(0, 2)))
NAMES = st.sampled_from(["a", "b", "c"])
# how a node holds its fields: attributes, items (an optimizer's state is a defaultdict), a module's
KINDS = st.sampled_from([Obj, dict, lambda: collections.defaultdict(int), Mod])
DELETE = object()  # a change that removes the field


def _set(owner: Any, name: str, value: Any) -> None:
    if isinstance(owner, dict):
        owner.pop(name, None) if value is DELETE else owner.__setitem__(name, value)
    elif value is DELETE:
        if hasattr(owner, name):
            delattr(owner, name)
    elif isinstance(owner, Mod) and name in owner._modules and not isinstance(value, Mod):
        owner._modules[name] = None if value is None else Mod()  # (a submodule is replaced by a module)
    else:
        setattr(owner, name, value)


@st.composite
def trees(draw: Any, depth: int = 0) -> Any:
    node = draw(KINDS)() if depth else Obj()
    for name in draw(st.lists(NAMES, unique=True, max_size=3)):
        _set(node, name, draw(trees(depth + 1)) if depth < 2 and draw(st.booleans()) else draw(VALUES))
    return node


def _step(obj: Any, name: str) -> Any:
    return ("item", name) if isinstance(obj, dict) else name


def _read(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        obj = obj.get(name, MISSING) if isinstance(obj, dict) else getattr(obj, name, MISSING)
    return obj


@settings(max_examples=300, deadline=None)
@given(trees(), st.lists(st.lists(NAMES, min_size=1, max_size=3), max_size=8),
       st.lists(st.tuples(st.lists(NAMES, min_size=1, max_size=3), st.one_of(VALUES, st.just(DELETE))),
                max_size=4))
def test_generated_guards_agree_with_the_loop(root: Obj, paths: list[list[str]],
                                              changes: list[tuple[list[str], Any]]) -> None:
    """Generated guards of generated objects, dicts and modules, then changes (a value set, a field
    removed, a submodule replaced): the tree and code say what the interpretation says."""
    guards = []
    for path in paths:  # what a capture would have recorded of the tree as it is
        value = _read(root, tuple(path))
        steps = tuple(_step(_read(root, tuple(path[:k])), name) for k, name in enumerate(path))
        plain = not isinstance(value, (Obj, dict, Mod))
        at = (("id", Ref(root)), *steps)
        guards.append(guard_on(at, value, structural=False) if plain else SameObject(at, Ref(value)))
        if type(value) is dict:  # (as a module's ``_parameters`` read by a trace)
            guards.append(Keys(at, tuple(value)))
    check = _ready(tuple(guards))
    for path, value in changes:  # then the tree changes
        owner = _read(root, tuple(path[:-1]))
        if isinstance(owner, (Obj, dict, Mod)):
            _set(owner, path[-1], value)
    now, loop = _both(check)
    assert now == loop


GOLDEN = """
# C++ guards
c0
  .n == 4
  .cfg is <Obj object>
    .flag == True
    .shape == (2, 3)
  .block is <Block object>
    ._modules
    .lin is <Linear object>
      .in_features == 2
# then
def check():
    v0 = getattr(c0, 'cfg', MISSING)
    v1 = getattr(v0, 'gone', MISSING)
    if v1 is not MISSING: return False
    return True
"""


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)


def test_golden_generated_guards_read_each_prefix_once() -> None:
    """A value, an object by identity, a value and a tuple through it, a submodule (read from its module's
    ``_modules``) and a value of it: one C++ accessor per prefix (``root.cfg`` serves the three guards
    below it); an attribute found missing is Python code.  The first two calls interpret."""
    inner = Obj(flag=True, shape=(2, 3))
    block = Block()
    root = Obj(cfg=inner, n=4, block=block)
    at = ("id", Ref(root))
    guards = (Equals((at, "n"), int, 4),
              SameObject((at, "cfg"), Ref(inner)),
              Equals((at, "cfg", "flag"), bool, True),
              Equals((at, "cfg", "shape"), tuple, (2, 3)),
              Absent((at, "cfg", "gone")),
              SameObject((at, "block"), Ref(block)),
              SameObject((at, "block", "lin"), Ref(block.lin)),
              Equals((at, "block", "lin", "in_features"), int, 2))
    check = GuardChecker(guards)
    assert check() and check() and check.run is None
    assert check() and check.run.source.strip() == GOLDEN.strip()
    for undo in (lambda: setattr(inner, "flag", False), lambda: setattr(block, "lin", torch.nn.Linear(2, 2)),
                 lambda: setattr(inner, "gone", 1), lambda: setattr(inner, "shape", [2, 3])):
        undo()
        assert not check() and not guards_hold(guards)


GOLDEN_CALLS = """
# C++ guards
c0
  .cell_contents == 1.0
c1
  ['_hook_fn'] is <function object>
c2
  ._parameters keys ['weight', 'bias']
# then
def check():
    if identity_key(c0) != c1: return False
    if any(c2): return False
    if any(map(_contains, c4, c3)): return False
    return True
"""


def test_golden_guards_on_what_calling_a_module_runs() -> None:
    """A module without hooks: its hook tables stay empty and its ``__dict__`` gets no ``forward``, each
    tested with every other module's in one ``any`` (GPT-2's 176 modules: ~3 us); a module with a hook:
    the hook functions by identity (code), and what their code names -- a closure cell's value, a global
    function -- in the tree; a parameter table a trace read: its keys in order, in the tree."""
    def make() -> Callable[..., Any]:
        shift = 1.0
        return lambda m, a, o: _hook_fn(m, a, o) + shift

    plain, hooked = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    hooked.register_forward_hook(make())
    order = Keys((("id", Ref(hooked)), "_parameters"), ("weight", "bias"))
    guards = (Hooks.on(plain), Hooks.on(hooked), order)
    check = _ready(guards)
    assert check.run.source.strip() == GOLDEN_CALLS.strip()
    changes = (lambda: setattr(plain, "forward", types.MethodType(_doubled, plain)),
               lambda: plain.register_forward_pre_hook(print),
               lambda: hooked._forward_hooks.clear(),
               lambda: hooked._parameters.update(weight=hooked._parameters.pop("weight")))
    for change in changes:
        check = _ready(guards)
        state = (dict(vars(plain)), dict(plain._forward_pre_hooks), dict(hooked._forward_hooks),
                 dict(hooked._parameters))
        change()
        assert _both(check) == (False, False)
        changed = (plain.__dict__, plain._forward_pre_hooks, hooked._forward_hooks, hooked._parameters)
        for obj, was in zip(changed, state):
            obj.clear()
            obj.update(was)
        assert _both(check) == (True, True)


GOLDEN_HOOK_NAMES = """
# C++ guards
c0
  .cell_contents == 'lin0'
c1
  <hook 0> is <function object>
    <cell 'name'> == 'lin0'
  <hook 1> is <function object>
    <default 'n'> == 'lin0/pre'
# then
def check():
    if identity_key(c0) != c1: return False
    return True
"""


def test_golden_guards_on_names_hooks_close_over() -> None:
    """A compiled program whose region bodies take the names hooks close over as operands guards each one
    where the call site read it (``guards.hooks.hook_labels``): the hook at its position in the module's
    table, by identity, then its cell or default -- all in the tree (through the table's item by the hook's
    id, its keys unchanged, then the function's ``__closure__`` or ``__defaults__``), beside the module's
    Hooks guard; the first two calls interpret."""
    lin, name = torch.nn.Linear(2, 2), "lin0"
    lin.register_forward_hook(lambda m, a, o: (m, name))
    lin.register_forward_hook(lambda m, a, o, n="lin0/pre": (m, n))
    first, second = lin._forward_hooks.values()
    at = (("id", Ref(lin)),)
    guards = (Hooks.on(lin), SameObject((*at, ("hook", "_forward_hooks", 0)), Ref(first)),
              Equals((*at, ("hook", "_forward_hooks", 0), ("cell", 0, "name")), str, "lin0"),
              SameObject((*at, ("hook", "_forward_hooks", 1)), Ref(second)),
              Equals((*at, ("hook", "_forward_hooks", 1), ("default", 0, "n")), str, "lin0/pre"))
    check = _ready(guards)
    assert check.run.source.strip() == GOLDEN_HOOK_NAMES.strip()
    for change, undo in ((lambda: setattr(first.__closure__[0], "cell_contents", "x"),
                          lambda: setattr(first.__closure__[0], "cell_contents", "lin0")),
                         (lambda: setattr(second, "__defaults__", ("x",)),
                          lambda: setattr(second, "__defaults__", ("lin0/pre",))),
                         (lambda: lin._forward_hooks.move_to_end(next(iter(lin._forward_hooks))),
                          lambda: lin._forward_hooks.move_to_end(next(iter(lin._forward_hooks)))),
                         (lambda: lin._forward_hooks.clear(), lambda: None)):
        check = _ready(guards)
        change()
        assert _both(check) == (False, False)
        undo()


def test_a_checker_made_while_its_guards_fail_still_fails() -> None:
    """The third call makes the C++ tree; made while a dict item differs (an optimizer's ``lr`` changed
    since the capture), torch's dict accessor would take the unchanged dict for a holding guard."""
    group = {"lr": 0.1}
    check = GuardChecker((Equals((("id", Ref(group)), ("item", "lr")), float, 0.1),))
    assert check() and check()
    group["lr"] = 0.05
    assert not check() and check.run is None and not check()
    group["lr"] = 0.1
    assert check() and check.run is not None
    group["lr"] = 0.05
    assert not check()
    group["lr"] = 0.1
    assert check()


class Scaler:
    """A callable object: its reads cannot be watched, so a guard holds its state."""

    def __init__(self) -> None:
        self.scale = 1

    def __call__(self, x: Any) -> Any:
        return x * self.scale


def _hooked() -> tuple[Guard, Callable[[], None]]:
    lin = torch.nn.Linear(2, 2)
    handle = lin.register_forward_hook(lambda *a: None)
    return Hooks.on(lin), handle.remove


def _doubled(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(self).forward(self, x) * 2


def _hook_fn(module: Any, args: Any, out: Any) -> Any:
    return out


def _hook_naming_a_global() -> tuple[Guard, Callable[[], None]]:
    lin = torch.nn.Linear(2, 2)
    lin.register_forward_hook(lambda m, a, o: _hook_fn(m, a, o))

    def rebind() -> None:
        global _hook_fn
        _hook_fn = lambda m, a, o: o * 2  # noqa: E731
    return Hooks.on(lin), rebind


def _hook_name() -> tuple[Guard, Callable[[], None]]:
    """A compiled program's guard on a string a layer's hook closes over, which its region body took as an
    operand (``guards.hooks.hook_labels``): read through the hook, in the generated code."""
    lin, name = torch.nn.Linear(2, 2), "lin0"
    lin.register_forward_hook(lambda m, a, o: (m, name))
    path = (("id", Ref(lin)), ("hook", "_forward_hooks", 0), ("cell", 0, "name"))
    (hook,) = lin._forward_hooks.values()
    return Equals(path, str, "lin0"), lambda: setattr(hook.__closure__[0], "cell_contents", "renamed")


def _kind_case(make: Callable[[Any], Guard], change: Callable[[Any], None], **fields: Any
               ) -> Callable[[], tuple[Guard, Callable[[], None]]]:
    def case() -> tuple[Guard, Callable[[], None]]:
        root = Obj(**fields)
        return make(root), lambda: change(root)
    return case


def _at(root: Any, *steps: Any) -> tuple:
    return (("id", Ref(root)), *steps)


# per guard kind: (the guard on an object as it is, a change that breaks it), what it says it expects and
# what it says of the value after the change, and where a compiled checker checks it
KIND_CASES: dict[str, tuple[Callable[[], tuple[Guard, Callable[[], None]]], str, str, str]] = {
    "Equals": (_kind_case(lambda r: Equals(_at(r, "flag"), bool, True), lambda r: setattr(r, "flag", False),
                          flag=True), "True", "False", "tree"),
    "Equals, frozen": (_kind_case(lambda r: guard_on(_at(r, "sizes"), r.sizes, structural=False),
                                  lambda r: r.sizes.append(3), sizes=[1, 2]),
                       "('list', (1, 2))", "a list", "interpreted"),
    "SameObject": (_kind_case(lambda r: SameObject(_at(r, "cfg"), Ref(r.cfg)),
                              lambda r: setattr(r, "cfg", Obj()), cfg=Obj()),
                   "that Obj object", "a Obj", "tree"),
    "OfType": (_kind_case(lambda r: OfType(_at(r, "cfg"), Obj), lambda r: setattr(r, "cfg", Mod()),
                          cfg=Obj()), "a Obj", "a Mod", "code"),
    "ObjectState": (_kind_case(lambda r: guard_on(_at(r, "fn"), r.fn, structural=False),
                               lambda r: setattr(r.fn, "scale", 2), fn=Scaler()),
                    "that Scaler object in that state", "a Scaler", "code"),
    "IsStr": (_kind_case(lambda r: IsStr(_at(r, "name")), lambda r: setattr(r, "name", 1), name="a"),
              "a str (an operand)", "1", "interpreted"),
    "Absent": (_kind_case(lambda r: Absent(_at(r, "gone")), lambda r: setattr(r, "gone", 1)),
               "<missing>", "1", "code"),
    "Hooks": (_hooked, "1 hook", "0 hooks", "code"),
    "Hooks, none": (lambda: (lambda lin: (Hooks.on(lin), lambda: lin.register_forward_pre_hook(print)))(
        torch.nn.Linear(2, 2)), "0 hooks", "1 hook", "code"),
    "Hooks, global": (lambda: (Hooks.on(GLOBAL), lambda: _GLOBAL_HOOKS.append(
        torch.nn.modules.module.register_module_forward_hook(lambda *a: None))), "0 hooks", "1 hook", "code"),
    "Hooks, an instance forward assigned": (lambda: (lambda lin: (Hooks.on(lin), lambda: setattr(
        lin, "forward", types.MethodType(_doubled, lin))))(torch.nn.Linear(2, 2)),
        "0 hooks", "0 hooks, an instance forward", "code"),
    "Hooks, a global the hook names rebound": (_hook_naming_a_global, "1 hook", "1 hook (_hook_fn rebound)",
                                               "code"),
    "Equals, a name a hook closes over": (_hook_name, "'lin0'", "'renamed'", "tree"),
    "Keys": (_kind_case(lambda r: guard_on(_at(r, "_parameters"), r._parameters, structural=False),
                        lambda r: r._parameters.update(a=r._parameters.pop("a")),
                        _parameters={"a": 1, "b": 2}),
             "keys ('a', 'b')", "keys ('b', 'a')", "tree"),
}
_GLOBAL_HOOKS: list[Any] = []


def test_every_guard_kind_has_a_case() -> None:
    """Adding a guard kind is its class and its case here."""
    every = {c for c in vars(kinds).values() if isinstance(c, type) and issubclass(c, Guard)} - {Guard}
    assert every == {type(case()[0]) for case, *_ in KIND_CASES.values()}


@pytest.mark.parametrize("name", sorted(KIND_CASES))
def test_each_guard_kind_holds_fails_and_says_so(name: str) -> None:
    """Each kind holds on the state it was made of, then fails after the change: compiled (in the C++ tree,
    the generated code or by interpretation, as it says) and interpreted alike; ``efx.compile``'s words."""
    make, expected, found, where = KIND_CASES[name]
    guard, change = make()
    check = _ready((guard,))
    code = check.run.source.split("# then\n")[1]
    assert {"tree": code == "def check():\n    return True\n", "interpreted": "_then()" in code,
            "code": "return False" in code and "_then" not in code}[where], check.run.source
    try:
        change()
        assert _both(check) == (False, False)
        ((failed, now),) = failed_guards((guard,))
        assert failed is guard and (guard.describe(), guard.found_text(now)) == (expected, found)
    finally:
        while _GLOBAL_HOOKS:
            _GLOBAL_HOOKS.pop().remove()


def test_guards_are_equal_by_kind_and_value_and_objects_by_identity() -> None:
    """Guards are parts of a body's cache key: equal guards hash alike; a Ref compares by identity."""
    a, b = Obj(x=1), Obj(x=1)
    at = _at(a, "x")
    assert Equals(at, int, 1) == Equals(at, int, 1) and hash(Equals(at, int, 1)) == hash(Equals(at, int, 1))
    assert Equals(at, int, 1) != Equals(at, bool, True) and IsStr(at) != Absent(at)
    assert SameObject(at, Ref(a)) == SameObject(at, Ref(a))
    assert SameObject(at, Ref(a)) != SameObject(at, Ref(b))
    assert Equals(at, int, 1) != Equals(_at(b, "x"), int, 1)
    assert guard_on(at, MISSING, structural=False) == Absent(at)


def test_a_training_step_s_steady_calls_do_not_check_its_first_program() -> None:
    """AdamW's first step makes the program that creates its state; from the second on that program's guards
    fail, and a failing program's guards are interpreted (all of them: ~7 ms a call on GPT-2's step).  The
    program used last is checked first, so the steady calls never check the first program.  Values stay
    eager's."""

    def make() -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return model, step

    x = torch.randn(3, 4)
    eager_model, eager_step = make()
    model, step = make()
    compiled = efx.compile(step)
    for _ in range(5):  # the first program, then the second: its guards are compiled at its 3rd check
        torch.testing.assert_close(compiled(x), eager_step(x))
    (entries,) = compiled.cache.values()
    first, steady = entries  # (compile order)
    assert steady.check.run is not None and first.check.run is None
    checks = first.check.calls
    for _ in range(5):
        torch.testing.assert_close(compiled(x), eager_step(x))
    assert first.check.calls == checks
    assert compiled.stats.compiles == 2
    for p, q in zip(model.parameters(), eager_model.parameters()):
        torch.testing.assert_close(p, q)
