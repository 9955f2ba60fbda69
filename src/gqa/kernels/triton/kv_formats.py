"""The K/V storage the Triton kernels read, as their ``k_format`` / ``v_format`` arguments say it (``KVDtype.code``):
-1 float rows in the query's dtype, 0 uint8 rows of llama.cpp ``q8_0`` blocks, 1 of ``q4_0`` blocks (a quantized
cache's layout, ``cache.kv_dtypes``: ``D / 32`` blocks of a little-endian fp16 scale and 32 values), 2 uint8 rows of
``D`` float8 e4m3 bytes. The kernels dequantize a tile of keys in registers (``kv_blocks``); here the host side checks
a cache tensor against its format and gives the shape of the values it holds. Import does not import triton.
"""

from __future__ import annotations

import torch

from ...attention.checks import shape_str
from ...cache.kv_dtypes import KV_DTYPES, KVDtype

FLOAT = -1
BLOCK_KINDS: dict[int, KVDtype] = {kind.code: kind for kind in KV_DTYPES.values() if kind.quantized}

__all__ = ["BLOCK_KINDS", "FLOAT", "block_kind", "format_refusal", "stand_in", "values_per_row"]


def block_kind(name: str, code: object) -> KVDtype | None:
    """The block type of format ``code`` (``None`` for -1, float rows); ``ValueError`` naming ``name`` otherwise."""
    if code == FLOAT and not isinstance(code, bool):
        return None
    if isinstance(code, bool) or not isinstance(code, int) or code not in BLOCK_KINDS:
        choices = ", ".join(f"{c} ({k.name})" for c, k in BLOCK_KINDS.items())
        raise ValueError(f"{name} must be -1 (float rows) or a block format code: {choices}; got {code!r}")
    return BLOCK_KINDS[code]


def values_per_row(t: torch.Tensor, kind: KVDtype | None) -> int:
    """How many values a row of ``t``'s last dim holds: itself for float rows, ``bytes / block_bytes * 32`` for
    blocks."""
    return t.shape[-1] if kind is None else t.shape[-1] // kind.block_bytes * kind.block


def format_refusal(name: str, t: torch.Tensor, kind: KVDtype | None) -> str | None:
    """Why ``t`` cannot be a cache of blocks ``kind`` (uint8, whole blocks per row), or ``None`` (float rows are the
    callers' own checks)."""
    if kind is None:
        return None
    if t.dtype != torch.uint8 or t.dim() < 3 or t.shape[-1] % kind.block_bytes or t.shape[-1] == 0:
        unit = "bytes" if kind.fp8 else f"blocks ({kind.block_bytes} bytes each)"
        return f"{name} must be uint8 rows of {kind.name} {unit} for format {kind.code}, got {t.dtype} {shape_str(t)}"
    return None


def stand_in(name: str, t: torch.Tensor, kind: KVDtype | None, query: torch.Tensor) -> torch.Tensor:
    """``t`` itself for float rows; for blocks a zero-stride ``(..., values)`` view in ``query``'s dtype and device
    (no memory), so that the float checks of shapes (``attention.checks``) see the values the blocks hold.
    ``ValueError`` where ``t`` is no cache of ``kind``."""
    if kind is None:
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    reason = format_refusal(name, t, kind)
    if reason is not None:
        raise ValueError(reason)
    if t.device != query.device:
        raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    return query.new_zeros(()).expand(*t.shape[:-1], values_per_row(t, kind))
