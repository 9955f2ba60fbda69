"""gqa: grouped-query attention for PyTorch — MHA, GQA and MQA as one mechanism, with K/V shared, never copied.

The public names are imported on first use (PEP 562), so ``import gqa`` does not import torch (~2 s): ``gqa info``
and ``gqa --help`` run without it. ``from gqa import X`` and ``gqa.X`` work as if they were imported here, and so do
submodules reached as attributes (``gqa.kernels``).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import load_model
    from .attention import GroupedQueryAttention
    from .backends import BACKENDS
    from .cache import DynamicKVCache, StaticKVCache, kv_cache_bytes
    from .functional import grouped_attention, last_backend
    from .loaders import load_tokenizer
    from .masks import causal_mask, padding_mask
    from .rope import RoPE

__all__ = [
    "BACKENDS",
    "DynamicKVCache",
    "GroupedQueryAttention",
    "RoPE",
    "StaticKVCache",
    "causal_mask",
    "grouped_attention",
    "kv_cache_bytes",
    "last_backend",
    "load_model",
    "load_tokenizer",
    "padding_mask",
]
__version__ = "0.1.0"

_HOMES = {  # public name -> the submodule that defines it
    "load_model": "api",
    "load_tokenizer": "loaders",
    "GroupedQueryAttention": "attention",
    "BACKENDS": "backends",
    "DynamicKVCache": "cache",
    "StaticKVCache": "cache",
    "kv_cache_bytes": "cache",
    "grouped_attention": "functional",
    "last_backend": "functional",
    "causal_mask": "masks",
    "padding_mask": "masks",
    "RoPE": "rope",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its submodule on first use and kept here; or a submodule, imported."""
    home = _HOMES.get(name)
    if home is not None:
        value = getattr(importlib.import_module(f".{home}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f".{name}", __name__)  # the import sets it as an attribute too
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
