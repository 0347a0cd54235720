"""Higher-order ops in captured code, one module per family: its capture rule (taken over before torch
dispatches the op, ``effectfx.interposers.takeover``) and its autograd rule; its row in ``effectfx.ops.HOPS``
gives its name and token convention to printing, serialization, the rewrites and the token passes.
Importing this package installs every family's rule."""

from . import cond, dynamo_region, flex, loops, print_hop

__all__ = ["cond", "dynamo_region", "flex", "loops", "print_hop"]
