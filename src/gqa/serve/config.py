"""The serving engine's settings, checked once: ``Engine``, ``LLM`` and ``gqa serve`` take the same ``EngineConfig``."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

__all__ = ["MAX_DRAFT", "EngineConfig"]

MAX_DRAFT = 16  # the most draft tokens a request verifies in one step


@dataclass(frozen=True)
class EngineConfig:
    """``kv_cache_mib``: the KV pool's size (``None``: from the model, ``pool_size.default_pool_size``: what
    ``max_running`` full contexts need, on CPU at most the weights' size or one full context if that is more, at most
    a quarter of the available memory, half the free device memory on CUDA); ``block_size``: token slots per block;
    ``max_running``: requests decoded together at most; ``prefill_chunk``: prompt tokens per step while others decode
    (four times as many while none does); ``speculate``: draft tokens per step at most for greedy requests, looked up
    in their own tokens (speculation.py; 0: off); ``kv_cache_dtype``: what the pool stores K/V as
    (``cache.kv.kv_kinds``: ``"q8_0"``, ``"q4_0"``, a ``(K, V)`` pair; ``None``: the model's ``kv_dtype``);
    ``prefix_cache_dir``: a directory that keeps prompts' full KV blocks across restarts (``prefix_disk``; ``None``:
    off), at most ``prefix_cache_gib`` GiB of files, the least recently used deleted first; ``cuda_graphs``: on CUDA,
    steps of decode rows alone replay CUDA graphs captured at start-up per batch-size bucket (``step_graphs``;
    ``False``: every step eager, vLLM's ``enforce_eager``)."""

    kv_cache_mib: float | None = None
    kv_cache_dtype: object = None
    block_size: int = 16
    max_running: int = 64
    prefill_chunk: int = 64
    speculate: int = 0
    prefix_cache_dir: str | os.PathLike | None = None
    prefix_cache_gib: float = 4.0
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_running", "prefill_chunk"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive integer, got {n!r}")
        mib = self.kv_cache_mib
        if mib is not None and not (
            isinstance(mib, (int, float)) and not isinstance(mib, bool) and math.isfinite(mib) and mib > 0
        ):
            raise ValueError(f"kv_cache_mib must be a positive number, got {mib!r}")
        k = self.speculate
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_DRAFT:
            raise ValueError(f"speculate must be an integer in [0, {MAX_DRAFT}], got {k!r}")
        gib = self.prefix_cache_gib
        if not (isinstance(gib, (int, float)) and not isinstance(gib, bool) and math.isfinite(gib) and gib > 0):
            raise ValueError(f"prefix_cache_gib must be a positive number, got {gib!r}")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.prefix_cache_dir is not None and not isinstance(self.prefix_cache_dir, (str, os.PathLike)):
            raise ValueError(f"prefix_cache_dir must be a path, got {self.prefix_cache_dir!r}")
