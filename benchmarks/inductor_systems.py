"""The models and systems of the Inductor benchmark (:mod:`benchmarks.inductor` measures them).

Models (same weights in every system; each block/layer first calls the effect op ``efxbench::record``):

* ``stack``: N blocks of ``x + fc2(gelu(fc1(layer_norm(x))))``, width 64 (fc 256), input (8, 32, 64);
  training: ``out.pow(2).mean().backward()``;
* ``gpt2``: ``transformers``' GPT2LMHeadModel, 12 layers, hidden 64, 4 heads, vocab 100, random weights
  (``effectfx.testing.hf.gpt2_config``), input ids (4, 32); training: ``model(ids, labels=ids).loss``;
* ``llama``: ``transformers``' LlamaForCausalLM, 12 layers, hidden 64 (MLP 256), 4 heads, vocab 100, random
  weights (``effectfx.testing.hf.llama_config``), the same ids and loss;

each decoder layer (``effectfx.testing.hf.LAYER_LISTS``) wrapped in a marked layer calling the effect op.
Inference: the forward alone under ``torch.no_grad()`` (the stack's output, the models' logits).

Systems: ``eager``; ``efx`` = ``efx.compile(model, backend="inductor", tiers="tier1")`` (each region body
compiled once, :mod:`effectfx.backends.inductor`; tier 1 only: ``benchmarks/tiers.py`` measures tier 2);
``efx_hop`` = the same capture handed to torch's own Inductor lowering of ``invoke_subgraph``
(:func:`hop_lowering`: one ``compile_fx_inner`` per root graph, bodies lowered once inside it) -- the
alternative the backend was chosen against; ``tc`` = ``torch.compile(model,
backend="inductor")`` on plain blocks; ``tc_ncr`` = the same with ``torch.compiler.nested_compile_region``
blocks; ``*_pure``: the same model without the effect op (torch.compile fails on some effectful
configurations; its effect-free run then stands in, marked ``*``); ``efx_twin`` = ``efx`` again, its own
module compiled apart (steady state only): how far two identical systems differ in one run; ``efx_t2`` =
``efx.compile(model, backend="inductor", tiers="at-once")`` (steady state only): tier 2 -- regions inlined,
the whole forward and backward lowered together (:mod:`effectfx.backends.tiers`) -- the program the default
tiers switch to once the step is the steady state.  Blocks are
marked once per system (one class per marker and effect).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

import effectfx as efx
from benchmarks import common

WIDTH, BATCH, SEQ = 64, 8, 32
TOLERANCE = 1e-3  # max relative difference from eager (loss, every gradient, inference output)
GPT2_LAYERS, GPT2_BATCH = 12, 4
HF_LAYERS = {"gpt2": GPT2_LAYERS, "llama": 12}  # the HF models measured, and their layers
# system -> (how it is compiled, how its blocks are marked, whether they call the effect op)
SYSTEMS: dict[str, tuple[str, str, bool]] = {
    "eager": ("eager", "eager", True),
    "eager_pure": ("eager", "eager", False),
    "efx": ("efx", "efx", True),
    "efx_hop": ("efx_hop", "efx", True),
    "efx_pure": ("efx", "efx", False),
    "efx_twin": ("efx", "efx", True),  # efx again, built and compiled apart: how far identical twins differ
    "efx_t2": ("efx_t2", "efx", True),  # tier 2 (steady state only)
    "tc": ("tc", "eager", True),
    "tc_ncr": ("tc", "tc", True),
    "tc_pure": ("tc", "eager", False),  # torch.compile fails on some effectful configurations (results)
    "tc_ncr_pure": ("tc", "tc", False),
}


# -- models ----------------------------------------------------------------------------------------------
class BlockBase(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)


def _block(self: BlockBase, x: torch.Tensor) -> torch.Tensor:
    torch.ops.efxbench.record("block")
    return _block_pure(self, x)


def _block_pure(self: BlockBase, x: torch.Tensor) -> torch.Tensor:
    return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class LayerBase(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer


def _layer(self: LayerBase, *args: Any, **kwargs: Any) -> Any:
    torch.ops.efxbench.record("layer")  # a literal: torch.compile would specialize on a per-layer string
    return self.layer(*args, **kwargs)


def _layer_pure(self: LayerBase, *args: Any, **kwargs: Any) -> Any:
    return self.layer(*args, **kwargs)


def _classes(base: type, name: str, effect: Callable, pure: Callable) -> dict[tuple[str, bool], type]:
    """One class per (marker, effects): each system sees its own marker and nothing else."""
    return {(m, e): type(f"{name}_{m}{'' if e else '_pure'}", (base,),
                         {"forward": mark(effect if e else pure)})
            for m, mark in common.MARKERS.items() for e in (True, False)}


BLOCKS = _classes(BlockBase, "Block", _block, _block_pure)
LAYERS = _classes(LayerBase, "Layer", _layer, _layer_pure)


class Stack(torch.nn.Module):
    def __init__(self, n: int, marker: str, effects: bool) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(BLOCKS[marker, effects](WIDTH) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build(model: str, n: int, system: str) -> tuple[torch.nn.Module, Callable[[Any], torch.Tensor],
                                                   Callable[[Any], torch.Tensor]]:
    """(module, the loss of one call of ``f`` on the input, the output of one inference call of ``f``) for
    ``system``: the same weights for all."""
    _, marker, effects = SYSTEMS[system]
    torch.manual_seed(0)
    if model == "stack":
        module: torch.nn.Module = Stack(n, marker, effects)
        x = torch.randn(BATCH, SEQ, WIDTH, generator=torch.Generator().manual_seed(1))
        return module, lambda f: f(x).pow(2).mean(), lambda f: f(x)
    import transformers

    from effectfx.testing import hf

    if model == "gpt2":
        config = hf.gpt2_config()
        config.n_layer = n
        module = transformers.GPT2LMHeadModel(config)
        module.loss_type = "ForCausalLM"
    else:
        config = hf.llama_config()
        config.num_hidden_layers = n
        module = transformers.LlamaForCausalLM(config)
    layers = hf.layers_of(module, model)
    for i, layer in enumerate(layers):
        layers[i] = LAYERS[marker, effects](layer)
    ids = torch.randint(0, hf.VOCAB, (GPT2_BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return module, lambda f: f(ids, labels=ids).loss, lambda f: f(ids).logits


def compiled(system: str, module: torch.nn.Module) -> Callable[..., Any]:
    how = SYSTEMS[system][0]
    if how == "eager":
        return module
    if how == "efx":  # tier 1 only: a tier 2 switched in during the steady rounds would mix two steps
        return efx.compile(module, backend="inductor", tiers="tier1")
    if how == "efx_t2":  # tier 2 from the first call: the steady state the default switches to
        return efx.compile(module, backend="inductor", tiers="at-once")
    if how == "efx_hop":
        return efx.compile(module, backend="inductor_hop")
    return torch.compile(module, backend="inductor")


def _rel(got: torch.Tensor | None, want: torch.Tensor) -> float:
    if got is None:  # a missing gradient is infinitely wrong
        return float("inf")
    return float((got.detach() - want.detach()).abs().max() / (want.detach().abs().max() + 1e-12))


def check(model: str, n: int, system: str, module: torch.nn.Module,
          loss: torch.Tensor) -> dict[str, Any]:
    """The loss and every parameter's gradient against eager's (the same model without a compiler)."""
    reference, loss_of, _ = build(model, n, "eager" if SYSTEMS[system][2] else "eager_pure")
    want = loss_of(reference)
    want.backward()
    grads = dict(reference.named_parameters())
    diffs = [float((loss.detach() - want.detach()).abs())]
    diffs += [_rel(p.grad, grads[name].grad) for name, p in module.named_parameters()
              if grads[name].grad is not None]
    return {"max_rel_diff": max(diffs), "ok": max(diffs) < TOLERANCE}


def check_inference(model: str, n: int, system: str, out: torch.Tensor) -> dict[str, Any]:
    """An inference output against eager's."""
    reference, _, out_of = build(model, n, "eager" if SYSTEMS[system][2] else "eager_pure")
    with torch.no_grad():
        diff = _rel(out, out_of(reference))
    return {"max_rel_diff": diff, "ok": diff < TOLERANCE}


