"""Byte counts without torch (``gqa info`` runs without importing it): the element size of the float dtypes by
torch's name for them, and the KV cache's element count, which ``gqa.kv_cache_bytes`` multiplies by the dtype's."""

from __future__ import annotations

ITEMSIZE: dict[str, int] = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}  # torch.<name>.itemsize
WINDOW_SPARE = 256  # a sliding-window cache's slots beyond the window (gqa.cache.window)


def kv_cache_elements(num_layers: int, num_kv_heads: int, head_dim: int, seq_len: int, batch: int = 1) -> int:
    """Elements of a KV cache: ``2 (K and V) * layers * H_kv * D * seq_len * batch``; ``ValueError`` unless each
    count is a non-negative int."""
    for name, n in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("seq_len", seq_len), ("batch", batch)):  # fmt: skip
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return 2 * num_layers * num_kv_heads * head_dim * seq_len * batch


def layer_cache_tokens(window: int | None, seq_len: int, spare: int = WINDOW_SPARE) -> int:
    """Token slots one layer's cache holds for ``seq_len`` tokens: all of them, or for a layer whose queries see
    ``window`` keys, ``window + spare`` once ``seq_len`` exceeds that (``CausalLM.new_caches``' choice)."""
    return seq_len if window is None or seq_len <= window + spare else window + spare
