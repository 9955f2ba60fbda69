"""gqa: grouped-query attention for PyTorch — MHA, GQA and MQA as one mechanism, with K/V shared, never copied."""

from .api import load_model, load_tokenizer
from .attention import GroupedQueryAttention
from .backends import BACKENDS
from .cache import DynamicKVCache, StaticKVCache, kv_cache_bytes
from .functional import grouped_attention, last_backend
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