# -- the alternative: torch's Inductor lowering of invoke_subgraph ------------------------------------------
def _to_hop(gm: fx.GraphModule, memo: dict[int, fx.GraphModule]) -> fx.GraphModule:
    """A copy of a token-free graph calling torch's ``invoke_subgraph`` higher-order op (bodies recursively,
    each once).  Effects stay plain op calls: Inductor keeps them as side-effecting fallback kernels
    because ``efxbench::record`` is also in torch's effect registry (common.py)."""
    from effectfx import ops

    if id(gm) not in memo:
        graph, env, root = fx.Graph(), {}, torch.nn.Module()
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                setattr(root, node.target, _to_hop(getattr(gm, node.target), memo))
                env[node] = graph.get_attr(node.target)
            elif node.target is ops.invoke_subgraph:
                env[node] = graph.call_function(torch.ops.higher_order.invoke_subgraph,
                                                fx.map_arg(node.args, lambda n: env[n]))
            elif node.op == "output":
                graph.output(fx.map_arg(node.args[0], lambda n: env[n]))
            else:
                env[node] = graph.node_copy(node, lambda n: env[n])
        memo[id(gm)] = fx.GraphModule(root, graph)
    return memo[id(gm)]


def hop_lowering(prog: Any) -> Any:
    """Token-free Program -> one whose root is a single Inductor-compiled call of the whole graph."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import _recursive_record_user_visible_output_idxs, compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from effectfx.backends.inductor_cache import example_inputs, input_metas
    from effectfx.backends.inductor_segments import InductorSegment

    gm = prog.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    metas, hints = input_metas([n.meta["val"] for n in placeholders])
    # as the backend does: one fake mode with a shape environment (Inductor's FX graph cache needs it);
    # the tracing context's invoke_subgraph cache makes every call site of one identifier share a body
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with tracing(TracingContext(fake_mode)), torch.no_grad():
        examples, _ = example_inputs(metas, hints, fake_mode)
        decomposed = make_fx(_to_hop(gm, {}), decomposition_table=select_decomp_table(),
                             tracing_mode="fake")(*examples)
        # as torch.compile's own path does: body outputs keep their traced strides (compile_fx.py)
        _recursive_record_user_visible_output_idxs(decomposed)
        inner = compile_fx_inner(decomposed, examples)
    whole = InductorSegment.ready(decomposed, lambda *args: inner(list(args)), metas)  # boxed convention
    graph, holder = fx.Graph(), torch.nn.Module()
    holder.whole = whole
    call = graph.call_module("whole", tuple(graph.placeholder(n.name) for n in placeholders))
    n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
    graph.output(tuple(graph.call_function(operator.getitem, (call, i)) for i in range(n_out)))
    return prog.replace(graph_module=fx.GraphModule(holder, graph))


def register_hop_backend() -> None:
    from effectfx.drivers.callable import BACKEND_PASSES
    from effectfx.passes.remove_tokens import remove_effect_tokens_pass
    from effectfx.passes.thread_tokens import thread_tokens

    BACKEND_PASSES["inductor_hop"] = [thread_tokens, remove_effect_tokens_pass, hop_lowering]
