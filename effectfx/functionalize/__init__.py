"""Functionalization: threading effect tokens through graphs and regions (Note [Effect tokens])."""

from .tokens import discover_effects, thread_tokens

__all__ = ["discover_effects", "thread_tokens"]
