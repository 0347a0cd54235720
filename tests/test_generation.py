# ruff: noqa: E501  (golden graph text has long lines)
"""Containers written back (Note [Mutations], ``effectfx.program.containers``) and generation with caches:
transformers' ``DynamicCache`` grown by ``torch.cat`` and ``StaticCache`` updated in place, through
``efx.compile(model).generate`` -- tokens, effect logs and the caller's cache exactly as eager's."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch
from torch.utils._pytree import tree_flatten
from transformers import DynamicCache, StaticCache

import effectfx as efx
import effectfx.testing  # noqa: F401  (registers the efxtest:: ops)
from effectfx.testing import hf
from effectfx.testing.effect_ops import recording

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")


def _generate_both(kind: str, **options: object) -> tuple[object, object]:
    model = hf.build(kind).eval()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, hf.VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    options = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 0, "use_cache": True, **options}
    with recording() as want:
        expected = reference.generate(ids, **options)
    compiled = efx.compile(model)
    with recording() as got:
        tokens = compiled.generate(ids, **options)
    assert torch.equal(tokens, expected) and tokens.shape[1] == 5 + 16
    assert got == want and len(got) == 16 * hf.LAYERS
    return compiled, tokens


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_generation_with_a_dynamic_cache(kind: str) -> None:
    compiled, _ = _generate_both(kind)
    # the prefill, the first decode step (a cache now initialized) and one symbolic program for the rest
    assert compiled.stats.compiles == 3
    why = [p.why for p in efx.explain(compiled).programs]
    assert why[1].startswith(f"argument structure: kwargs['cache'] (DynamicCache): 0 leaves -> "
                             f"{2 * hf.LAYERS} leaves")
    assert why[2].endswith("symbolic sizes (automatic dynamic: sizes changed)")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_generation_with_a_static_cache_reuses_one_decode_program(kind: str) -> None:
    compiled, _ = _generate_both(kind, cache_implementation="static")
    assert compiled.stats.compiles == 2  # the prefill, and every decode step


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_caller_s_cache_ends_as_eager_s(kind: str) -> None:
    model = hf.build(kind).eval()
    reference = copy.deepcopy(model)
    compiled = efx.compile(model)
    mine, theirs = DynamicCache(config=model.config), DynamicCache(config=model.config)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for step in range(4):
            ids = torch.randint(0, hf.VOCAB, (1, 5 if step == 0 else 1), generator=generator)
            with recording() as got:
                out = compiled(input_ids=ids, past_key_values=mine, use_cache=True)
            with recording() as want:
                expected = reference(input_ids=ids, past_key_values=theirs, use_cache=True)
            assert got == want and torch.allclose(out.logits, expected.logits, atol=1e-5)
            assert out.past_key_values is mine  # the very object, as eager returns it
            assert mine.get_seq_length() == theirs.get_seq_length() == 5 + step
            for a, b in zip(mine.layers, theirs.layers):
                assert torch.allclose(a.keys, b.keys, atol=1e-6) and torch.allclose(a.values, b.values, atol=1e-6)



@pytest.fixture
def rebuilt(monkeypatch: pytest.MonkeyPatch) -> dict[type, int]:
    """How many times pytree builds each transformers cache class anew (its unflatten)."""
    from torch.utils import _pytree

    from effectfx.program.containers import register_tensor_holders

    register_tensor_holders()
    counts: dict[type, int] = {}
    for cls in (DynamicCache, StaticCache):
        node = _pytree.SUPPORTED_NODES[cls]

        def counted(values: object, context: object, cls: type = cls, unflatten: object = node.unflatten_fn
                    ) -> object:
            counts[cls] = counts.get(cls, 0) + 1
            return unflatten(values, context)  # type: ignore[operator]

        monkeypatch.setitem(_pytree.SUPPORTED_NODES, cls, node._replace(unflatten_fn=counted))
    return counts


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_returned_cache_is_the_caller_s_and_not_rebuilt(kind: str, rebuilt: dict[type, int]) -> None:
    """The model returns the cache it was given: eager's ``out.past_key_values is cache``, and so is
    effectfx's, without rebuilding it from the graph's outputs; a DynamicCache's new state is written into
    the caller's leaf by leaf, its layers staying the caller's, as eager's do (``program.returned``)."""
    model = hf.build("gpt2").eval()
    reference = copy.deepcopy(model)
    compiled = efx.compile(model)

    def new_cache() -> object:
        if kind == "dynamic":
            return DynamicCache(config=model.config)
        return StaticCache(config=model.config, max_cache_len=16)

    mine, theirs = new_cache(), new_cache()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for step in range(6):
            ids = torch.randint(0, hf.VOCAB, (1, 5 if step == 0 else 1), generator=generator)
            at = torch.arange(ids.shape[1]) + (step and 4 + step)
            options = {} if kind == "dynamic" else {"cache_position": at}
            compiles = compiled.stats.compiles
            with recording() as want:
                expected = reference(input_ids=ids, past_key_values=theirs, use_cache=True, **options)
            tensors = [t for layer in getattr(mine, "layers", ()) for t in (layer.keys, layer.values)]
            layers = list(mine.layers)
            rebuilt.clear()
            with recording() as got:
                out = compiled(input_ids=ids, past_key_values=mine, use_cache=True, **options)
            assert expected.past_key_values is theirs and out.past_key_values is mine
            assert got == want and torch.allclose(out.logits, expected.logits, atol=1e-5)
            if compiled.stats.compiles == compiles:  # (a capture flattens and builds it as it likes)
                assert rebuilt.get(type(mine), 0) == 0
                assert all(a is b for a, b in zip(layers, mine.layers, strict=True))
            for a, b in zip(mine.layers, theirs.layers):
                assert torch.allclose(a.keys, b.keys, atol=1e-6)
                assert torch.allclose(a.values, b.values, atol=1e-6)
            if kind == "static" and step:  # updated in place: the caller's very tensors
                assert all(a is b for a, b in zip(tensors, [t for layer in mine.layers
                                                            for t in (layer.keys, layer.values)]))


