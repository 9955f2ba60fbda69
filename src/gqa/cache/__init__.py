"""KV caches: ``kv`` — the static (preallocated, per-row cursor and left padding) and dynamic caches of decoding;
``sizes`` — the KV cache's size in elements, the one formula (without torch: ``gqa info`` uses it). The paged pool of
serving is ``gqa.serve.paged_cache``. The torch classes are imported on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .kv import DynamicKVCache, StaticKVCache, kv_cache_bytes

__all__ = ["DynamicKVCache", "StaticKVCache", "kv_cache_bytes"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        value = getattr(importlib.import_module(".kv", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
