"""Functionalization: threading effect tokens through graphs and regions (Note [Effect tokens])."""

from .tokens import thread_tokens

__all__ = ["thread_tokens"]
