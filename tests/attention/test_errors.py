"""Bad input raises ValueError/TypeError naming the argument and its shape — never a wrong answer or a NaN."""

from __future__ import annotations

import pytest
import torch

import gqa

q = torch.randn(2, 8, 3, 16)
k = torch.randn(2, 2, 5, 16)
v = torch.randn(2, 2, 5, 16)

FUNCTION_CASES = [
    # (description, kwargs overriding (query, key, value, ...), error type, message regex)
    (
        "H_q not divisible by H_kv",
        dict(key=torch.randn(2, 3, 5, 16), value=torch.randn(2, 3, 5, 16)),
        ValueError,
        r"H_q \(8\) must be divisible by key/value heads H_kv \(3\)",
    ),
    (
        "batch mismatch",
        dict(key=torch.randn(3, 2, 5, 16), value=torch.randn(3, 2, 5, 16)),
        ValueError,
        r"batch dims do not broadcast: query \(2, 8, 3, 16\), key \(3, 2, 5, 16\)",
    ),
    (
        "feature mismatch",
        dict(key=torch.randn(2, 2, 5, 12)),
        ValueError,
        r"key head dim \(12\) must equal query head dim \(16\)",
    ),
    (
        "value length mismatch",
        dict(value=torch.randn(2, 2, 4, 16)),
        ValueError,
        r"value \(2, 2, 4, 16\) must have key's",
    ),
    ("value heads mismatch", dict(value=torch.randn(2, 1, 5, 16)), ValueError, r"value \(2, 1, 5, 16\)"),
    (
        "too few dims",
        dict(query=torch.randn(3, 16)),
        ValueError,
        r"query must have shape \(\*B, H, L, D\).*got \(3, 16\)",
    ),
    (
        "dims differ",
        dict(key=torch.randn(2, 5, 16), value=torch.randn(2, 5, 16)),
        ValueError,
        r"same number of dims.*key \(2, 5, 16\)",
    ),
    ("dtype mismatch", dict(key=k.double()), TypeError, r"share a dtype, got torch.float32, torch.float64"),
    ("integer query", dict(query=torch.ones(2, 8, 3, 16, dtype=torch.long)), TypeError, r"query must be a floating"),
    ("not a tensor", dict(value=[1, 2]), TypeError, r"value must be a torch.Tensor, got list"),
    (
        "mask wrong shape",
        dict(attn_mask=torch.ones(3, 4, dtype=torch.bool)),
        ValueError,
        r"attn_mask of shape \(3, 4\) does not broadcast to \(\*B, H_q, L, S\) = \(2, 8, 3, 5\)",
    ),
    (
        "mask per kv head",
        dict(attn_mask=torch.ones(2, 2, 3, 5, dtype=torch.bool)),
        ValueError,
        r"attn_mask of shape \(2, 2, 3, 5\)",
    ),
    (
        "mask too many dims",
        dict(attn_mask=torch.ones(1, 2, 8, 3, 5, dtype=torch.bool)),
        ValueError,
        r"attn_mask of shape",
    ),
    (
        "mask int dtype",
        dict(attn_mask=torch.ones(3, 5, dtype=torch.int64)),
        TypeError,
        r"attn_mask must be bool.*torch.int64",
    ),
    ("dropout out of range", dict(dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\), got 1.5"),
    ("scale not a number", dict(scale="0.1"), TypeError, r"scale must be a float or None, got str"),
    ("is_causal not bool", dict(is_causal=1), TypeError, r"is_causal must be a bool, got int"),
    ("unknown backend", dict(backend="flash"), ValueError, r"backend must be 'auto' or one of .* got 'flash'"),
    ("weights from sdpa", dict(backend="sdpa", return_weights=True), ValueError, r"cannot return attention weights"),
]


@pytest.mark.parametrize("case", FUNCTION_CASES, ids=[c[0] for c in FUNCTION_CASES])
def test_function_errors(case):
    _, override, exc, match = case
    kwargs = dict(query=q, key=k, value=v) | override
    with pytest.raises(exc, match=match):
        gqa.grouped_attention(**kwargs)


MODULE_CASES = [
    (
        "heads not divisible",
        lambda: gqa.GroupedQueryAttention(64, 9, 2),
        ValueError,
        r"num_heads \(9\) must be divisible by num_kv_heads \(2\)",
    ),
    (
        "embed not divisible",
        lambda: gqa.GroupedQueryAttention(65, 8, 2),
        ValueError,
        r"embed_dim \(65\) must be divisible",
    ),
    ("zero kv heads", lambda: gqa.GroupedQueryAttention(64, 8, 0), ValueError, r"num_kv_heads must be >= 1, got 0"),
    ("float heads", lambda: gqa.GroupedQueryAttention(64, 8.0), TypeError, r"num_heads must be an int, got float"),
    ("bad dropout", lambda: gqa.GroupedQueryAttention(64, 8, dropout=-0.1), ValueError, r"dropout must be in \[0, 1\)"),
    (
        "rope head_dim mismatch",
        lambda: gqa.GroupedQueryAttention(64, 8, rope=gqa.RoPE(16)),
        ValueError,
        r"rope was built for head_dim 16 but this module has head_dim 8",
    ),
    ("rope wrong type", lambda: gqa.GroupedQueryAttention(64, 8, rope=10000.0), TypeError, r"rope must be a gqa.RoPE"),
    ("rope odd dim", lambda: gqa.RoPE(7), ValueError, r"rotary_dim \(7\) must be even"),
    (
        "rope dim too big",
        lambda: gqa.RoPE(8, rotary_dim=10),
        ValueError,
        r"rotary_dim \(10\) must not exceed head_dim \(8\)",
    ),
    (
        "wrong embed size",
        lambda: gqa.GroupedQueryAttention(64, 8, 2)(torch.randn(2, 3, 32)),
        ValueError,
        r"x must have shape \(\*B, L, 64\), got \(2, 3, 32\)",
    ),
    (
        "cross-attention kdim",
        lambda: gqa.GroupedQueryAttention(64, 8, 2, kdim=20)(torch.randn(2, 3, 64), torch.randn(2, 4, 21)),
        ValueError,
        r"key input must have shape \(\*B, S, 20\).*got \(2, 4, 21\)",
    ),
    (
        "cache batch mismatch",
        lambda: gqa.GroupedQueryAttention(64, 8, 2)(torch.randn(3, 1, 64), cache=gqa.StaticKVCache(2, 2, 8, 4)),
        ValueError,
        r"cache holds 2 rows, x \(3, 1, 64\) has 3",  # (checked before the projections and RoPE)
    ),
    (
        "cache heads mismatch",
        lambda: gqa.StaticKVCache(1, 2, 8, 4).update(torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)),
        ValueError,
        r"key must have shape \(1, 2, L, 8\)",
    ),
    (
        "cache with cross-attention",
        lambda: gqa.GroupedQueryAttention(64, 8, 2)(
            torch.randn(1, 1, 64), torch.randn(1, 3, 64), cache=gqa.StaticKVCache(1, 2, 8, 4)
        ),
        ValueError,
        r"cache is for self-attention",
    ),
    (
        "cache overflow",
        lambda: gqa.StaticKVCache(1, 2, 8, 4).update(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)),
        ValueError,
        r"overflow: 5 new tokens after 0 cached exceed max_len 4",
    ),
    (
        "padding shape",
        lambda: gqa.StaticKVCache(2, 2, 8, 4).set_left_padding([1, 2, 3]),
        ValueError,
        r"pad must have shape \(2,\) = \(B,\), got \(3\)",
    ),
    (
        "kv_cache_bytes negative",
        lambda: gqa.kv_cache_bytes(2, -1, 64, 10),
        ValueError,
        r"num_kv_heads must be a non-negative",
    ),
    (
        "padding_mask 1-D",
        lambda: gqa.padding_mask(torch.ones(5)),
        ValueError,
        r"attention_mask must have shape \(B, S\)",
    ),
]


@pytest.mark.parametrize("case", MODULE_CASES, ids=[c[0] for c in MODULE_CASES])
def test_module_cache_rope_errors(case):
    _, fn, exc, match = case
    with pytest.raises(exc, match=match):
        fn()


def test_distinct_cases_count():
    assert len({c[0] for c in FUNCTION_CASES + MODULE_CASES}) >= 15 * 2
