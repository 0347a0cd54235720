"""The global random number generator in captured code: its state saved and restored as graph nodes.

Note [Random numbers]
~~~~~~~~~~~~~~~~~~~~~
A random op (``torch.Tag.nondeterministic_seeded``: ``bernoulli_`` in dropout, ``rand``...) is recorded
like any other op and draws from eager's global CPU generator when its graph runs, in graph order: the
default runtime runs nodes in capture order, Inductor runs random ops in Python between its segments
(``backends.inductor.runs_in_python``), and dead-code elimination keeps a random op nobody reads
(``graph.walk.draws_random``), for its draw moves the generator as eager's does.

What eager does *with the generator's state* is recorded too.  ``torch.utils.checkpoint`` (non-reentrant,
selective checkpointing, transformers' ``gradient_checkpointing_enable``) with ``preserve_rng_state=True``
calls ``torch.get_rng_state()`` before the forward, and its recompute in the backward runs inside
``torch.random.fork_rng`` after ``torch.set_rng_state`` of that state, so that it draws the forward's numbers
again and leaves the generator as it found it.  On a capturing thread those two functions record the ops of
this module (``torch.get_rng_state`` and ``torch.set_rng_state`` are interposed, as ``training_step``
interposes on ``torch.autograd.backward``; every other thread runs torch's own):

  ``effectfx_rng::get_state() -> Tensor``: the generator's state (a uint8 tensor), read when the node runs;
  ``effectfx_rng::set_state(Tensor state) -> Tensor``: the generator takes ``state``; returns the state it
  replaced (a result, so the op is not taken for an effect of its own -- nothing reads it).

So the forward saves what it drew with and the backward replays from it, as torch's functionalized RNG
does with ``run_and_save_rng_state`` / ``run_with_rng_state`` -- but as eager's checkpoint does it, one
saved state per checkpointed call: the state is a forward value the backward reads, saved by the
partitioner like any other (Note [Joint trace]); a region's body saves its own, per call.  A checkpointed
region's backward is then::

    get_state = torch.ops.effectfx_rng.get_state.default()        # fork_rng: the state to go back to
    set_state = torch.ops.effectfx_rng.set_state.default(saved)   # the forward's state
    ... the recompute: its random ops draw the forward's numbers ...
    set_state_1 = torch.ops.effectfx_rng.set_state.default(get_state)

Nothing is decided by pattern: ``preserve_rng_state=False`` records no state and the recompute draws anew
from the generator as it is then, a selective checkpoint that keeps a random op's result skips its draw,
an early-stopped recompute draws what eager's draws, and the user's own ``fork_rng`` or
``get_rng_state``/``set_rng_state`` are recorded alike.  The generator is eager's after every graph.

Both ops carry the random tag, so every pass treats them as draws: never moved (Inductor runs them in
Python), never dropped.  What eager's bookkeeping leaves useless is removed when a graph's trace ends
(:func:`simplify`, per phase: each phase is a graph of its own at run time): a ``set_state`` nothing
observes before the next one overwrites it, a ``set_state`` of the state the generator already holds, and
a ``get_state`` whose value is known or unread.  What observes the generator is an op with the random tag
(torch's contract for an op that draws, which torch.compile's functionalized RNG and selective
checkpointing rely on too), a region or control-flow call whose subgraphs hold one, and any Python call
but ``operator``'s.  So a checkpoint whose recompute draws nothing (dropout 0) leaves no node and saves
nothing; one that draws saves one state (5 KB) per call.  ``torch.manual_seed`` and ``torch.seed`` inside
captured code are refused: the capture would seed the generator once, the program never.  Only the CPU
generator is recorded (``torch.cuda``'s states, which a checkpoint of CUDA tensors saves too, are not).
Tests: tests/test_rng.py, and the fuzzer's ``random`` statements (``effectfx.testing.program.RANDOM``).
Not eager's yet: a checkpointed value passed to a region that never reads it is recomputed in the
capture's backward (a region call's autograd node has an edge to every operand), which eager never does:
with ``preserve_rng_state=False`` its draws move the generator (an xfail in tests/test_rng.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..errors import UnsupportedOperatorError
from ..graph.source import user_location
from ..graph.walk import draws_random, hop_call
from ..regions.decorator import active_tracer
from .interpose import interpose

_RANDOM = torch.Tag.nondeterministic_seeded
_GENERATOR = torch.default_generator
_STATE_BYTES = _GENERATOR.get_state().numel()

_LIB = torch.library.Library("effectfx_rng", "DEF")
_LIB.define("get_state() -> Tensor", tags=(_RANDOM,))
_LIB.define("set_state(Tensor state) -> Tensor", tags=(_RANDOM,))


def _set_state(state: torch.Tensor) -> torch.Tensor:
    previous = _GENERATOR.get_state()
    _GENERATOR.set_state(state)
    return previous


_LIB.impl("get_state", lambda: _GENERATOR.get_state(), "CompositeExplicitAutograd")
_LIB.impl("set_state", _set_state, "CompositeExplicitAutograd")
torch.library.register_fake("effectfx_rng::get_state", lambda: torch.empty(_STATE_BYTES, dtype=torch.uint8),
                            lib=_LIB)
torch.library.register_fake("effectfx_rng::set_state", lambda state: torch.empty_like(state), lib=_LIB)
GET_STATE = torch.ops.effectfx_rng.get_state.default
SET_STATE = torch.ops.effectfx_rng.set_state.default


# -- capture: torch's functions, interposed on a capturing thread --------------------------------------
def _reseeds(*args: Any, **kwargs: Any) -> Any:
    raise UnsupportedOperatorError(
        f"{active_tracer().where()} seeds the global random number generator (torch.manual_seed or "
        f"torch.seed, at {user_location()}): a compiled program would not seed it again at each call (Note "
        "[Random numbers]). Seed before calling the compiled function, or draw from a torch.Generator of "
        "your own."
    )


def _set_rng_state(new_state: torch.Tensor) -> None:
    SET_STATE(new_state)


def _while_tracing(original: Callable[..., Any], on_trace: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if not active_tracer().builders:  # (a capture's own bookkeeping between graphs)
            return original(*args, **kwargs)
        return on_trace(*args, **kwargs)

    return call


for _name, _on_trace in (("get_rng_state", GET_STATE), ("set_rng_state", _set_rng_state),
                         ("manual_seed", _reseeds), ("seed", _reseeds)):
    for _owner in (torch, torch.random):  # ``torch.<name>`` and ``torch.random.<name>``
        interpose(_owner, _name, _while_tracing(getattr(_owner, _name), _on_trace))


# -- after a trace: what eager's saving and restoring leaves useless ---------------------------------------
def _touches(node: fx.Node) -> bool:
    """Whether ``node`` may read or move the generator: an op with the random tag (torch's own contract
    for ops that draw), a region or control-flow call whose subgraphs hold one, and any other Python
    callable but ``operator``'s."""
    if draws_random(node):
        return True
    target = node.target
    return not (isinstance(target, torch._ops.OpOverload) or hop_call(node)[0] is not None
                or getattr(target, "__module__", None) == "_operator")


