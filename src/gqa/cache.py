"""KV caches for decoding, one per attention layer. They store K/V with ``H_kv`` heads only: a GQA cache is
``H_q / H_kv`` times smaller than the MHA one, and that is the bytes each decoded token has to read.

* ``StaticKVCache`` — preallocated to ``max_len``, written in place, never reallocated (``torch.compile`` friendly).
* ``DynamicKVCache`` — grows on demand (capacity doubles, so appends are amortised O(1)).

Batched decoding with left padding: ``set_left_padding(pad)`` records how many leading slots of each row are padding.
The cache then provides the per-row key mask (``key_mask``), per-row RoPE positions (``positions``) and per-row real
lengths (``lengths``); the attention module uses all three automatically.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ._checks import shape_str


def kv_cache_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    seq_len: int,
    batch: int = 1,
    dtype: torch.dtype = torch.float16,
) -> int:
    """Bytes of a KV cache: ``2 (K and V) * layers * H_kv * D * seq_len * batch * itemsize``."""
    for name, n in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("seq_len", seq_len), ("batch", batch)):  # fmt: skip
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    return 2 * num_layers * num_kv_heads * head_dim * seq_len * batch * dtype.itemsize


class _KVCache(nn.Module):
    """Shared machinery: buffers ``key (B, H_kv, capacity, D)``, ``value (B, H_kv, capacity, D_v)``, ``start (B,)``."""

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, n in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        value_dim = head_dim if value_dim is None else value_dim
        B, H = batch_size, num_kv_heads
        self.register_buffer("key", torch.zeros(B, H, capacity, head_dim, dtype=dtype, device=device))
        self.register_buffer("value", torch.zeros(B, H, capacity, value_dim, dtype=dtype, device=device))
        self.register_buffer("start", torch.zeros(B, dtype=torch.long, device=device))
        self.seq_len = 0  # slots written so far (the same for every row; left padding is counted in it)
        self.padded = False

    @property
    def capacity(self) -> int:
        return self.key.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the K/V buffers (allocated capacity, not only the written part)."""
        return self.key.nbytes + self.value.nbytes

    @property
    def lengths(self) -> torch.Tensor:
        """Real (non-padding) tokens per row, ``(B,)``."""
        return (self.seq_len - self.start).clamp_min(0)

    def reset(self) -> None:
        """Forget the contents (buffers are kept) and the padding."""
        self.seq_len = 0
        self.start.zero_()
        self.padded = False

    def set_left_padding(self, pad: torch.Tensor | Sequence[int]) -> None:
        """Declare that the first ``pad[b]`` slots of row ``b`` hold padding (left-padded batched prompts).

        Call it before writing the prompt. ``pad`` is ``(B,)``; an HF-style ``(B, L)`` 0/1 mask ``m`` gives
        ``pad = L - m.sum(-1)``.
        """
        pad = torch.as_tensor(pad, dtype=torch.long, device=self.start.device)
        if pad.shape != self.start.shape:
            raise ValueError(f"pad must have shape ({self.start.shape[0]},) = (B,), got {shape_str(pad)}")
        if bool((pad < 0).any()):
            raise ValueError(f"pad must be >= 0, got {pad.tolist()}")
        self.start.copy_(pad)
        self.padded = bool((pad > 0).any())

    def positions(self, L: int) -> torch.Tensor:
        """RoPE positions ``(B, L)`` of the next ``L`` tokens: slot index minus the row's padding (0 on padding)."""
        slots = torch.arange(self.seq_len, self.seq_len + L, device=self.start.device)
        return (slots[None, :] - self.start[:, None]).clamp_min(0)

    def key_mask(self, S: int) -> torch.Tensor | None:
        """Bool ``(B, 1, 1, S)``: False on each row's padding slots; None when no row is padded."""
        if not self.padded:
            return None
        return (torch.arange(S, device=self.start.device)[None, :] >= self.start[:, None])[:, None, None, :]

    def _reserve(self, needed: int) -> None:
        raise NotImplementedError

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key (B, H_kv, L, D)`` and ``value (B, H_kv, L, D_v)``; return all keys and values so far,
        ``(B, H_kv, S, D)`` and ``(B, H_kv, S, D_v)`` with ``S = seq_len`` after the write (views, not copies)."""
        B, H, _, D = self.key.shape
        D_v = self.value.shape[-1]
        for name, t, feat in (("key", key, D), ("value", value, D_v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != feat:
                raise ValueError(f"{name} must have shape ({B}, {H}, L, {feat}) for this cache, got {shape_str(t)}")
            if t.dtype != self.key.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but the cache stores {self.key.dtype}")
        L = key.shape[2]
        if value.shape[2] != L:
            raise ValueError(f"key {shape_str(key)} and value {shape_str(value)} must have the same length")
        end = self.seq_len + L
        self._reserve(end)  # raises before anything is written when a static cache is full
        self.key[:, :, self.seq_len : end].copy_(key)
        self.value[:, :, self.seq_len : end].copy_(value)
        self.seq_len = end
        return self.key[:, :, :end], self.value[:, :, :end]


class StaticKVCache(_KVCache):
    """A KV cache preallocated to ``max_len`` tokens and written in place.

    Buffers: ``key (B, H_kv, max_len, D)``, ``value (B, H_kv, max_len, D_v)``. Writing past ``max_len`` raises
    ``ValueError`` and leaves the cache unchanged.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        super().__init__(batch_size, num_kv_heads, head_dim, max_len, value_dim=value_dim, dtype=dtype, device=device)

    def _reserve(self, needed: int) -> None:
        if needed > self.capacity:
            raise ValueError(
                f"StaticKVCache overflow: {needed - self.seq_len} new tokens after {self.seq_len} cached exceed "
                f"max_len {self.capacity}"
            )


class DynamicKVCache(_KVCache):
    """A KV cache that grows as tokens arrive (capacity doubles, then K/V are copied once into the bigger buffer)."""

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        initial_len: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if isinstance(initial_len, bool) or not isinstance(initial_len, int) or initial_len < 1:
            raise ValueError(f"initial_len must be a positive int, got {initial_len!r}")
        super().__init__(
            batch_size, num_kv_heads, head_dim, initial_len, value_dim=value_dim, dtype=dtype, device=device
        )

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        for name in ("key", "value"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : self.seq_len].copy_(old[:, :, : self.seq_len])
            setattr(self, name, new)
