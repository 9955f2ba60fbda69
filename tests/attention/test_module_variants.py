"""``GroupedQueryAttention`` with a window, soft-capping, sinks and q/k norm: against HF Qwen3's attention module
(q/k norm) on the same weights, against the functional call, and the fast decode paths leave such layers alone."""

from __future__ import annotations

import pytest
import torch

import gqa
from gqa import GroupedQueryAttention, RoPE


def test_qk_norm_matches_hf_qwen3_attention():
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    from transformers import Qwen3Config

    cfg = Qwen3Config(hidden_size=48, num_attention_heads=6, num_key_value_heads=2, head_dim=12, rope_theta=1000.0,
                      max_position_embeddings=64, rms_norm_eps=1e-6, attn_implementation="eager")  # fmt: skip
    torch.manual_seed(0)
    hf = qwen3.Qwen3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = GroupedQueryAttention(48, 6, 2, 12, rope=RoPE(12, theta=1000.0), qk_norm=True, norm_eps=1e-6).eval()
    missing = ours.load_state_dict(hf.state_dict(), strict=False)
    assert not missing.unexpected_keys and not missing.missing_keys
    x = torch.randn(2, 9, 48)
    positions = torch.arange(9)[None].expand(2, 9)
    cos, sin = qwen3.Qwen3RotaryEmbedding(cfg)(x, positions)
    causal = torch.zeros(9, 9).masked_fill(~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    with torch.no_grad():
        want, _ = hf(x, position_embeddings=(cos, sin), attention_mask=causal[None, None])
        got = ours(x, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_module_options_reach_the_attention_call():
    torch.manual_seed(0)
    m = GroupedQueryAttention(32, 4, 2, rope=RoPE(8), window=3, softcap=4.0, sinks=True).eval()
    assert not m.plain and "window=(3, None)" in repr(m)
    with torch.no_grad():
        m.sinks.normal_()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        got = m(x, is_causal=True)
        q, k, v = (t.unflatten(-1, (-1, 8)).transpose(1, 2) for t in (m.q_proj(x), m.k_proj(x), m.v_proj(x)))
        q, k = m.rope(q, k, torch.arange(7))
        a = gqa.grouped_attention(q, k, v, is_causal=True, window=3, softcap=4.0, sinks=m.sinks, backend="reference")
        want = m.o_proj(a.transpose(1, 2).flatten(-2))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    loss = m(x, is_causal=True).square().sum()
    loss.backward()
    assert m.sinks.grad is not None and m.sinks.grad.abs().sum() > 0


def test_decoding_with_a_cache_keeps_the_window():
    """A windowed layer decoded token by token through a static cache equals its full causal forward."""
    torch.manual_seed(1)
    m = GroupedQueryAttention(32, 4, 2, rope=RoPE(8), window=2, softcap=3.0).eval()
    x = torch.randn(1, 9, 32)
    with torch.no_grad():
        full = m(x, is_causal=True)
        cache = gqa.StaticKVCache(1, 2, 8, 9)
        steps = torch.cat([m(x[:, t : t + 1], is_causal=True, cache=cache) for t in range(9)], dim=1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


def test_fast_decode_paths_leave_variant_layers_to_the_eager_forward():
    from gqa.decoding.fused_step import fused_applies
    from gqa.decoding.steps import select_step
    from gqa.models import CausalLM
    from gqa.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=64)  # fmt: skip
    model = CausalLM(cfg).eval()
    model.model.layers[1].self_attn.softcap = 5.0
    caches = model.new_caches(1, 8)
    assert select_step(model, caches).name == "eager"  # soft-capping in a Llama layer: the per-layer step lacks it
    assert fused_applies(model) is None  # the GPU step takes it (and windows, sinks, q/k norms)
    model.model.layers[1].self_attn.softcap = None
    model.model.layers[1].self_attn.window = (4, 2)
    assert "window" in fused_applies(model)  # a right side: not a decode step's window
