"""The effects of a region's bodies across captures (Note [Region identity], last paragraph): a body
functionalized again with the same identity must show the same effect keys; a change is an error, never
a guess.  What each body showed is kept on its :class:`~effectfx.regions.decorator.Region`, by cache key
and direction, once the pass that found it succeeded."""

from __future__ import annotations

import torch.fx as fx

from ..errors import RegionEffectsChangedError
from ..graph.source import definition
from ..graph.traced import mask_text


def check_body_effects(gm: fx.GraphModule, keys: frozenset[str], commits: list) -> None:
    """Compare a body's effect keys with what the same region and cache key showed before
    (Note [Region identity]); the new set is committed only once the whole pass succeeds."""
    info = gm.meta.get("effectfx_region")
    if info is None:
        return
    region, cache_key, identifier, direction = info
    if "effectfx_grad_outputs" in gm.meta:  # a partial backward has effects of its own
        direction += " for outputs " + mask_text(gm.meta["effectfx_grad_outputs"])
    known = region.known_effects.get((cache_key, direction))
    if known is not None and known != keys:
        changed = known ^ keys
        where = sorted({n.meta["location"] for n in gm.graph.nodes
                        if n.meta.get("effect_key") in changed and "location" in n.meta})
        raise RegionEffectsChangedError(
            f"region {region.name!r} ({identifier}, {direction}; defined at {definition(region.fn)}) had "
            f"effects {sorted(known)} when it was traced before with the same arguments, but has "
            f"{sorted(keys)} now" + (f" (from {'; '.join(where)})" if where else "") + ".\nIts effects "
            "depend on state that is not part of its cache key (a global flag?). Pass that state to the "
            "region as an argument so each variant gets its own body."
        )
    commits.append((region, (cache_key, direction), keys))


def commit_body_effects(commits: list) -> None:
    for region, cache_key, effect_keys in commits:  # only a pass that succeeded fills the cache
        region.known_effects[cache_key] = effect_keys