def _known_values(nodes: list[fx.Node]) -> bool:
    """Forward: drop a ``set_state`` of the state the generator holds, and replace a ``get_state`` whose
    value is known (the last state set or read, no draw since)."""
    changed, holds = False, None
    for node in nodes:
        if node.target is GET_STATE:
            if holds is not None:
                node.replace_all_uses_with(holds)
                node.graph.erase_node(node)
                changed = True
            else:
                holds = node
        elif node.target is SET_STATE:
            if node.args[0] is holds and not node.users:
                node.graph.erase_node(node)
                changed = True
            else:
                holds = node.args[0]
        elif _touches(node):
            holds = None
    return changed


def _overwritten(nodes: list[fx.Node]) -> bool:
    """Backward: drop a ``set_state`` that nothing observes before the next one overwrites it (the end of
    the graph observes: the generator leaves it as eager's)."""
    changed, observed = False, True
    for node in reversed(nodes):
        if node.target is SET_STATE:
            if not observed and not node.users:
                node.graph.erase_node(node)
                changed = True
            else:
                observed = bool(node.users)
        elif node.target is GET_STATE or _touches(node):
            observed = True
    return changed


def simplify(graph: fx.Graph) -> None:
    """Remove the state nodes eager's bookkeeping leaves useless, in place (Note [Random numbers])."""
    if not any(n.target is GET_STATE or n.target is SET_STATE for n in graph.nodes):
        return

    def phase(backward: bool) -> list[fx.Node]:
        return [n for n in graph.nodes
                if n.op == "call_function" and (n.meta.get("phase") == "backward") == backward]

    changed = True
    while changed:  # each removal may make another useless (a restore whose save went): a few rounds
        changed = False
        for backward in (False, True):
            changed |= _known_values(phase(backward))
            changed |= _overwritten(phase(backward))
    for node in reversed(list(graph.nodes)):
        if node.target is GET_STATE and not node.users:
            graph.erase_node(node)
