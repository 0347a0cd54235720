"""Regions (Note [Region identity]): the decorator and the region object (:mod:`.decorator`), promotion
(:mod:`.promotion`), the region cache of one capture (:mod:`.cache`) and the effects known per body
across captures (:mod:`.effects`).  A body's key and guards are ``effectfx.guards``."""

from .decorator import Region, active_tracer, region, region_of

__all__ = ["Region", "active_tracer", "region", "region_of"]
