"""GroupedQueryAttention against independent implementations with the same weights:

* ``torch.nn.MultiheadAttention`` for the MHA case (self/cross attention, masks, weights, unbatched input);
* HF transformers' ``LlamaAttention`` and ``Qwen2Attention`` (eager) for GQA/MQA with RoPE, left padding, Llama-3
  frequency scaling, and token-by-token decoding through our KV caches.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gqa

pytest.importorskip("transformers")

from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2RotaryEmbedding

TOL = {"rtol": 1e-5, "atol": 1e-5}


# ========================================================================================== torch.nn.MultiheadAttention


def mha_pair(
    E: int, H: int, *, kdim: int | None = None, vdim: int | None = None, bias: bool = True
) -> tuple[nn.MultiheadAttention, gqa.GroupedQueryAttention]:
    """A torch MHA with random weights *and biases* (its biases start at zero) and our module with the same weights."""
    mha = nn.MultiheadAttention(E, H, bias=bias, batch_first=True, kdim=kdim, vdim=vdim).eval()
    ours = gqa.GroupedQueryAttention(E, H, qkv_bias=bias, out_bias=bias, kdim=kdim, vdim=vdim).eval()
    with torch.no_grad():
        for p in mha.parameters():
            p.normal_(0.0, 0.3)
        if mha._qkv_same_embed_dim:
            wq, wk, wv = mha.in_proj_weight.chunk(3)
        else:
            wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
        ours.q_proj.weight.copy_(wq)
        ours.k_proj.weight.copy_(wk)
        ours.v_proj.weight.copy_(wv)
        ours.o_proj.weight.copy_(mha.out_proj.weight)
        if bias:
            bq, bk, bv = mha.in_proj_bias.chunk(3)
            ours.q_proj.bias.copy_(bq)
            ours.k_proj.bias.copy_(bk)
            ours.v_proj.bias.copy_(bv)
            ours.o_proj.bias.copy_(mha.out_proj.bias)
    return mha, ours


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("B", "L"), [(1, 1), (2, 5), (3, 40)])  # L=40: long enough for the SDPA path under "auto"
@pytest.mark.parametrize(("E", "H"), [(32, 4), (24, 1), (30, 5)])
def test_mha_self_attention(bias, B, L, E, H):
    torch.manual_seed(0)
    mha, ours = mha_pair(E, H, bias=bias)
    x = torch.randn(B, L, E)
    with torch.no_grad():
        ref, _ = mha(x, x, x, need_weights=False)
        out = ours(x)
    assert out.shape == (B, L, E)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("backend", ["auto", "reference", "grouped"])
@pytest.mark.parametrize("form", ["is_causal", "bool", "float_causal", "float_random"])
@pytest.mark.parametrize("L", [6, 40])
def test_mha_causal_and_attn_masks(backend, form, L):
    torch.manual_seed(1)
    E, H, B = 32, 4, 2
    mha, ours = mha_pair(E, H)
    x = torch.randn(B, L, E)
    forbidden = torch.ones(L, L, dtype=torch.bool).triu(1)  # torch MHA bool convention: True = NOT allowed
    if form == "float_random":
        float_mask = torch.randn(L, L)  # added to the scores by both
        torch_mask, kwargs = float_mask, {"attn_mask": float_mask}
    elif form == "float_causal":
        float_mask = torch.zeros(L, L).masked_fill(forbidden, float("-inf"))
        torch_mask, kwargs = float_mask, {"attn_mask": float_mask}
    elif form == "bool":
        torch_mask, kwargs = forbidden, {"attn_mask": ~forbidden}  # ours: True = allowed
    else:
        torch_mask, kwargs = forbidden, {"is_causal": True}
    with torch.no_grad():
        ref, ref_w = mha(x, x, x, attn_mask=torch_mask, need_weights=True, average_attn_weights=False)
        out = ours(x, backend=backend, **kwargs)
        out_w, w = ours(x, backend=backend, need_weights=True, **kwargs)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out_w, ref, **TOL)
    torch.testing.assert_close(w, ref_w, **TOL)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_key_padding_mask(causal, need_weights):
    torch.manual_seed(2)
    E, H, B, L = 32, 4, 4, 7
    mha, ours = mha_pair(E, H)
    x = torch.randn(B, L, E)
    lengths = torch.tensor([7, 5, 1, 3])  # right padding: with a causal mask every query row keeps key 0
    real = torch.arange(L)[None, :] < lengths[:, None]  # HF-style (B, S): True = real token
    if not causal:
        real = real.flip(-1)  # left padding as well, where no causal mask can empty a row
    key_padding_mask = ~real  # torch: True = ignore
    torch_mask = torch.ones(L, L, dtype=torch.bool).triu(1) if causal else None
    with torch.no_grad():
        ref, ref_w = mha(x, x, x, key_padding_mask=key_padding_mask, attn_mask=torch_mask, average_attn_weights=False)
        result = ours(x, attn_mask=gqa.padding_mask(real.long()), is_causal=causal, need_weights=need_weights)
    out, w = result if need_weights else (result, None)
    torch.testing.assert_close(out, ref, **TOL)
    if need_weights:
        torch.testing.assert_close(w, ref_w, **TOL)
        assert bool((w.masked_select(~real[:, None, None, :].expand_as(w)) == 0).all())


@pytest.mark.parametrize(
    ("kdim", "vdim", "same_tensor"),
    [(None, None, True), (None, None, False), (12, 12, True), (12, 12, False), (12, 20, False), (40, 8, False)],
)
@pytest.mark.parametrize(("L", "S"), [(5, 9), (1, 3), (6, 6)])
def test_mha_cross_attention(kdim, vdim, same_tensor, L, S):
    torch.manual_seed(3)
    E, H, B = 32, 4, 2
    mha, ours = mha_pair(E, H, kdim=kdim, vdim=vdim)
    x = torch.randn(B, L, E)
    key_in = torch.randn(B, S, kdim or E)
    value_in = key_in if same_tensor else torch.randn(B, S, vdim or E)
    with torch.no_grad():
        ref, ref_w = mha(x, key_in, value_in, average_attn_weights=False)
        kv_input = key_in if same_tensor else (key_in, value_in)
        out, w = ours(x, kv_input, need_weights=True)
        out_nw = ours(x, kv_input)
    assert out.shape == (B, L, E) and w.shape == (B, H, L, S)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out_nw, ref, **TOL)
    torch.testing.assert_close(w, ref_w, **TOL)


def test_mha_cross_attention_with_key_padding():
    torch.manual_seed(4)
    E, H, B, L, S = 24, 3, 3, 4, 6
    mha, ours = mha_pair(E, H, kdim=10, vdim=14)
    x, key_in, value_in = torch.randn(B, L, E), torch.randn(B, S, 10), torch.randn(B, S, 14)
    real = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [1, 0, 1, 0, 1, 0]], dtype=torch.bool)
    with torch.no_grad():
        ref, ref_w = mha(x, key_in, value_in, key_padding_mask=~real, average_attn_weights=False)
        out, w = ours(x, (key_in, value_in), attn_mask=gqa.padding_mask(real), need_weights=True)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(w, ref_w, **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_mha_need_weights_average(causal):
    """torch's default head-averaged weights equal the mean of ours over the head dim."""
    torch.manual_seed(5)
    E, H, B, L = 32, 8, 2, 5
    mha, ours = mha_pair(E, H)
    x = torch.randn(B, L, E)
    torch_mask = torch.ones(L, L, dtype=torch.bool).triu(1) if causal else None
    with torch.no_grad():
        _, ref_avg = mha(x, x, x, attn_mask=torch_mask)
        _, w = ours(x, is_causal=causal, need_weights=True)
    assert w.shape == (B, H, L, L)
    torch.testing.assert_close(w.mean(dim=1), ref_avg, **TOL)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, L), **TOL)


