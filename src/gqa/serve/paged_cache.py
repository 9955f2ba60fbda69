"""The paged KV cache's memory: per layer one preallocated pool of blocks for K and one for V, holding the model's
``H_kv`` heads only, so a model with fewer KV heads fits more tokens — and more sequences — in the same bytes.

A block is ``block_size`` token slots: ``key[layer] (num_blocks, H_kv, block_size, D)``, or with a quantized
``kv_dtype`` (``q8_0`` / ``q4_0``) uint8 rows of 32-value blocks ``(num_blocks, H_kv, block_size, D / 32 *
block_bytes)``, written once as each token's K/V are computed and read where they lie. Which blocks a sequence's
tokens live in is its block table (``blocks.BlockTable``); the native decode step writes and reads K/V through the
tables (``gqa::decode_paged``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..cache.kv import KVDtypeChoice, kv_kinds
from ..cache.kv_dtypes import KVDtype
from ..cache.quantize import as_stored, held_values, kv_formats, row_size, storage_dtype

__all__ = ["PagedKVCache", "blocks_in_budget", "token_bytes"]


def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, kinds: tuple[KVDtype, KVDtype]) -> int:
    """Bytes one token takes in the pool: every layer's K and V rows of ``H_kv`` heads, in ``kinds`` (K's, V's)."""
    return num_layers * num_kv_heads * sum(kind.row_bytes(head_dim) for kind in kinds)


def blocks_in_budget(
    mib: float, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, kinds: tuple[KVDtype, KVDtype]
) -> int:
    """How many blocks ``mib`` MiB hold: each is ``block_size`` tokens of ``token_bytes``."""
    return int(mib * 2**20 // (block_size * token_bytes(num_layers, num_kv_heads, head_dim, kinds)))


class PagedKVCache:
    """``num_blocks`` blocks of ``block_size`` slots per layer, K and V, for ``dtype`` activations on ``device``,
    stored as ``kv_dtype`` says (``cache.kv.kv_kinds``: ``None`` / ``"auto"`` is ``dtype`` itself). ``spare_blocks``
    more follow them (ids ``num_blocks`` on), never in a request's table: a CUDA graph's padding rows write there
    (``step_graphs``)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_dtype: KVDtypeChoice = None,
        spare_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.kinds = kv_kinds(kv_dtype, dtype, "kv_cache_dtype", device)
        self.key, self.value = [], []
        for pools, kind in ((self.key, self.kinds[0]), (self.value, self.kinds[1])):
            shape = (num_blocks + spare_blocks, num_kv_heads, block_size, row_size(kind, head_dim))
            pools += [torch.zeros(shape, dtype=storage_dtype(kind), device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

    @property
    def kv_formats(self) -> tuple[int, ...]:
        """The native kernels' codes of K's and V's storage, ``()`` where both are float."""
        return kv_formats(self.kinds)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.key + self.value)

    def _slots(self, blocks: Sequence[int], start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ids and in-block offsets ``(n,)`` of positions ``[start, stop)``."""
        device = self.key[0].device
        pos = torch.arange(start, stop, device=device)
        table = torch.as_tensor(list(blocks), dtype=torch.long, device=device)
        return table[pos // self.block_size], pos % self.block_size

    def write(self, layer: int, blocks: Sequence[int], start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key (H_kv, n, D)`` and ``value`` as positions ``[start, start + n)`` of the sequence with table
        ``blocks``."""
        ids, offsets = self._slots(blocks, start, start + key.shape[1])
        self.write_slots(layer, ids, offsets, key.transpose(0, 1), value.transpose(0, 1))

    def write_slots(
        self, layer: int, ids: torch.Tensor, offsets: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store ``key (n, H_kv, D)`` and ``value (n, H_kv, D_v)``, row ``r`` at slot ``offsets[r]`` of block
        ``ids[r]`` (``(n,)`` each, on the pool's device), each row quantized on its own where the pool stores
        blocks."""
        for pool, kind, t, is_key in ((self.key, self.kinds[0], key, True), (self.value, self.kinds[1], value, False)):
            pool[layer][ids, :, offsets] = as_stored(t, kind, key=is_key)  # (n, H_kv, D | row bytes)

    def read(self, layer: int, blocks: Sequence[int], stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``[0, stop)`` of the sequence with table ``blocks``: ``(H_kv, stop, D)`` K and V (copies; the
        values a quantized pool holds, in float32)."""
        ids, offsets = self._slots(blocks, 0, stop)
        k, v = (pool[layer][ids, :, offsets].transpose(0, 1) for pool in (self.key, self.value))
        return held_values(k, self.kinds[0], key=True), held_values(v, self.kinds[1])


def table_tensor(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """Block tables of a batch as one ``(B, max_blocks)`` int64 tensor, short rows padded with block 0 (never read:
    each row's length bounds what the kernel reads)."""
    width = max(1, max(len(t) for t in tables))
    out = torch.zeros(len(tables), width, dtype=torch.long)
    for row, t in enumerate(tables):
        out[row, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
    return out
