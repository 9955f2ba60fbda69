"""Benchmarks behind ``gqa bench``: attention kernels (``attention``) and whole models (``model``)."""

from __future__ import annotations

from .._atomic import atomic_path, write_json_atomic, write_text_atomic

__all__ = ["atomic_path", "write_json_atomic", "write_text_atomic"]