@pytest.mark.parametrize("form", ["none", "is_causal", "bool", "cross"])
def test_mha_unbatched(form):
    torch.manual_seed(6)
    E, H, L, S = 32, 4, 5, 7
    mha, ours = mha_pair(E, H, kdim=16 if form == "cross" else None, vdim=16 if form == "cross" else None)
    x = torch.randn(L, E)
    kv = torch.randn(S, 16) if form == "cross" else x
    forbidden = torch.ones(L, L, dtype=torch.bool).triu(1)
    torch_mask = forbidden if form in ("is_causal", "bool") else None
    kwargs = {"none": {}, "cross": {}, "is_causal": {"is_causal": True}, "bool": {"attn_mask": ~forbidden}}[form]
    with torch.no_grad():
        ref, ref_w = mha(x, kv, kv, attn_mask=torch_mask, average_attn_weights=False)
        out, w = ours(x, kv if form == "cross" else None, need_weights=True, **kwargs)
        out_nw = ours(x, kv if form == "cross" else None, **kwargs)
    assert out.shape == (L, E) and w.shape == ref_w.shape == (H, L, kv.shape[0])
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out_nw, ref, **TOL)
    torch.testing.assert_close(w, ref_w, **TOL)


# =================================================================================== HF LlamaAttention / Qwen2Attention

