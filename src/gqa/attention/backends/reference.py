"""The reference backend: short, obvious, float32 (or float64) throughout: the oracle for every fast path.

The group lives in its own axis: ``q (*B, H_kv, G, L, D)`` against ``k (*B, H_kv, S, D)``. The einsum letter ``g``
appears only on the query side, so K/V are shared by the ``G`` query heads of a group and never copied per head.
Soft-capping (``softcap``) bends the scaled scores before any mask; sinks (``sinks``, one logit per query head) join
each row's softmax as a key whose value is zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..checks import HALF_DTYPES, AttnShape
from ..masks import apply_mask_, causal_mask, group_mask, soft_cap, softmax_rows, softmax_with_sinks


def reference_attention(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    compute = torch.float32 if query.dtype in HALF_DTYPES else query.dtype
    q = query.to(compute).unflatten(-3, (shape.H_kv, shape.G))  # (*B, H_kv, G, L, D)
    k = key.to(compute)  # (*B, H_kv, S, D)
    v = value.to(compute)  # (*B, H_kv, S, D_v)

    scores = soft_cap(torch.einsum("...hgld,...hsd->...hgls", q, k) * scale, softcap)  # (*B, H_kv, G, L, S)
    ndim = len(shape.scores)
    if attn_mask is not None:
        scores = apply_mask_(scores, group_mask(attn_mask, ndim, shape.H_kv, shape.G))
    if is_causal:
        scores = apply_mask_(scores, causal_mask(shape.L, shape.S, query.device))
    empty_rows = attn_mask is not None or (is_causal and shape.L > shape.S)  # rows that may see no key
    if sinks is not None:
        weights = softmax_with_sinks(scores, sinks.to(compute).view(shape.H_kv, shape.G, 1, 1), empty_rows)
    else:
        weights = softmax_rows(scores, empty_rows)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)

    out = torch.einsum("...hgls,...hsd->...hgld", weights, v)  # (*B, H_kv, G, L, D_v)
    out = out.flatten(-4, -3).to(query.dtype)  # (*B, H_q, L, D_v)
    return out, (weights.flatten(-4, -3).to(query.dtype) if return_weights else None)
