# ruff: noqa: E501  (golden graph text has long lines)
"""Golden graph tests for capture: the seed's Before/After forms (README.md's seed example, captured
and functionalized) and every capture scenario below.

The expected texts are the normalized program text (``prog.code()``: root first, then every subgraph once,
FX bookkeeping stripped).  Every functionalized program is also checked against the token invariants of
Note [Effect tokens] (one linear chain per key, sorted token positions, no bare effectful op).
"""

from __future__ import annotations

import operator
import re
import textwrap

import pytest
import torch

import effectfx as efx
import effectfx.testing  # noqa: F401  (registers the efxtest:: ops)
from effectfx import ops
from effectfx.effects import effect_of
from effectfx.testing.models import Stack

R = torch.ops.efxtest


# -- the seed's op, under our own namespace ----------------------------------------------------------
@torch.library.custom_op("efxtcap::record_memory", mutates_args=())
def _record_memory(prefix: str, module_name: str) -> None:
    SEED_LOG.append((prefix, module_name))


@_record_memory.register_fake
def _(prefix: str, module_name: str) -> None:
    return None


SEED_LOG: list[tuple[str, str]] = []
efx.register_effect(torch.ops.efxtcap.record_memory.default, key="memory")


@efx.region
def repeated(x):
    torch.ops.efxtcap.record_memory("forward", "N")
    return x + x


# -- helpers --------------------------------------------------------------------------------------------
def dedent(s: str) -> str:
    return textwrap.dedent(s).strip("\n")


