"""The grouped backend: fold the ``G`` query heads of a group into the row dimension of one matmul per KV head.

``q (*B, H_q, L, D)`` is viewed as ``(*B, H_kv, G*L, D)``; one ``(G*L, D) @ (D, S)`` product per KV head computes the
scores of the whole group while K is read once. This is the fast path for decode-like shapes (few query rows, a long
cache), where the cost is reading K/V and a single wide matmul reads it best.

Half precision: the scores are float32 — q and K are converted to float32 for the first matmul (K once, at ``H_kv``
heads), since a half GEMM would round every score to 8 (bf16) or 11 (fp16) bits before the softmax: 0.07 off a
float64 reference on peaked scores where float32 scores stay at the output's own rounding. Scaling, masking and the
softmax run in float32; the weights are cast to the value dtype for the second matmul (float32 accumulation inside
the GEMM). float16 on CPU, which has no fast float16 GEMM, runs that one in float32 too (V converted once).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import HALF_DTYPES, AttnShape
from ..masks import apply_mask_, causal_mask, group_mask, softmax_rows

# Up to this many query rows per KV head (G * L), float32/float64 scores are computed as K @ q^T (see below).
GEMV_ROWS = 8


def grouped_attention_rows(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, H_kv, G, L, S = shape.batch, shape.H_kv, shape.G, shape.L, shape.S
    out_dtype = query.dtype
    if out_dtype == torch.float16 and query.device.type == "cpu":  # no fast fp16 GEMM on CPU: run it in float32
        query, key, value = query.float(), key.float(), value.float()
    q = query.reshape(*B, H_kv, G * L, shape.D)  # (*B, H_kv, G*L, D): the group folded into rows
    if query.dtype in HALF_DTYPES:  # float32 scores (module docstring)
        q, key = q.float(), key.float()
    if G * L <= GEMV_ROWS:
        # Few rows: let K be the matrix of a GEMV, (S, D) @ (D, G*L), which reads K in its row-major layout — on
        # CPU about twice as fast as q @ K^T, whose GEMV walks K^T. The transpose back is G*L*S values, tiny.
        scores = torch.matmul(key, (q * scale).transpose(-1, -2)).transpose(-1, -2).contiguous()  # (*B, H_kv, G*L, S)
    else:
        scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)  # (*B, H_kv, G*L, S)

    masked = attn_mask is not None or is_causal
    if masked:
        grouped = scores.view(*B, H_kv, G, L, S)  # (*B, H_kv, G, L, S)
        if attn_mask is not None:
            grouped = apply_mask_(grouped, group_mask(attn_mask, len(shape.scores), H_kv, G))
        if is_causal:
            grouped = apply_mask_(grouped, causal_mask(L, S, query.device))
        scores = grouped.view(*B, H_kv, G * L, S)
    weights = softmax_rows(scores, attn_mask is not None or (is_causal and L > S))
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)

    out = torch.matmul(weights.to(value.dtype), value)  # (*B, H_kv, G*L, D_v)
    out = out.view(*B, shape.H_q, L, shape.D_v).to(out_dtype)  # (*B, H_q, L, D_v)
    return out, (weights.view(shape.scores).to(out_dtype) if return_weights else None)
