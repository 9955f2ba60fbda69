"""``WindowKVCache``: a sliding-window layer's ``window + spare`` slots decode exactly as a full static cache does —
one token at a time, in chunks, with a prompt longer than the slots, with left padding, for 10k tokens — while
holding only the window."""

from __future__ import annotations

import pytest
import torch

import gqa
from gqa.cache.window import WindowKVCache


def _module(window: int, seed: int = 0) -> gqa.GroupedQueryAttention:
    torch.manual_seed(seed)
    rope = gqa.RoPE(8, max_position=64)
    return gqa.GroupedQueryAttention(24, 6, 2, 8, rope=rope, window=window - 1).eval()


def _run(module, x, cache, chunks):
    """``x (B, T, E)`` through ``module`` with ``cache``, ``chunks`` tokens per call; the outputs joined."""
    out, t = [], 0
    for n in chunks:
        out.append(module(x[:, t : t + n], is_causal=True, cache=cache))
        t += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("chunks", [[1] * 40, [7] + [1] * 33, [3, 5, 2, 9, 1, 20], [40]], ids=str)
@pytest.mark.parametrize("padded", [False, True])
def test_the_ring_attends_as_the_full_cache(chunks, padded):
    """Window 5, 2 spare slots (7 in all): prompts of 1-40 tokens, some longer than the slots, and left padding."""
    module = _module(5)
    x = torch.randn(2, 40, 24, generator=torch.Generator().manual_seed(1))
    full = gqa.StaticKVCache(2, 2, 8, 40)
    ring = WindowKVCache(2, 2, 8, 40, 5, spare=2)
    assert ring.slots == 7 and ring.capacity == 40 and ring.nbytes * 40 == full.nbytes * 7
    if padded:
        for cache in (full, ring):
            cache.set_left_padding([0, 3])
    with torch.no_grad():
        want = _run(module, x, full, chunks)
        got = _run(module, x, ring, chunks)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert ring.seq_len == full.seq_len == 40


def test_ten_thousand_decoded_tokens_equal_the_full_cache():
    module = _module(64, seed=2)
    T = 10_000
    x = torch.randn(1, T, 24, generator=torch.Generator().manual_seed(3))
    full = gqa.StaticKVCache(1, 2, 8, T)
    ring = WindowKVCache(1, 2, 8, T, 64, spare=16)
    chunks = [100] + [1] * (T - 100)
    with torch.no_grad():
        torch.testing.assert_close(_run(module, x, ring, chunks), _run(module, x, full, chunks), atol=1e-6, rtol=1e-6)
    assert ring.nbytes * T == full.nbytes * 80  # 64 + 16 slots held, not 10,000


def test_misuse_is_refused_by_name():
    module = _module(5)
    ring = WindowKVCache(1, 2, 8, 10, 5, spare=1)
    x = torch.randn(1, 11, 24)
    with pytest.raises(ValueError, match="WindowKVCache overflow: 11 new tokens after 0 cached exceed max_len 10"):
        module(x, is_causal=True, cache=ring)
    with pytest.raises(ValueError, match="a WindowKVCache of 5 keys needs a module with a window of at most 4 keys"):
        _module(9)(x[:, :2], is_causal=True, cache=ring)
    with pytest.raises(ValueError, match="window must be a positive int"):
        WindowKVCache(1, 2, 8, 10, 0)
    with pytest.raises(ValueError, match="spare must be an int >= 0"):
        WindowKVCache(1, 2, 8, 10, 4, spare=-1)