def token_keys_of(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    return tuple(gm.meta.get("effectfx_token_keys", ()))


def check_token_chains(prog: efx.Program) -> None:
    """Note [Effect tokens] on every graph of a functionalized program (root and each subgraph): per key one linear
    chain from the token input to the token output, in program order; no bare effectful op."""
    check_graph_tokens(prog.graph_module, tuple(prog.token_keys))
    for gm in prog.subgraphs().values():
        check_graph_tokens(gm, token_keys_of(gm))


def check_graph_tokens(gm: torch.fx.GraphModule, keys: tuple[str, ...]) -> None:
    assert list(keys) == sorted(keys), gm.code
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert all(n.name.startswith("token") for n in placeholders[: len(keys)]), gm.code
    assert not any(n.name.startswith("token") for n in placeholders[len(keys):]), gm.code
    current = dict(zip(keys, placeholders[: len(keys)]))
    seen = list(current.values())

    def advance(node: torch.fx.Node, index: int, key: str) -> None:
        users = [u for u in node.users if u.target is operator.getitem and u.args[1] == index]
        assert len(users) == 1, f"token output {index} of {node.name} used by {users} in\n{gm.code}"
        current[key] = users[0]
        seen.append(users[0])

    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        assert effect_of(node.target) is None, f"bare effectful op {node.target} in\n{gm.code}"
        if node.target is ops.with_effects:
            key = effect_of(node.args[1])
            assert key in current, f"{node.name} uses key {key} not among {keys}"
            assert node.args[0] is current[key], f"{node.name} breaks the {key} chain in\n{gm.code}"
            advance(node, 0, key)
        elif node.target is ops.invoke_subgraph:
            callee_keys = token_keys_of(getattr(gm, node.args[0].target))
            assert list(node.args[2: 2 + len(callee_keys)]) == [current[k] for k in callee_keys], \
                f"{node.name} does not thread the current tokens in\n{gm.code}"
            for j, key in enumerate(callee_keys):
                advance(node, j, key)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    assert list(output.args[0][: len(keys)]) == [current[k] for k in keys], gm.code
    for t in seen:  # every token value is consumed exactly once
        assert len(t.users) == 1, f"token {t.name} has users {list(t.users)} in\n{gm.code}"


# -- the seed -------------------------------------------------------------------------------------------
SEED_AFTER = '''
def forward(self, token, x):
    repeated_subgraph0 = self.repeated_subgraph0
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(repeated_subgraph0, 'subgraph_0', token, x)
    getitem = invoke_subgraph[0]  # output token
    getitem_1 = invoke_subgraph[1]
    return (getitem, getitem_1)

def repeated_subgraph(self, token, x):
    with_effects = torch.ops.higher_order.with_effects(token, torch.ops.mylib.record_memory.default, 'forward', 'N')
    getitem = with_effects[0]  # output token
    add = torch.ops.aten.add(x, x)
    return  (getitem, add)
'''

SEED_BEFORE = '''
def forward(self, x):
    repeated_subgraph0 = self.repeated_subgraph0
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(repeated_subgraph0, 'subgraph_0', x)
    return invoke_subgraph

def repeated_subgraph(self, x):
    record_memory = torch.ops.mylib.record_memory.default("forward", "N")
    add = torch.ops.aten.add(x, x)
    return add
'''


def normalize_seed(text: str) -> list[str]:
    """The seed's text in our vocabulary: our op namespace and targets, the overload FX prints, no comments,
    no subgraph header, and the subgraph named by its attribute."""
    lines = []
    for line in text.strip().splitlines():
        line = line.split("#")[0].rstrip()
        if not line:
            continue
        line = line.replace("torch.ops.higher_order.", "effectfx.ops.").replace("mylib", "efxtcap")
        line = line.replace("aten.add(", "aten.add.Tensor(").replace("return  (", "return (")
        line = line.replace("def repeated_subgraph(", "def repeated_subgraph0(").replace('"', "'")
        lines.append(line)
    return lines


def normalize_ours(code: str) -> list[str]:
    return [ln for ln in code.splitlines() if ln.strip() and not ln.startswith("# ")]


def test_seed_after_matches_the_seed_exactly():
    prog = efx.capture(lambda x: repeated(x), torch.randn(4))
    assert normalize_ours(prog.code()) == normalize_seed(SEED_AFTER)
    check_token_chains(prog)


def test_seed_after_golden_text():
    prog = efx.capture(lambda x: repeated(x), torch.randn(4))
    assert prog.code() == dedent('''
        def forward(self, token, x):
            repeated_subgraph0 = self.repeated_subgraph0
            invoke_subgraph = effectfx.ops.invoke_subgraph(repeated_subgraph0, 'subgraph_0', token, x)
            getitem = invoke_subgraph[0]
            getitem_1 = invoke_subgraph[1]
            return (getitem, getitem_1)

        # repeated_subgraph0: 'subgraph_0'
        def repeated_subgraph0(self, token, x):
            with_effects = effectfx.ops.with_effects(token, torch.ops.efxtcap.record_memory.default, 'forward', 'N')
            getitem = with_effects[0]
            add = torch.ops.aten.add.Tensor(x, x)
            return (getitem, add)
    ''')
    assert prog.token_keys == ("memory",)
    assert prog.region_traces == {"subgraph_0": 1}
    assert prog.region_effects == {"subgraph_0": frozenset({"memory"})}


def test_seed_before_golden_text():
    prog = efx.capture(lambda x: repeated(x), torch.randn(4), functionalize=False)
    assert prog.code() == dedent('''
        def forward(self, x):
            repeated_subgraph0 = self.repeated_subgraph0
            invoke_subgraph = effectfx.ops.invoke_subgraph(repeated_subgraph0, 'subgraph_0', x)
            getitem = invoke_subgraph[0]
            return (getitem,)

        # repeated_subgraph0: 'subgraph_0'
        def repeated_subgraph0(self, x):
            record_memory = torch.ops.efxtcap.record_memory.default('forward', 'N')
            add = torch.ops.aten.add.Tensor(x, x)
            return (add,)
    ''')
    # the seed's Before, modulo our tuple-returning convention for invoke_subgraph
    seed = normalize_seed(SEED_BEFORE)
    ours = normalize_ours(prog.code())
    assert [ln for ln in ours if "getitem" not in ln and "return" not in ln] == \
        [ln for ln in seed if "return" not in ln]


def test_seed_runs_like_eager_in_both_forms():
    x = torch.randn(4)
    for functionalize in (False, True):
        prog = efx.capture(lambda x: repeated(x), x, functionalize=functionalize)
        assert SEED_LOG == []  # capture never runs the effect
        out = prog(x)
        assert torch.equal(out, x + x)
        assert SEED_LOG == [("forward", "N")]
        SEED_LOG.clear()


def test_str_has_header_root_and_subgraph():
    prog = efx.capture(lambda x: repeated(repeated(x)), torch.randn(4))
    text = str(prog)
    header, rest = text.split("\n", 1)
    assert header.startswith("# effectfx ") and "functionalized form" in header and "thread_tokens" in header
    assert "# tokens (in order): memory" in rest
    assert rest.endswith(prog.code())
    assert text.count("def forward(self, token, x):") == 1
    assert text.count("def repeated_subgraph0(self, token, x):") == 1  # shared subgraph printed once
    assert text.count("effectfx.ops.invoke_subgraph(") == 2


# -- point-5 scenarios ----------------------------------------------------------------------------------
def test_chained_golden():
    prog = efx.capture(lambda x: repeated(repeated(x)), torch.randn(4))
    assert prog.code().split("\n\n")[0] == dedent('''
        def forward(self, token, x):
            repeated_subgraph0 = self.repeated_subgraph0
            invoke_subgraph = effectfx.ops.invoke_subgraph(repeated_subgraph0, 'subgraph_0', token, x)
            getitem = invoke_subgraph[0]
            getitem_1 = invoke_subgraph[1]
            invoke_subgraph_1 = effectfx.ops.invoke_subgraph(repeated_subgraph0, 'subgraph_0', getitem, getitem_1)
            getitem_2 = invoke_subgraph_1[0]
            getitem_3 = invoke_subgraph_1[1]
            return (getitem_2, getitem_3)
    ''')
    check_token_chains(prog)


@efx.region
def multi(x):
    R.record_memory("m")
    R.record_stdout("s")
    R.record_collective_tp("c")
    R.record_memory("m2")
    return x * 2


def test_several_keys_in_one_region_golden():
    prog = efx.capture(lambda x: multi(x) + 1, torch.randn(3))
    assert prog.code() == dedent('''
        def forward(self, token_collective_tp, token_memory, token_stdout, x):
            multi_subgraph0 = self.multi_subgraph0
            invoke_subgraph = effectfx.ops.invoke_subgraph(multi_subgraph0, 'subgraph_0', token_collective_tp, token_memory, token_stdout, x)
            getitem = invoke_subgraph[0]
            getitem_1 = invoke_subgraph[1]
            getitem_2 = invoke_subgraph[2]
            getitem_3 = invoke_subgraph[3]
            add = torch.ops.aten.add.Tensor(getitem_3, 1)
            return (getitem, getitem_1, getitem_2, add)

        # multi_subgraph0: 'subgraph_0'
        def multi_subgraph0(self, token_collective_tp, token_memory, token_stdout, x):
            with_effects = effectfx.ops.with_effects(token_memory, torch.ops.efxtest.record_memory.default, 'm')
            getitem = with_effects[0]
            with_effects_1 = effectfx.ops.with_effects(token_stdout, torch.ops.efxtest.record_stdout.default, 's')
            getitem_1 = with_effects_1[0]
            with_effects_2 = effectfx.ops.with_effects(token_collective_tp, torch.ops.efxtest.record_collective_tp.default, 'c')
            getitem_2 = with_effects_2[0]
            with_effects_3 = effectfx.ops.with_effects(getitem, torch.ops.efxtest.record_memory.default, 'm2')
            getitem_3 = with_effects_3[0]
            mul = torch.ops.aten.mul.Tensor(x, 2)
            return (getitem_2, getitem_3, getitem_1, mul)
    ''')
    assert prog.token_keys == ("collective:tp", "memory", "stdout")
    assert prog.region_effects == {"subgraph_0": frozenset({"collective:tp", "memory", "stdout"})}
    check_token_chains(prog)


@efx.region
def inner(x):
    R.record_memory("inner")
    return x.sin()


@efx.region
def outer(x):
    R.record_stdout("outer")
    return inner(x) * inner(x + 1)


def test_nested_regions_effects_at_both_levels_golden():
    def f(x):
        R.record_memory("top")
        return outer(x)

    prog = efx.capture(f, torch.randn(3))
    assert prog.code() == dedent('''
        def forward(self, token_memory, token_stdout, x):
            with_effects = effectfx.ops.with_effects(token_memory, torch.ops.efxtest.record_memory.default, 'top')
            getitem = with_effects[0]
            outer_subgraph0 = self.outer_subgraph0
            invoke_subgraph = effectfx.ops.invoke_subgraph(outer_subgraph0, 'subgraph_0', getitem, token_stdout, x)
            getitem_1 = invoke_subgraph[0]
            getitem_2 = invoke_subgraph[1]
            getitem_3 = invoke_subgraph[2]
            return (getitem_1, getitem_2, getitem_3)

        # outer_subgraph0: 'subgraph_0'
        def outer_subgraph0(self, token_memory, token_stdout, x):
            with_effects = effectfx.ops.with_effects(token_stdout, torch.ops.efxtest.record_stdout.default, 'outer')
            getitem = with_effects[0]
            inner_subgraph1 = self.inner_subgraph1
            invoke_subgraph = effectfx.ops.invoke_subgraph(inner_subgraph1, 'subgraph_1', token_memory, x)
            getitem_1 = invoke_subgraph[0]
            getitem_2 = invoke_subgraph[1]
            add = torch.ops.aten.add.Tensor(x, 1)
            invoke_subgraph_1 = effectfx.ops.invoke_subgraph(inner_subgraph1, 'subgraph_1', getitem_1, add)
            getitem_3 = invoke_subgraph_1[0]
            getitem_4 = invoke_subgraph_1[1]
            mul = torch.ops.aten.mul.Tensor(getitem_2, getitem_4)
            return (getitem_3, getitem, mul)

        # inner_subgraph1: 'subgraph_1'
        def inner_subgraph1(self, token, x):
            with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.record_memory.default, 'inner')
            getitem = with_effects[0]
            sin = torch.ops.aten.sin.default(x)
            return (getitem, sin)
    ''')
    assert prog.region_traces == {"subgraph_0": 1, "subgraph_1": 1}
    assert prog.region_effects == {"subgraph_0": frozenset({"memory", "stdout"}),
                                   "subgraph_1": frozenset({"memory"})}
    check_token_chains(prog)


@efx.region
def only_effects(x):
    R.log_tensor(x, "only")
    return x * 3


def test_effect_only_region_is_not_dead_code_golden():
    def f(x):
        only_effects(x)  # output unused
        return x + 1

    prog = efx.capture(f, torch.randn(3))
    assert prog.code().split("\n\n")[0] == dedent('''
        def forward(self, token, x):
            only_effects_subgraph0 = self.only_effects_subgraph0
            invoke_subgraph = effectfx.ops.invoke_subgraph(only_effects_subgraph0, 'subgraph_0', token, x)
            getitem = invoke_subgraph[0]
            add = torch.ops.aten.add.Tensor(x, 1)
            return (getitem, add)
    ''')
    check_token_chains(prog)
    before = efx.capture(f, torch.randn(3), functionalize=False)
    assert "invoke_subgraph(only_effects_subgraph0, 'subgraph_0', x)" in before.code()
    assert "log_tensor.default(x, 'only')" in before.code()


def test_loop_with_top_level_effects_golden():
    def f(x):
        R.record_stdout("before")
        for _ in range(3):
            x = repeated(x)
        R.record_stdout("after")
        return x

    prog = efx.capture(f, torch.randn(2))
    root = prog.code().split("\n\n")[0]
    assert root == dedent('''
        def forward(self, token_memory, token_stdout, x):
            with_effects = effectfx.ops.with_effects(token_stdout, torch.ops.efxtest.record_stdout.default, 'before')
            getitem = with_effects[0]
            repeated_subgraph0 = self.repeated_subgraph0
            invoke_subgraph = effectfx.ops.invoke_subgraph(repeated_subgraph0, 'subgraph_0', token_memory, x)
            getitem_1 = invoke_subgraph[0]
            getitem_2 = invoke_subgraph[1]
            invoke_subgraph_1 = effectfx.ops.invoke_subgraph(repeated_subgraph0, 'subgraph_0', getitem_1, getitem_2)
            getitem_3 = invoke_subgraph_1[0]
            getitem_4 = invoke_subgraph_1[1]
            invoke_subgraph_2 = effectfx.ops.invoke_subgraph(repeated_subgraph0, 'subgraph_0', getitem_3, getitem_4)
            getitem_5 = invoke_subgraph_2[0]
            getitem_6 = invoke_subgraph_2[1]
            with_effects_1 = effectfx.ops.with_effects(getitem, torch.ops.efxtest.record_stdout.default, 'after')
            getitem_7 = with_effects_1[0]
            return (getitem_5, getitem_7, getitem_6)
    ''')
    assert prog.region_traces == {"subgraph_0": 1}
    check_token_chains(prog)


def test_inplace_on_intermediates_functionalized_golden():
    def f(x):
        y = x * 2
        y.add_(1)
        return y.relu_()

    for functionalize in (False, True):
        prog = efx.capture(f, torch.randn(3), functionalize=functionalize)
        assert prog.code() == dedent('''
            def forward(self, x):
                mul = torch.ops.aten.mul.Tensor(x, 2)
                add = torch.ops.aten.add.Tensor(mul, 1)
                relu = torch.ops.aten.relu.default(add)
                return (relu,)
        ''')


def test_inplace_inside_region_functionalized_golden():
    @efx.region
    def r(x):
        y = x * 2
        y.mul_(3)
        R.record_memory("r")
        return torch.relu_(y)

    prog = efx.capture(lambda x: r(x), torch.randn(3))
    body = prog.code().split("\n\n")[1]
    assert body == dedent('''
        # r_subgraph0: 'subgraph_0'
        def r_subgraph0(self, token, x):
            mul = torch.ops.aten.mul.Tensor(x, 2)
            mul_1 = torch.ops.aten.mul.Tensor(mul, 3)
            with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.record_memory.default, 'r')
            getitem = with_effects[0]
            relu = torch.ops.aten.relu.default(mul_1)
            return (getitem, relu)
    ''')


def test_aten_print_is_ordered_golden():
    def f(x):
        torch.ops.aten._print("hi")
        return x + 1

    prog = efx.capture(f, torch.randn(2))
    assert prog.code() == dedent('''
        def forward(self, token, x):
            with_effects = effectfx.ops.with_effects(token, torch.ops.aten._print.default, 'hi')
            getitem = with_effects[0]
            add = torch.ops.aten.add.Tensor(x, 1)
            return (getitem, add)
    ''')
    assert prog.token_keys == ("ordered",)
    before = efx.capture(f, torch.randn(2), functionalize=False)
    assert "_print = torch.ops.aten._print.default('hi')" in before.code()


# -- a module of blocks ---------------------------------------------------------------------------------
# Block (relu + record_memory) and Stack come from effectfx.testing.models


def test_module_blocks_inference_golden():
    model = Stack(2, width=3)
    with torch.no_grad():
        after = efx.capture(model, torch.randn(2, 3))
        before = efx.capture(model, torch.randn(2, 3), functionalize=False)
    assert after.code() == dedent('''
        def forward(self, token, x, blocks_0_lin_weight, blocks_0_lin_bias, blocks_1_lin_weight, blocks_1_lin_bias):
            block_forward_subgraph0 = self.Block_forward_subgraph0
            invoke_subgraph = effectfx.ops.invoke_subgraph(block_forward_subgraph0, 'subgraph_0', token, x, blocks_0_lin_weight, blocks_0_lin_bias)
            getitem = invoke_subgraph[0]
            getitem_1 = invoke_subgraph[1]
            invoke_subgraph_1 = effectfx.ops.invoke_subgraph(block_forward_subgraph0, 'subgraph_0', getitem, getitem_1, blocks_1_lin_weight, blocks_1_lin_bias)
            getitem_2 = invoke_subgraph_1[0]
            getitem_3 = invoke_subgraph_1[1]
            return (getitem_2, getitem_3)

        # Block_forward_subgraph0: 'subgraph_0'
        def Block_forward_subgraph0(self, token, x, lin_weight, lin_bias):
            with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.record_memory.default, 'block')
            getitem = with_effects[0]
            t = torch.ops.aten.t.default(lin_weight)
            addmm = torch.ops.aten.addmm.default(lin_bias, x, t)
            relu = torch.ops.aten.relu.default(addmm)
            return (getitem, relu)
    ''')
    check_token_chains(after)
    assert re.search(r"def Block_forward_subgraph0\(self, x, lin_weight, lin_bias\):\n"
                     r"    record_memory = torch.ops.efxtest.record_memory.default\('block'\)\n", before.code())
    assert after.region_traces == before.region_traces == {"subgraph_0": 1}


@pytest.mark.parametrize("n", [1, 4])
def test_token_chains_hold_for_deep_nesting(n):
    @efx.region
    def leaf(x):
        R.record_memory("leaf")
        R.record_stdout("leaf")
        return x + 1

    @efx.region
    def mid(x):
        for _ in range(n):
            x = leaf(x)
        R.record_collective_tp("mid")
        return x

    @efx.region
    def top(x):
        R.record_memory("top")
        return mid(mid(x))

    prog = efx.capture(lambda x: top(x) * top(x), torch.randn(2))
    check_token_chains(prog)
    assert prog.region_traces == {"subgraph_0": 1, "subgraph_1": 1, "subgraph_2": 1}
    assert set(prog.region_effects.values()) == {frozenset({"collective:tp", "memory", "stdout"}),
                                                 frozenset({"memory", "stdout"})}


def test_token_checker_catches_a_forked_chain():
    # the checker above must be able to fail: reuse the first token for the second call (a fork)
    prog = efx.capture(lambda x: repeated(repeated(x)), torch.randn(4))
    check_token_chains(prog)
    gm = prog.graph_module
    calls = [n for n in gm.graph.nodes if n.target is ops.invoke_subgraph]
    token = next(n for n in gm.graph.nodes if n.op == "placeholder")
    calls[1].update_arg(2, token)
    with pytest.raises(AssertionError):
        check_graph_tokens(gm, prog.token_keys)
