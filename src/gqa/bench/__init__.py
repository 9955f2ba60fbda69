"""Benchmarks for gqa: ``python -m gqa.bench.attention`` or ``python benchmarks/attention.py``."""