@pytest.mark.parametrize("grad", [False, True])
def test_a_growing_cache_s_new_tensors_go_into_the_caller_s_layers(grad: bool) -> None:
    """A DynamicCache's layers take their longer tensors in place, as eager's code left them: the caller's
    layer objects stay (``program.returned``), under autograd too (a training program's outputs)."""
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10, eos_token_id=None, bos_token_id=None)
    w = torch.randn(8, requires_grad=grad)

    def f(x: torch.Tensor, cache: DynamicCache) -> tuple[torch.Tensor, DynamicCache]:
        k = (x * w).view(1, 2, -1, 4)
        keys, values = cache.update(k, k * 2, 0)
        return keys.sum() + values.sum(), cache

    compiled = efx.compile(f)
    mine, theirs = DynamicCache(config=config), DynamicCache(config=config)
    for step in range(5):
        x = torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(step))
        expected, _ = f(x, theirs)
        layers = list(mine.layers)
        got, cache = compiled(x, mine)
        assert cache is mine and torch.allclose(got, expected)
        assert torch.equal(mine.layers[0].keys, theirs.layers[0].keys)
        assert torch.equal(mine.layers[0].values, theirs.layers[0].values)
        assert mine.layers[0].keys.requires_grad == theirs.layers[0].keys.requires_grad == grad
        if step:  # (the first call initializes the layers: a new structure, written as a whole)
            assert all(a is b for a, b in zip(layers, mine.layers, strict=True))
        if grad:
            want = torch.autograd.grad(expected, w, retain_graph=True)[0]
            assert torch.allclose(torch.autograd.grad(got, w, retain_graph=True)[0], want)
    assert compiled.stats.compiles == 3

# -- lists: a region's, and the root's -----------------------------------------------------------------------
@efx.region
def remember(x: torch.Tensor, seen: list) -> torch.Tensor:
    torch.ops.efxtest.record_memory("remember")
    seen.append(x.sin())
    return x * 2


def two_steps(x: torch.Tensor, seen: list) -> torch.Tensor:
    y = remember(remember(x, seen), seen)
    return y + torch.stack(seen).sum(0)


GOLDEN = """
def forward(self, token, x, seen_0):
    remember_subgraph0 = self.remember_subgraph0
    invoke_subgraph = effectfx.ops.invoke_subgraph(remember_subgraph0, 'subgraph_0', token, x, seen_0)
    getitem = invoke_subgraph[0]
    getitem_1 = invoke_subgraph[1]
    getitem_2 = invoke_subgraph[3]
    remember_subgraph1 = self.remember_subgraph1
    invoke_subgraph_1 = effectfx.ops.invoke_subgraph(remember_subgraph1, 'subgraph_1', getitem, getitem_1, seen_0, getitem_2)
    getitem_3 = invoke_subgraph_1[0]
    getitem_4 = invoke_subgraph_1[1]
    getitem_5 = invoke_subgraph_1[4]
    stack = torch.ops.aten.stack.default([seen_0, getitem_2, getitem_5])
    sum_1 = torch.ops.aten.sum.dim_IntList(stack, [0])
    add = torch.ops.aten.add.Tensor(getitem_4, sum_1)
    return (getitem_3, add, seen_0, getitem_2, getitem_5)

# remember_subgraph0: 'subgraph_0'
def remember_subgraph0(self, token, x, seen_0):
    with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.record_memory.default, 'remember')
    getitem = with_effects[0]
    sin = torch.ops.aten.sin.default(x)
    mul = torch.ops.aten.mul.Tensor(x, 2)
    return (getitem, mul, seen_0, sin)

# remember_subgraph1: 'subgraph_1'
def remember_subgraph1(self, token, x, seen_0, seen_1):
    with_effects = effectfx.ops.with_effects(token, torch.ops.efxtest.record_memory.default, 'remember')
    getitem = with_effects[0]
    sin = torch.ops.aten.sin.default(x)
    mul = torch.ops.aten.mul.Tensor(x, 2)
    return (getitem, mul, seen_0, seen_1, sin)
"""


