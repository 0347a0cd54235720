"""Regions (Note [Region identity]): the decorator and the region object (:mod:`.decorator`), what a trace
reads (:mod:`.reads`), labels as operands (:mod:`.labels`), the key and guards of a body
(:mod:`.identity`), promotion (:mod:`.promotion`) and their wording for ``efx.explain`` and
``efx.compile`` (:mod:`.words`), the region cache of one capture (:mod:`.cache`) and the effects known per
body across captures (:mod:`.effects`)."""

from .decorator import Region, active_tracer, region, region_of

__all__ = ["Region", "active_tracer", "region", "region_of"]
