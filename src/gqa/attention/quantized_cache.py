"""Attention over a quantized KV cache (``cache.kv``'s ``q8_0`` / ``q4_0`` blocks, or CUDA's ``fp8_e4m3`` bytes),
read where it lies.

On CPU the native kernel (``kernels.ops.decode_attention`` with the blocks' formats) dequantizes a chunk of 64 keys
at a time into float32 scratch in L1 and runs the same online softmax as over a float cache. On CUDA a few new
tokens (decode) go to the Triton split-KV kernel, which dequantizes a tile in registers. Elsewhere (no kernels,
autograd, a long prompt on CUDA) ``chunked_attention`` does the same in torch ops: 1024 keys at a time, a running
max, sum and accumulator in float32, so no dequantized copy of the whole cache is ever made. All see exactly the
cache's stored values (a block's dequantized values are exact in float32).
"""

from __future__ import annotations

import torch

from .. import kernels
from ..cache.kv_dtypes import KVDtype
from ..cache.quantize import dequantize, native_reads, rotate
from .checks import check_window, need_grad
from .masks import group_mask, merge_masks, soft_cap, window_mask

__all__ = ["chunked_attention", "quantized_cache_attention"]

FALLBACK_CHUNK = 1024  # keys per step of the torch fallback


def _dequantized(t: torch.Tensor, kv: KVDtype | None) -> torch.Tensor:
    return dequantize(t, kv) if kv is not None and kv.quantized else t.float()


def quantized_cache_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kinds: tuple[KVDtype, KVDtype],
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    *,
    window: int | tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q (B, H_q, L, D)`` against a cache's ``key (B, H_kv, S, D | row bytes)`` and ``value`` (float or uint8 rows
    of blocks, ``kinds`` = the K and V storage types) -> ``(B, H_q, L, D_v)`` in ``q``'s dtype. ``attn_mask`` bool or
    float, broadcastable to ``(B, H_q, L, S)``; ``is_causal`` bottom-right; ``window``, ``softcap`` and ``sinks``
    ``(H_q,)`` as ``grouped_attention`` takes them. Inference only (no dropout, no attention weights)."""
    B, Hq, L, D = q.shape
    Hkv, S = key.shape[1], key.shape[2]
    scale = D**-0.5 if scale is None else scale
    sides = check_window(window)
    if sides is not None:
        attn_mask = merge_masks(attn_mask, window_mask(L, S, *sides, q.device))
    grad = need_grad(q, sinks, attn_mask)  # (an additive mask may be a learned bias)
    if q.device.type == "cuda" and not grad:
        from ..kernels.triton.split_kv import split_kv_attention, supports

        if supports(q, key, value, v_format=kinds[1].code) is None:
            formats = dict(k_format=kinds[0].code, v_format=kinds[1].code)
            return split_kv_attention(q, key, value, scale=scale, is_causal=is_causal, attn_mask=attn_mask,
                                      softcap=softcap, sinks=sinks, **formats)  # fmt: skip
    native = (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and kernels.available()
              and not grad and native_reads(kinds))  # fmt: skip
    if not native:
        return chunked_attention(q, key, value, kinds, attn_mask, is_causal, scale, softcap=softcap, sinks=sinks)
    from ..kernels import ops

    G = Hq // Hkv
    qv = q.reshape(B, Hkv, G * L, D)  # query head h = (h // G, h % G): rows g * L + l
    if qv.stride(-1) != 1:
        qv = qv.contiguous()
    mask = None
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask.float()
        mask = group_mask(mask, 4, Hkv, G).expand(B, Hkv, G, L, S)  # (B, H_kv, G, L, S), broadcast dims stride 0
    if sinks is not None:
        sinks = sinks.detach().float().contiguous()
    out = ops.decode_attention(qv, key, value, mask, scale, L, is_causal, softcap or 0.0, sinks, kinds[0].code,
                               kinds[1].code)  # fmt: skip
    return out.view(B, Hq, L, out.shape[-1])


def chunked_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kinds: tuple[KVDtype, KVDtype],
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int = FALLBACK_CHUNK,
) -> torch.Tensor:
    """``quantized_cache_attention`` in torch ops (the window already in ``attn_mask``): ``chunk`` keys at a time are
    dequantized and folded into a float32 online softmax; the K/V of a group are broadcast over its query heads, never
    copied. A row that sees no key gets zeros (with a sink too), a NaN score gives a NaN row."""
    B, Hq, L, D = q.shape
    Hkv, S = key.shape[1], key.shape[2]
    G = Hq // Hkv
    qg = (rotate(q) if kinds[0].quantized else q.float()).reshape(B, Hkv, G, L, D)  # keys are stored rotated
    mask = group_mask(attn_mask, 4, Hkv, G) if attn_mask is not None else None  # broadcastable (B, H_kv, G, L, S)
    neg_inf = torch.tensor(float("-inf"), device=q.device)
    m = torch.full((B, Hkv, G, L, 1), float("-inf"), device=q.device)
    total = torch.zeros_like(m)
    acc = None
    rows = torch.arange(L, device=q.device)[:, None] + (S - L)  # each query's own position among the keys
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        k = _dequantized(key[:, :, s0:s1], kinds[0])[:, :, None]  # (B, H_kv, 1, n, D)
        v = _dequantized(value[:, :, s0:s1], kinds[1])[:, :, None]  # (B, H_kv, 1, n, D_v)
        scores = soft_cap(qg @ k.transpose(-1, -2) * scale, softcap)  # (B, H_kv, G, L, n)
        if is_causal:
            scores = scores.masked_fill(torch.arange(s0, s1, device=q.device)[None, :] > rows, float("-inf"))
        if mask is not None:
            part = mask[..., s0:s1]
            scores = scores.masked_fill(~part, float("-inf")) if part.dtype == torch.bool else scores + part.float()
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        m_new = torch.where(scores.isnan().any(-1, keepdim=True), float("nan"), m_new)  # a NaN score: a NaN row
        shift = torch.where(m_new == neg_inf, 0.0, m_new)  # rows that see nothing yet: weights 0, not NaN
        p = torch.exp(scores - shift)
        alpha = torch.exp(torch.where(m == neg_inf, neg_inf, m - shift))
        total = total * alpha + p.sum(-1, keepdim=True)
        acc = p @ v if acc is None else acc * alpha + p @ v
        m = m_new
    if acc is None:  # no key at all
        return q.new_zeros(
            B, Hq, L, value.shape[-1] if kinds[1].block == 1 else value.shape[-1] // kinds[1].block_bytes * 32
        )
    if sinks is not None:
        sink = sinks.float().reshape(1, Hkv, G, 1, 1)
        total = total + torch.exp(sink - torch.where(m == neg_inf, sink, m)) * (m != neg_inf)
    out = torch.where(total > 0, acc / total, torch.where(total.isnan(), total, 0.0))
    return out.reshape(B, Hq, L, -1).to(q.dtype)
