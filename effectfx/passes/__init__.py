"""Passes over Programs: each a named ``Program -> Program`` function with a one-line contract."""
