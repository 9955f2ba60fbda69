"""GroupedQueryAttention module behaviour beyond the HF / torch parity tests."""

from __future__ import annotations

import pytest
import torch

import gqa


def test_gqa_equals_mha_with_kv_heads_repeated():
    """Query head i uses KV head i // G: an MHA module whose K/V projection rows repeat each KV head G times is the
    same function."""
    torch.manual_seed(0)
    E, H_q, H_kv, D = 36, 6, 2, 6
    grouped = gqa.GroupedQueryAttention(E, H_q, H_kv, qkv_bias=True, out_bias=True)
    mha = gqa.GroupedQueryAttention(E, H_q, qkv_bias=True, out_bias=True)
    with torch.no_grad():
        for name in ("q_proj", "o_proj"):
            getattr(mha, name).load_state_dict(getattr(grouped, name).state_dict())
        for name in ("k_proj", "v_proj"):
            src = getattr(grouped, name)
            getattr(mha, name).weight.copy_(src.weight.unflatten(0, (H_kv, D)).repeat_interleave(3, 0).flatten(0, 1))
            getattr(mha, name).bias.copy_(src.bias.unflatten(0, (H_kv, D)).repeat_interleave(3, 0).flatten(0, 1))
    x = torch.randn(2, 5, E)
    torch.testing.assert_close(grouped(x, is_causal=True), mha(x, is_causal=True))


@pytest.mark.parametrize("batch", [(), (3,), (2, 3)])
def test_leading_batch_dims(batch):
    torch.manual_seed(0)
    attn = gqa.GroupedQueryAttention(32, 8, 2, rope=gqa.RoPE(4))
    x = torch.randn(*batch, 5, 32)
    out = attn(x, is_causal=True)
    assert out.shape == (*batch, 5, 32)
    flat = x.reshape(-1, 5, 32)
    rows = torch.stack([attn(row, is_causal=True) for row in flat])  # each row alone, unbatched (L, E)
    torch.testing.assert_close(out.reshape(-1, 5, 32), rows, atol=1e-6, rtol=1e-6)


def test_dropout_only_in_training():
    torch.manual_seed(0)
    attn = gqa.GroupedQueryAttention(32, 8, 2, dropout=0.5)
    x = torch.randn(2, 6, 32)
    attn.eval()
    first, second = attn(x), attn(x)
    torch.testing.assert_close(first, second)
    attn.train()
    torch.manual_seed(1)
    dropped = attn(x)
    assert not torch.allclose(dropped, first, atol=1e-3)
    _, weights = attn(x, need_weights=True)
    assert ((weights == 0).float().mean() > 0.3).item()


def test_cross_attention_with_separate_key_and_value_inputs():
    torch.manual_seed(0)
    E, kdim, vdim = 24, 10, 14
    attn = gqa.GroupedQueryAttention(E, 6, 3, kdim=kdim, vdim=vdim)
    x, key_in, value_in = torch.randn(2, 4, E), torch.randn(2, 7, kdim), torch.randn(2, 7, vdim)
    out, weights = attn(x, (key_in, value_in), need_weights=True)
    # independent: project by hand, attend per query head with its KV head, project out
    q = attn.q_proj(x).view(2, 4, 6, 4).transpose(1, 2)
    k = attn.k_proj(key_in).view(2, 7, 3, 4).transpose(1, 2).repeat_interleave(2, 1)
    v = attn.v_proj(value_in).view(2, 7, 3, 4).transpose(1, 2).repeat_interleave(2, 1)
    w = torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1)
    expected = attn.o_proj((w @ v).transpose(1, 2).reshape(2, 4, 24))
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights, w)


def test_float_and_bool_masks_and_position_ids():
    torch.manual_seed(0)
    attn = gqa.GroupedQueryAttention(32, 4, 2, rope=gqa.RoPE(8))
    x = torch.randn(2, 5, 32)
    keep = torch.rand(2, 1, 5, 5) > 0.3
    keep[..., 0] = True
    additive = torch.zeros(2, 1, 5, 5).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(attn(x, attn_mask=keep), attn(x, attn_mask=additive))
    # positions shifted for every row equal the same positions given per row
    pos = torch.arange(3, 8)
    torch.testing.assert_close(attn(x, position_ids=pos), attn(x, position_ids=pos.expand(2, 5)))
    # RoPE encodes relative positions: a uniform shift changes nothing, uneven gaps do
    torch.testing.assert_close(attn(x, position_ids=pos), attn(x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(attn(x, position_ids=torch.tensor([0, 1, 2, 9, 30])), attn(x), atol=1e-3)


def test_inputs_of_another_dtype_and_a_cache_of_another_batch_are_named():
    """A half input to float32 weights raised torch's "expected m1 and m2 to have the same dtype" from inside the
    projection; a cache of 3 rows for 2 inputs was blamed on ``position_ids`` (which the caller never gave)."""
    attn = gqa.GroupedQueryAttention(64, 4, 2)
    with pytest.raises(ValueError, match=r"x is torch.float16, the module's weights torch.float32"):
        attn(torch.randn(2, 5, 64).half())
    with pytest.raises(ValueError, match=r"kv_input is torch.bfloat16, the module's weights torch.float32"):
        attn(torch.randn(2, 5, 64), kv_input=torch.randn(2, 7, 64).bfloat16())
    roped = gqa.GroupedQueryAttention(192, 6, 2, rope=gqa.RoPE(32))
    with pytest.raises(ValueError, match=r"cache holds 3 rows, x \(2, 5, 192\) has 2"):
        roped(torch.randn(2, 5, 192), cache=gqa.StaticKVCache(3, 2, 32, 8))
    assert roped(torch.randn(3, 5, 192), cache=gqa.StaticKVCache(3, 2, 32, 8)).shape == (3, 5, 192)
