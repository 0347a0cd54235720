"""Autograd: splitting joint traces (Note [Joint trace]) and attaching compiled programs to autograd."""