def test_golden_a_region_appending_to_its_list_returns_the_list_s_new_tensors() -> None:
    """The body returns the new state of the list it changed after its own results; the call site puts
    them into the caller's list (unchanged tensors are the caller's own: only new ones are results)."""
    with torch.no_grad():
        prog = efx.capture(two_steps, torch.randn(3), [torch.randn(3)])
    assert prog.code().strip() == textwrap.dedent(GOLDEN).strip()


@pytest.mark.parametrize("grad", [False, True])
def test_a_list_the_code_appends_to_is_the_caller_s_as_in_eager(grad: bool) -> None:
    compiled = efx.compile(two_steps)
    for n in (3, 3, 4):
        x = torch.randn(n, requires_grad=grad)
        first = torch.randn(n)
        mine, theirs = [first], [first]
        with recording() as got:
            out = compiled(x, mine)
        with recording() as want:
            expected = two_steps(x, theirs)
        assert got == want and torch.allclose(out, expected)
        assert len(mine) == len(theirs) == 3 and mine[0] is first
        assert all(torch.allclose(a, b) for a, b in zip(mine, theirs))
        if grad:  # the tensors put into the caller's list carry their history, as eager's do
            (g,) = torch.autograd.grad((out.sum() + mine[-1].sum()), x)
            (e,) = torch.autograd.grad((expected.sum() + theirs[-1].sum()), x)
            assert torch.allclose(g, e)


def test_putting_something_else_than_tensors_into_an_argument_is_refused() -> None:
    @efx.region
    def keeps_a_module(x: torch.Tensor, things: list) -> torch.Tensor:
        things.append(torch.nn.Identity())
        return x + 1

    with recording() as log, pytest.raises(efx.UnsupportedMutationError, match="argument 1 in place"):
        efx.compile(lambda x, things: keeps_a_module(x, things))(torch.randn(2), [])
    assert log == []


def test_a_left_padded_batch_generates_as_eager() -> None:
    """transformers' generate passes ``position_ids`` only to a forward whose signature names it: the
    compiled module's forward once showed ``(*args, **kwargs)``, and a left-padded row got wrong positions,
    silently (found by benchmarks/generate.py's author)."""
    import inspect

    model = hf.build("gpt2").eval()
    reference = copy.deepcopy(model)
    compiled = efx.compile(model)
    assert inspect.signature(compiled.forward) == inspect.signature(reference.forward)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    options = {"attention_mask": mask, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0,
               "use_cache": True, "output_scores": True, "return_dict_in_generate": True}
    with recording() as want:
        expected = reference.generate(ids, **options)
    with recording() as got:
        out = compiled.generate(ids, **options)
    assert got == want and torch.equal(out.sequences, expected.sequences)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out.scores, expected.scores))


def test_a_new_state_is_written_leaf_by_leaf_only_where_a_walk_finds_its_leaves() -> None:
    """``program.returned._leaf_paths``: the place of each leaf of a cache, in pytree's order; none (the
    new state is built and written as a whole) where a leaf sits in a tuple, which cannot be written into."""
    from transformers import GPT2Config

    from effectfx.program.containers import register_tensor_holders
    from effectfx.program.returned import _at, _leaf_paths

    register_tensor_holders()
    cache = DynamicCache(config=GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=10, eos_token_id=None,
                                           bos_token_id=None))
    for i in range(2):
        cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), i)
    leaves = tree_flatten(cache)[0]
    paths = _leaf_paths(cache)
    assert len(paths) == len(leaves) == 4 and all(_at(cache, *p) is t for p, t in zip(paths, leaves))
    cache.layers[1].pair = (torch.zeros(1), torch.ones(1))
    assert _leaf_paths(cache) == []
