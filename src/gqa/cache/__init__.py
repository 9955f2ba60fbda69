"""KV caches: ``kv`` — the static (preallocated, per-row cursor and left padding) and dynamic caches of decoding;
``sizes`` — the KV cache's size in elements, the one formula (without torch: ``gqa info`` uses it). The paged pool of
serving is ``gqa.serve.paged_cache``. The torch classes are imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
    from .kv import DynamicKVCache, StaticKVCache, kv_cache_bytes

__all__ = ["DynamicKVCache", "StaticKVCache", "kv_cache_bytes"]
__getattr__ = lazy_names(__name__, dict.fromkeys(__all__, "kv"))
