"""Serving: ``gqa serve``'s layers, one file each.

* ``blocks`` — the paged KV cache's bookkeeping: block tables, reference counts, prefix caching (no tensors);
* ``paged_cache`` — the per-layer pools of K/V blocks;
* ``engine`` — continuous batching: admission, one native paged decode call per step, chunked prefill, preemption;
* ``sampling`` — per-request sampling settings and incremental text with stop strings;
* ``offline`` — ``LLM(...).generate(prompts)``, the engine without a server;
* ``async_engine``, ``openai_api``, ``server`` — the engine on its own thread, OpenAI's shapes, the HTTP app.

``LLM``, ``Engine`` and ``SamplingParams`` are loaded on first use (they import torch).
"""

from .blocks import BlockManager, BlockTable, OutOfBlocks

__all__ = ["LLM", "BlockManager", "BlockTable", "Engine", "OutOfBlocks", "SamplingParams"]

_LAZY = {"LLM": "offline", "Engine": "engine", "SamplingParams": "sampling"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