MODELS = {
    "llama": (LlamaConfig, LlamaAttention, LlamaRotaryEmbedding),
    "qwen2": (Qwen2Config, Qwen2Attention, Qwen2RotaryEmbedding),
}
# (hidden, heads, kv heads, head_dim, rope_theta)
SHAPES = [
    (64, 8, 2, 8, 10000.0),  # GQA
    (90, 18, 6, 10, 500000.0),  # odd sizes: hidden 90, 3 query heads per KV head, head_dim 10 (half = 5)
    (90, 18, 6, 6, 10000.0),  # head_dim * heads != hidden
    (48, 6, 6, 8, 10000.0),  # MHA
    (64, 8, 1, 8, 100000.0),  # MQA
]
SHAPE_IDS = ["gqa", "odd10", "odd6", "mha", "mqa"]


def hf_pair(model: str, hidden: int, heads: int, kv_heads: int, head_dim: int, rope_parameters: dict, max_pos=256):
    """HF attention (eager) + its rotary embedding, and our module with the same weights and a matching RoPE."""
    config_cls, attn_cls, rotary_cls = MODELS[model]
    config = config_cls(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=16,
        num_hidden_layers=1,
        vocab_size=32,
        max_position_embeddings=max_pos,
        rope_parameters=dict(rope_parameters),
    )
    config._attn_implementation = "eager"
    torch.manual_seed(100)
    hf = attn_cls(config, layer_idx=0).eval()
    rotary = rotary_cls(config)
    qwen = model == "qwen2"
    assert (hf.q_proj.bias is not None) == qwen and hf.o_proj.bias is None
    params = config.rope_parameters
    rope = gqa.RoPE(head_dim, theta=params["rope_theta"], scaling=params, max_position=16)
    ours = gqa.GroupedQueryAttention(hidden, heads, kv_heads, head_dim, qkv_bias=qwen, out_bias=False, rope=rope)
    ours.load_state_dict(hf.state_dict())  # q/k/v/o_proj load 1:1
    return hf, rotary, ours.eval()


def additive_mask(allowed: torch.Tensor) -> torch.Tensor:
    """Bool ``(B, L, S)`` -> HF's 4-D additive float mask ``(B, 1, L, S)``."""
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]


def hf_forward(hf, rotary, x: torch.Tensor, position_ids: torch.Tensor, real: torch.Tensor | None = None):
    """HF attention over the full sequence with an explicit causal (and padding) mask; returns (out, weights)."""
    B, L, _ = x.shape
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None].expand(B, L, L)
    if real is not None:
        allowed = allowed & real[:, None, :]
    position_embeddings = rotary(x, position_ids.expand(B, L))
    with torch.no_grad():
        return hf(x, position_embeddings=position_embeddings, attention_mask=additive_mask(allowed))


