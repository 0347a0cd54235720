"""Backends that take token-free programs further (Inductor)."""
