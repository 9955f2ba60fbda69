"""Property tests: random shapes, head ratios, batch dims and masks against the float64 reference."""

from __future__ import annotations

import torch
from helpers.reference import attention64
from hypothesis import given, settings
from hypothesis import strategies as st

import gqa


@st.composite
def problems(draw):
    H_kv = draw(st.integers(1, 4))
    G = draw(st.integers(1, 4))
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    L, S, D = draw(st.integers(1, 9)), draw(st.integers(1, 12)), draw(st.integers(1, 12))
    D_v = draw(st.sampled_from([D, draw(st.integers(1, 9))]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, H_kv * G, L, D, generator=g)
    k = torch.randn(*batch, H_kv, S, D, generator=g)
    v = torch.randn(*batch, H_kv, S, D_v, generator=g)
    kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask = None
    if kind != "none":
        # a random broadcastable shape: each dim of (*B, H_q, L, S) kept or set to 1, leading dims maybe dropped
        full = (*batch, H_kv * G, L, S)
        keep = draw(st.lists(st.booleans(), min_size=len(full), max_size=len(full)))
        drop = draw(st.integers(0, len(full) - 2))
        mshape = tuple(n if kept else 1 for n, kept in zip(full, keep, strict=True))[drop:]
        mask = torch.rand(mshape, generator=g) > 0.3
        if kind == "float":
            mask = torch.randn(mshape, generator=g).masked_fill(~mask, float("-inf"))
    causal = draw(st.booleans())
    scale = draw(st.sampled_from([None, 0.5, 2.0]))
    return q, k, v, mask, causal, scale


@settings(max_examples=150, deadline=None)
@given(problems(), st.sampled_from(["reference", "grouped", "auto"]))
def test_random_problems(problem, backend):
    q, k, v, mask, causal, scale = problem
    out = gqa.grouped_attention(q, k, v, mask, is_causal=causal, scale=scale, backend=backend)
    ref, _ = attention64(q, k, v, mask, causal, scale)
    assert out.shape == ref.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=3e-5)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_sdpa_backend_agrees_or_refuses(problem):
    q, k, v, mask, causal, scale = problem
    try:
        out = gqa.grouped_attention(q, k, v, mask, is_causal=causal, scale=scale, backend="sdpa")
    except ValueError as e:  # only where torch would take its copying math path
        assert "math path" in str(e)
        return
    ref, _ = attention64(q, k, v, mask, causal, scale)
    torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=3e-5)