def left_padding(B: int, L: int, pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style (B, L) mask with ``pads[b]`` leading zeros, and HF's positions ``cumsum - 1`` (0 on padding)."""
    real = torch.arange(L)[None, :] >= torch.tensor(pads)[:, None]
    position_ids = (real.long().cumsum(-1) - 1).clamp_min(0)
    return real, position_ids


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(("hidden", "heads", "kv_heads", "head_dim", "theta"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("L", [1, 7])
def test_hf_causal_forward(model, hidden, heads, kv_heads, head_dim, theta, L):
    torch.manual_seed(7)
    hf, rotary, ours = hf_pair(model, hidden, heads, kv_heads, head_dim, {"rope_type": "default", "rope_theta": theta})
    B = 2
    x = torch.randn(B, L, hidden)
    position_ids = torch.arange(L)[None]
    ref, ref_w = hf_forward(hf, rotary, x, position_ids)
    with torch.no_grad():
        out = ours(x, is_causal=True, position_ids=position_ids[0])
        out_default = ours(x, is_causal=True)  # default positions are 0..L-1
        out_w, w = ours(x, is_causal=True, need_weights=True)
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(out_default, ref, **TOL)
    torch.testing.assert_close(out_w, ref, **TOL)
    torch.testing.assert_close(w, ref_w, **TOL)  # HF eager repeats K/V: (B, H_q, L, S) per query head


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(("hidden", "heads", "kv_heads", "head_dim", "theta"), SHAPES[:3], ids=SHAPE_IDS[:3])
def test_hf_offset_positions(model, hidden, heads, kv_heads, head_dim, theta):
    """Positions that do not start at 0 (a continued sequence) and differ per row."""
    torch.manual_seed(8)
    hf, rotary, ours = hf_pair(model, hidden, heads, kv_heads, head_dim, {"rope_type": "default", "rope_theta": theta})
    B, L = 3, 6
    x = torch.randn(B, L, hidden)
    position_ids = torch.arange(L)[None] + torch.tensor([[0], [17], [40]])  # (B, L), beyond the table of 16
    ref, _ = hf_forward(hf, rotary, x, position_ids)
    with torch.no_grad():
        out = ours(x, is_causal=True, position_ids=position_ids)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(("hidden", "heads", "kv_heads", "head_dim", "theta"), SHAPES, ids=SHAPE_IDS)
def test_hf_left_padded_batch(model, hidden, heads, kv_heads, head_dim, theta):
    torch.manual_seed(9)
    hf, rotary, ours = hf_pair(model, hidden, heads, kv_heads, head_dim, {"rope_type": "default", "rope_theta": theta})
    B, L = 3, 7
    real, position_ids = left_padding(B, L, [0, 2, 5])
    x = torch.randn(B, L, hidden)
    ref, _ = hf_forward(hf, rotary, x, position_ids, real)
    with torch.no_grad():
        out = ours(x, attn_mask=gqa.padding_mask(real.long()), is_causal=True, position_ids=position_ids)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[real], ref[real], **TOL)  # padded query rows are don't-care


LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 1)])
def test_hf_llama3_scaling_beyond_original_context(model, heads, kv_heads):
    torch.manual_seed(10)
    hidden, head_dim = 64, 16  # head_dim 16, theta 1e4, original 32: kept, blended and divided frequencies
    hf, rotary, ours = hf_pair(model, hidden, heads, kv_heads, head_dim, LLAMA3, max_pos=256)
    default = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim)
    ratio = default / rotary.inv_freq.double()
    assert (ratio - 1).abs().min() < 1e-6 and (ratio - 8).abs().min() < 1e-5
    assert ((ratio > 1.01) & (ratio < 7.99)).any(), "the blended band must be exercised"
    torch.testing.assert_close(ours.rope.inv_freq, rotary.inv_freq, rtol=1e-6, atol=0)
    B, L = 2, 12
    x = torch.randn(B, L, hidden)
    position_ids = torch.arange(L)[None] + torch.tensor([[30], [100]])  # crosses and far exceeds 32
    ref, _ = hf_forward(hf, rotary, x, position_ids)
    with torch.no_grad():
        out = ours(x, is_causal=True, position_ids=position_ids)
    torch.testing.assert_close(out, ref, **TOL)
    # the scaling matters here: unscaled frequencies give a clearly different answer
    ours.rope = gqa.RoPE(head_dim, theta=LLAMA3["rope_theta"])
    with torch.no_grad():
        unscaled = ours(x, is_causal=True, position_ids=position_ids)
    assert not torch.allclose(unscaled, ref, rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------------------------------------- cached decoding


def make_cache(kind: str, B: int, kv_heads: int, head_dim: int, max_len: int):
    if kind == "static":
        return gqa.StaticKVCache(B, kv_heads, head_dim, max_len)
    return gqa.DynamicKVCache(B, kv_heads, head_dim, initial_len=2)  # grows several times


def decode(ours, cache, x: torch.Tensor, prompt: int, step: int) -> torch.Tensor:
    """Prefill ``prompt`` tokens, then feed ``step`` tokens at a time; returns the concatenated outputs."""
    outs = []
    with torch.no_grad():
        outs.append(ours(x[:, :prompt], cache=cache, is_causal=True))
        for t in range(prompt, x.shape[1], step):
            outs.append(ours(x[:, t : t + step], cache=cache, is_causal=True))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(("hidden", "heads", "kv_heads", "head_dim", "theta"), SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize(("prompt", "step"), [(1, 1), (4, 1), (3, 3)])
def test_hf_cached_decoding(cache_kind, model, hidden, heads, kv_heads, head_dim, theta, prompt, step):
    torch.manual_seed(11)
    hf, rotary, ours = hf_pair(model, hidden, heads, kv_heads, head_dim, {"rope_type": "default", "rope_theta": theta})
    B, L = 2, 10
    x = torch.randn(B, L, hidden)
    ref, _ = hf_forward(hf, rotary, x, torch.arange(L)[None])
    cache = make_cache(cache_kind, B, kv_heads, head_dim, max_len=L)
    out = decode(ours, cache, x, prompt, step)
    assert cache.seq_len == L
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("step", [1, 2])
def test_hf_cached_decoding_left_padded(cache_kind, model, step):
    torch.manual_seed(12)
    hidden, heads, kv_heads, head_dim = 64, 8, 2, 8
    hf, rotary, ours = hf_pair(model, hidden, heads, kv_heads, head_dim, {"rope_type": "default", "rope_theta": 1e4})
    B, prompt, L = 3, 5, 11
    pads = [0, 2, 4]
    real, position_ids = left_padding(B, L, pads)  # padding only inside the prompt
    x = torch.randn(B, L, hidden)
    ref, _ = hf_forward(hf, rotary, x, position_ids, real)
    cache = make_cache(cache_kind, B, kv_heads, head_dim, max_len=16)
    cache.set_left_padding(pads)
    out = decode(ours, cache, x, prompt, step)
    assert torch.equal(cache.lengths, torch.tensor([L - p for p in pads]))
    torch.testing.assert_close(out[real], ref[real], **TOL)


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
@pytest.mark.parametrize("model", list(MODELS))
def test_hf_cached_decoding_llama3(cache_kind, model):
    torch.manual_seed(13)
    hidden, heads, kv_heads, head_dim = 64, 4, 2, 16
    hf, rotary, ours = hf_pair(model, hidden, heads, kv_heads, head_dim, LLAMA3, max_pos=256)
    B, L = 1, 40  # decodes past original_max_position_embeddings = 32
    x = torch.randn(B, L, hidden)
    ref, _ = hf_forward(hf, rotary, x, torch.arange(L)[None])
    cache = make_cache(cache_kind, B, kv_heads, head_dim, max_len=L)
    out = decode(ours, cache, x, prompt=30, step=1)
    torch.testing.assert_close(out, ref, **TOL)
