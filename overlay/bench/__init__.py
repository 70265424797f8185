"""Benchmarks that print numbers: ``build`` (CPU) and ``merge`` (GPU)."""
