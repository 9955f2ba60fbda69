"""KV caches: ``kv`` — the static (preallocated, per-row cursor and left padding) and dynamic caches of decoding;
``window`` — the ring of a sliding-window layer, holding the window rather than the context;
``sizes`` — the KV cache's size in elements, the one formula (without torch: ``gqa info`` uses it); ``kv_dtypes`` — the
cache's storage types by llama.cpp's names (float, ``q8_0``/``q4_0`` blocks) and their bytes. The paged pool of
serving is ``gqa.serve.paged_cache``. The torch classes are imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

if TYPE_CHECKING:
    from .kv import DynamicKVCache, StaticKVCache, kv_cache_bytes
    from .window import WindowKVCache

__all__ = ["DynamicKVCache", "StaticKVCache", "WindowKVCache", "kv_cache_bytes"]
__getattr__ = lazy_names(__name__, {**dict.fromkeys(["DynamicKVCache", "StaticKVCache", "kv_cache_bytes"], "kv"),
                                    "WindowKVCache": "window"})  # fmt: skip
