"""The fused backend: the native CPU decode kernel ``kernels.ops.decode_attention`` (``gqa/kernels/csrc``).

The ``G * L`` query rows of one KV head (the whole group and every new token) go through that head's keys and
values in one pass with an online softmax in float32: each K/V row is read from memory once for all of them, and
the context is split into chunks so that every thread streams even when there is a single head. K/V may be strided
views of a larger cache; masks are read through their broadcast strides (no expanded copy); soft-capping and sinks
are applied in the kernel. float32 and bfloat16, inference only (no backward, no weights, no dropout); ``supports``
says why it refuses the rest.
"""

from __future__ import annotations

import torch

from ... import kernels
from ...kernels import ops
from ..checks import AttnShape, flat_view, kernel_refusal, sinks_need_grad

DTYPES = (torch.float32, torch.bfloat16)


def supports(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    dropout_p: float,
    return_weights: bool,
    attn_mask: torch.Tensor | None = None,
) -> str | None:
    """``None`` if the kernel can run this call, else the reason it cannot."""
    if query.device.type != "cpu":
        return f"device {query.device.type} (CPU only)"
    if query.dtype not in DTYPES:
        return f"dtype {query.dtype} (float32 and bfloat16 only)"
    reason = kernel_refusal(query, key, value, dropout_p=dropout_p, return_weights=return_weights, attn_mask=attn_mask)
    if reason is not None:
        return reason
    if not kernels.available():
        return "native kernels not built (python -m gqa.kernels)"
    return None


def fused_attention(
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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    reason = supports(query, key, value, dropout_p=dropout_p, return_weights=return_weights, attn_mask=attn_mask)
    if reason is None and sinks_need_grad(sinks):
        reason = "sinks that require grad (inference only)"
    if reason is not None:
        raise ValueError(f"backend 'fused' cannot run this call: {reason}")
    out = fused_run(query, key, value, shape=shape, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                    softcap=softcap, sinks=sinks)  # fmt: skip
    return out, None


def fused_run(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    shape: AttnShape,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel on a call ``supports`` took (``attention.routes`` calls this for a signature already checked);
    ``softcap`` and ``sinks (H_q,)`` as ``grouped_attention`` takes them."""
    H_kv, G, L, S, D = shape.H_kv, shape.G, shape.L, shape.S, shape.D
    q = query.reshape(-1, H_kv, G * L, D)  # (N, H_kv, G*L, D): rows g*L + l; a view unless query is strided
    if q.stride(-1) != 1:  # the kernel reads rows of D contiguous values; q is G*L rows per head, a copy is cheap
        q = q.contiguous()
    k, v = flat_view(key, 3), flat_view(value, 3)  # (N, H_kv, S, D), (N, H_kv, S, D_v)
    mask = None
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask.float()
        mask = mask.expand(shape.scores).reshape(-1, H_kv, G, L, S)  # (N, H_kv, G, L, S): strided, stride-0 dims
    if sinks is not None:  # query head h * G + g: the kernel's order
        sinks = sinks.detach().float().contiguous()
    out = ops.decode_attention(q, k, v, mask, scale, L, is_causal, softcap or 0.0, sinks)  # (N, H_kv, G*L, D_v)
    return out.view(*shape.batch, shape.H_q, L, shape.D_v)
