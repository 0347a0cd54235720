"""Capture: tracing PyTorch programs into aten-level FX graphs with region subgraphs."""
