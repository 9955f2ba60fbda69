"""``make demo``: one model shape as MHA, GQA and MQA — the KV cache each needs, and cached decoding that reproduces
a full causal forward exactly while reading ``H_q / H_kv`` times fewer cache bytes per token."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..attention import GroupedQueryAttention

HELP = "MHA vs GQA vs MQA: cache size, cached decoding checked against a full forward"
DESCRIPTION = HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``gqa demo`` takes no flags."""


def run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    return main()


def _decode(attn: GroupedQueryAttention, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Feed ``x (B, T, E)`` one token at a time through a static cache; return the outputs and seconds per token."""
    import torch

    from .. import StaticKVCache

    B, T, _ = x.shape
    cache = StaticKVCache(B, attn.num_kv_heads, attn.head_dim, T, dtype=x.dtype)
    start = time.perf_counter()
    outs = [attn(x[:, t : t + 1], is_causal=True, cache=cache) for t in range(T)]
    return torch.cat(outs, dim=1), (time.perf_counter() - start) / T


def main() -> int:
    import torch

    from .. import GroupedQueryAttention, RoPE, kv_cache_bytes

    torch.manual_seed(0)
    E, H_q, D, B, T = 2048, 32, 64, 4, 256
    x = torch.randn(B, T, E)
    print(f"One attention layer: embed {E}, {H_q} query heads of dim {D}; batch {B}, {T} tokens decoded one by one.\n")
    header = f"{'variant':<10}{'H_kv':>5}{'KV cache @4096 tok (MB)':>26}{'max |decode - full|':>22}{'ms / token':>12}"
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        for name, H_kv in (("MHA", H_q), ("GQA", 8), ("MQA", 1)):
            attn = GroupedQueryAttention(E, H_q, H_kv, rope=RoPE(D, theta=10000.0)).eval()
            full = attn(x, is_causal=True)
            stepwise, seconds = _decode(attn, x)
            mb = kv_cache_bytes(1, H_kv, D, 4096, batch=B, dtype=torch.float16) / 2**20
            err = (stepwise - full).abs().max().item()
            print(f"{name:<10}{H_kv:>5}{mb:>26.1f}{err:>22.2e}{seconds * 1e3:>12.2f}")
    print("\nMHA, GQA and MQA are one module with a different num_kv_heads. K/V are shared by the query heads of a")
    print("group, never copied, so the cache (and the bytes read per decoded token) shrinks by H_q / H_kv.")
    return 0
