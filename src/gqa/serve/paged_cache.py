"""The paged KV cache's memory: per layer one preallocated pool of blocks for K and one for V, holding the model's
``H_kv`` heads only, so a model with fewer KV heads fits more tokens — and more sequences — in the same bytes.

A block is ``block_size`` token slots: ``key[layer] (num_blocks, H_kv, block_size, D)``. Which blocks a sequence's
tokens live in is its block table (``blocks.BlockTable``); the native decode step reads K/V through the tables
(``gqa::decode_paged``), and prefill writes and reads them here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["PagedKVCache", "blocks_in_budget"]


def blocks_in_budget(
    mib: float, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """How many blocks ``mib`` MiB hold: each is ``2 (K, V) * layers * H_kv * block_size * D * itemsize`` bytes."""
    per_block = 2 * num_layers * num_kv_heads * block_size * head_dim * dtype.itemsize
    return int(mib * 2**20 // per_block)


class PagedKVCache:
    """``num_blocks`` blocks of ``block_size`` slots per layer, K and V, in ``dtype`` on ``device``."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size

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
        self.key[layer][ids, :, offsets] = key.transpose(0, 1)  # (n, H_kv, D)
        self.value[layer][ids, :, offsets] = value.transpose(0, 1)

    def read(self, layer: int, blocks: Sequence[int], stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions ``[0, stop)`` of the sequence with table ``blocks``: ``(H_kv, stop, D)`` K and V (copies)."""
        ids, offsets = self._slots(blocks, 0, stop)
        return self.key[layer][ids, :, offsets].transpose(0, 1), self.value[layer][ids, :, offsets].transpose(0, 1)


def table_tensor(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """Block tables of a batch as one ``(B, max_blocks)`` int64 tensor, short rows padded with block 0 (never read:
    each row's length bounds what the kernel reads)."""
    width = max(1, max(len(t) for t in tables))
    out = torch.zeros(len(tables), width, dtype=torch.long)
    for row, t in enumerate(tables):
        out[row, : len(t)] = torch.as_tensor(list(t), dtype=torch.long)
    return out
