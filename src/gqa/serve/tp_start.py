"""What the ranks of a tensor-parallel server agree on before serving: that they run the same model the same way,
and how many blocks the paged KV pool has (the block ids rank 0 hands out must exist on every rank).

Each rank sends a fingerprint — the whole model's config, the dtype, the KV cache's kinds, the block size, the
number of ranks and a digest of the whole model's weights read at load (``tensor_parallel.whole_digest``: samples of
every tensor, before each rank keeps its shard) — and every rank compares the others' with rank 0's: a rank started
with another model or other flags (under torchrun each machine loads its own files) is refused at once, with the
difference named, instead of serving wrong text.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..cache.kv_dtypes import KVDtype
from .config import EngineConfig
from .paged_cache import blocks_in_budget
from .pool_size import CPU_MEMORY_SHARE, PoolSize
from .runner import available_memory, pool_size

__all__ = ["agree_on_start", "differences", "fingerprint"]


def fingerprint(model: torch.nn.Module, config: EngineConfig, kinds: tuple[KVDtype, KVDtype]) -> dict[str, object]:
    """What must be the same on every rank: flat ``{name: value}`` of plain values."""
    whole = model.whole_config
    out: dict[str, object] = {f"model.{k}": repr(v) for k, v in dataclasses.asdict(whole).items()}
    kv = "/".join(dict.fromkeys(k.name for k in kinds))  # K's/V's, once when the same
    out |= {"dtype": str(model.dtype).removeprefix("torch."), "kv_cache_dtype": kv, "block_size": config.block_size,
            "ranks": model.shard.tp,
            "weights checksum (a sample of every tensor)": model.whole_digest}  # fmt: skip
    return out


def differences(reference: dict[str, object], other: dict[str, object]) -> list[str]:
    """``"name: a (rank 0) vs b"`` for each entry where ``other`` differs from ``reference``."""
    names = list(reference) + [k for k in other if k not in reference]
    return [f"{k}: {reference.get(k)} (rank 0) vs {other.get(k)}" for k in names if reference.get(k) != other.get(k)]


def agree_on_start(
    model: torch.nn.Module, config: EngineConfig, kinds: tuple[KVDtype, KVDtype]
) -> tuple[PoolSize, int]:
    """Compare every rank's ``fingerprint`` with rank 0's (``ValueError`` naming the first rank that differs and
    how) and agree on the pool: ``(this rank's PoolSize, blocks)``. With ``kv_cache_mib`` the pool holds as many
    token slots as one process's of that size (each rank its KV heads' share of the bytes); by default each rank
    sizes its own (``runner.pool_size``) and the smallest count of blocks is every rank's. A collective."""
    cfg, whole = model.config, model.whole_config
    mine = fingerprint(model, config, kinds)
    size = pool_size(model, config, available_memory(), CPU_MEMORY_SHARE)
    if config.kv_cache_mib is not None:
        blocks = blocks_in_budget(config.kv_cache_mib, cfg.num_layers, whole.num_kv_heads, cfg.head_dim,
                                  config.block_size, kinds)  # fmt: skip
    else:
        blocks = blocks_in_budget(size.nbytes / 2**20, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                  config.block_size, kinds)  # fmt: skip
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, blocks))
    for rank, (theirs, _) in enumerate(everyone):
        wrong = differences(everyone[0][0], theirs)
        if wrong:
            raise ValueError(
                f"rank {rank} was started with another model or settings than rank 0: {'; '.join(wrong[:4])}"
            )
    blocks = min(b for _, b in everyone)
    if blocks < 1:
        raise ValueError(f"the KV pool ({size.reason}) holds no block of {config.block_size} tokens")
    return size, blocks
