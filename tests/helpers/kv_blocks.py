"""A K or V tensor as a quantized cache stores it, for the kernels' tests."""

from __future__ import annotations

import torch

from gqa.cache.kv_dtypes import KV_DTYPES
from gqa.cache.quantize import as_stored, held_values


def stored_as(t: torch.Tensor, name: str | None, *, key: bool = False) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``t (..., D)`` as a cache of ``name`` (``"q8_0"``, ``"q4_0"``; ``None``: float rows) stores it as K (``key``:
    rotated) or V: the uint8 blocks ``(..., D / 32 * block_bytes)`` (or ``t``), the kernels' format code
    (``KVDtype.code``, -1 for float) and the values the blocks hold ``(..., D)`` float32 in the model's space
    (``cache.quantize.held_values``), what an oracle attends over."""
    if name is None:
        return t, -1, t
    kind = KV_DTYPES[name]
    blocks = as_stored(t, kind, key=key)
    return blocks, kind.code, held_values(blocks, kind, key=key)
