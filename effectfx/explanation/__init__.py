"""``efx.explain`` and its report: :mod:`.gather` collects the facts from programs and compiled callables,
:mod:`.report` holds them and renders the text.  Imported on first use of ``efx.explain`` (not by
``import effectfx``)."""

from ..guards.words import key_differences
from .gather import explain
from .report import BodyReport, Explanation, GraphSize, ProgramReport, RegionReport, Stage

__all__ = ["BodyReport", "Explanation", "GraphSize", "ProgramReport", "RegionReport", "Stage", "explain",
           "key_differences"]
