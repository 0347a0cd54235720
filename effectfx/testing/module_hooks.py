"""Module hooks in generated programs (``effectfx.testing.program``): the child modules bodies call, the
hooks a program registers (:class:`HookSpec`), and the tables ``render`` prints them from."""

from __future__ import annotations

from dataclasses import dataclass

# child modules a body on a module may call (``{m}.lin(a)``): name -> how ``__init__`` makes it
CHILDREN = {"lin": "linear(g)", "ident": "torch.nn.Identity()"}
# module hooks: what registers each kind, its parameters, and the tensors it reads
HOOK_KINDS = {
    "forward": ("register_forward_hook", "module, args, out"),
    "pre": ("register_forward_pre_hook", "module, args"),
    "backward": ("register_full_backward_hook", "module, grad_input, grad_output"),
}
# the effect a hook calls, with its label ``name``, on {t} (a tensor it got): (template, key or "ordered")
HOOK_EFFECTS = {
    "log": ("torch.ops.efxtest.log_tensor({t}, name)", "stdout"),
    "record": ("torch.ops.efxtest.record_memory(name)", "memory"),
    "ping": ("torch.ops.efxfuzz.ping({t}, name)", "ordered"),
    "bump": ("torch.ops.efxtest.bump({t}, name)", "memory"),  # the hook returns what it got, changed
}
# what a hook may be on: the blocks, their children (called inside the region ``step``), the program
# module's children, the program module itself (only between calls: ``efx.capture(model)`` traces its
# ``forward``, not the hooks ``nn.Module.__call__`` runs around it; ``efx.compile`` runs them)
HOOK_TARGETS = ("blocks", "blocks.lin", "blocks.ident", "lin", "ident", "model")


@dataclass(frozen=True)
class HookSpec:
    """A module hook the program registers (``effectfx.guards.hooks``).

    target: one of HOOK_TARGETS ("blocks.lin": the ``lin`` of each block in ``layers``; "lin": the program
    module's); kind: one of HOOK_KINDS; effect: one of HOOK_EFFECTS or "" (none), labelled
    ``hook<i> <module path>`` (``hook<i> blocks.lin`` when not "own"); s: what the hook returns is what it got
    times this (per layer: times ``i + 1`` when "own"; None: returns nothing); sharing: "own" (a function per
    layer, closing over its own label and number), "equal" (a function per layer, equal values) or "one" (one
    function object on every layer); added: 0 registered by ``make``, k > 0 by the harness before call k of
    a sequence (:meth:`ProgramSpec.sequence`); removed: 0 never, k > added: removed before call k.
    """

    target: str
    kind: str
    effect: str = ""
    s: float | None = None
    sharing: str = "own"
    layers: tuple[int, ...] = ()
    added: int = 0
    removed: int = 0

    def modules(self) -> list[tuple[int | None, str]]:
        """(layer or None, the path of the module from the model) of each module it is registered on."""
        if self.target.startswith("blocks"):
            child = self.target[len("blocks"):]
            return [(i, f"blocks.{i}{child}") for i in self.layers]
        return [(None, "model" if self.target == "model" else self.target)]


__all__ = ["CHILDREN", "HOOK_EFFECTS", "HOOK_KINDS", "HOOK_TARGETS", "HookSpec"]
