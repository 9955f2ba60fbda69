"""The SDPA backend: ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` where torch runs it
natively grouped.

torch's fused kernels (the CPU flash kernel; flash/cuDNN on CUDA) index the shared KV head per query head, but its
math fallback — chosen for dropout, 3-D inputs and some dtypes and masks — copies K/V with ``repeat_interleave``.
This backend therefore flattens the batch dims to exactly one, turns our bottom-right causal mask into an explicit
mask when ``L != S`` (torch's ``is_causal`` is top-left), and refuses to run when torch would pick the copying path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from .._checks import AttnShape
from ..masks import causal_mask, merge_masks


def _to_4d(t: torch.Tensor) -> torch.Tensor:
    """``(*B, H, L, D)`` -> ``(N, H, L, D)`` with ``N = prod(B)`` (a view for the usual layouts)."""
    return t.reshape(-1, *t.shape[-3:])


def _mask_4d(mask: torch.Tensor, shape: AttnShape) -> torch.Tensor:
    """A mask broadcastable to ``(*B, H_q, L, S)`` as one broadcastable to ``(N, H_q, L, S)``."""
    if mask.dim() <= 2 or (mask.dim() == 4 and len(shape.batch) == 1):
        return mask
    mask = mask.reshape((1,) * (len(shape.scores) - mask.dim()) + tuple(mask.shape))  # one dim per score dim
    if len(shape.batch) == 0:
        return mask[None]  # torch's fused kernels want a 4-D mask here
    if all(s == 1 for s in mask.shape[:-3]):
        return mask.reshape(1, *mask.shape[-3:])
    return mask.expand(*shape.batch, *mask.shape[-3:]).reshape(-1, *mask.shape[-3:])


def _inputs(query, key, value, shape: AttnShape, attn_mask, is_causal):
    q, k, v = _to_4d(query), _to_4d(key), _to_4d(value)
    mask = None if attn_mask is None else _mask_4d(attn_mask, shape)
    native_causal = is_causal and mask is None and shape.L == shape.S
    if is_causal and not native_causal:
        mask = merge_masks(mask, causal_mask(shape.L, shape.S, query.device))
    if mask is not None and mask.dtype not in (torch.bool, query.dtype):
        mask = mask.to(query.dtype)
    return q, k, v, mask, native_causal


def _native(q, k, v, mask, dropout_p: float, native_causal: bool, scale: float, grouped: bool) -> bool:
    if dropout_p > 0.0:
        return False  # every CPU path with dropout is the copying math path
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, dropout_p, native_causal, scale=scale, enable_gqa=grouped)
    except Exception:  # an older torch, or a tracer that cannot run the query: assume the copying path
        return False
    return SDPBackend(choice) not in (SDPBackend.MATH, SDPBackend.ERROR)


def sdpa_is_native(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    shape: AttnShape,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
) -> bool:
    """True when torch would run this call on a fused, natively grouped kernel (no K/V copy)."""
    if dropout_p > 0.0:
        return False
    q, k, v, mask, native_causal = _inputs(query, key, value, shape, attn_mask, is_causal)
    return _native(q, k, v, mask, dropout_p, native_causal, scale, shape.H_q != shape.H_kv)


def sdpa_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    shape: AttnShape,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    return_weights: bool,
) -> tuple[torch.Tensor, None]:
    if return_weights:
        raise ValueError("backend='sdpa' cannot return attention weights; use backend='grouped' or 'auto'")
    q, k, v, mask, native_causal = _inputs(query, key, value, shape, attn_mask, is_causal)
    if not _native(q, k, v, mask, dropout_p, native_causal, scale, shape.H_q != shape.H_kv):
        raise ValueError(
            f"backend='sdpa' would fall back to torch's math path, which copies K/V per query head "
            f"(dtype {query.dtype}, device {query.device}, dropout_p {dropout_p}, D {shape.D}, D_v {shape.D_v}); "
            "use backend='grouped' or 'auto'"
        )
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=native_causal, scale=scale, enable_gqa=True
    )  # (N, H_q, L, D_v)
    return out.reshape(*shape.batch, shape.H_q, shape.L, shape.D_v), None
