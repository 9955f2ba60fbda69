"""The grouped backend: fold the ``G`` query heads of a group into the row dimension of one matmul per KV head.

``q (*B, H_q, L, D)`` is viewed as ``(*B, H_kv, G*L, D)``; one ``(G*L, D) @ (D, S)`` product per KV head computes the
scores of the whole group while K is read once. This is the fast path for decode-like shapes (few query rows, a long
cache), where the cost is reading K/V and a single wide matmul reads it best.

Half precision: the scores are float32 — q and K are converted to float32 for the first matmul (K once, at ``H_kv``
heads), since a half GEMM would round every score to 8 (bf16) or 11 (fp16) bits before the softmax: 0.07 off a
float64 reference on peaked scores where float32 scores stay at the output's own rounding. Scaling, masking and the
softmax run in float32; the weights are cast to the value dtype for the second matmul (float32 accumulation inside
the GEMM). float16 on CPU, which has no fast float16 GEMM, runs that one in float32 too (V converted once).
Soft-capping and sinks as in the reference backend.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..checks import HALF_DTYPES, AttnShape
from ..masks import apply_mask_, causal_mask, group_mask, soft_cap, softmax_rows, softmax_with_sinks

# Up to this many query rows per KV head (G * L), float32/float64 scores are computed as K @ q^T (see below).
GEMV_ROWS = 8


def _folded_dims(key: torch.Tensor, value: torch.Tensor, batch: tuple[int, ...]) -> list[int]:
    """Batch dims (indices into ``*B``) where the output has several entries but key and value have one: there the
    query's entries are folded into the rows of the matmul, so K/V are read as they are instead of being expanded
    to a copy by the matmul's broadcasting."""
    return [i for i, n in enumerate(batch) if n > 1 and key.shape[i] == 1 and value.shape[i] == 1]


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
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, H_kv, G, L, S = shape.batch, shape.H_kv, shape.G, shape.L, shape.S
    out_dtype = query.dtype
    if out_dtype == torch.float16 and query.device.type == "cpu":  # no fast fp16 GEMM on CPU: run it in float32
        query, key, value = query.float(), key.float(), value.float()
    # Rows: the group (and any batch dims only the query has, see _folded_dims) folded into the row dim, per KV head.
    nb, folded = len(B), _folded_dims(key, value, B)
    kept = [i for i in range(nb) if i not in folded]
    order = [*kept, nb, *folded, nb + 1, nb + 2]  # (*B_kept, H_kv, *B_folded, G, L) of (*B, H_kv, G, L)
    B_kept, B_folded = [B[i] for i in kept], [B[i] for i in folded]
    R = math.prod(B_folded) * G * L  # query rows per KV head and kept batch entry
    q = query.expand(*B, *query.shape[-3:]).unflatten(-3, (H_kv, G))  # (*B, H_kv, G, L, D): views
    q = q.permute(*order, nb + 3).reshape(*B_kept, H_kv, R, shape.D)  # a copy of q at most, never of K/V
    if folded:
        pick = tuple(0 if i in folded else slice(None) for i in range(nb))
        key, value = key[pick], value[pick]  # (*B_kept, H_kv, S, D): the size-1 dims dropped, views
    if query.dtype in HALF_DTYPES:  # float32 scores (module docstring)
        q, key = q.float(), key.float()
    if R <= GEMV_ROWS:
        # Few rows: let K be the matrix of a GEMV, (S, D) @ (D, R), which reads K in its row-major layout — on
        # CPU about twice as fast as q @ K^T, whose GEMV walks K^T. The transpose back is R*S values, tiny.
        scores = torch.matmul(key, (q * scale).transpose(-1, -2)).transpose(-1, -2).contiguous()  # (*B_k, H_kv, R, S)
    else:
        scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)  # (*B_kept, H_kv, R, S)
    scores = soft_cap(scores, softcap)

    laid_out = (*B_kept, H_kv, *B_folded, G, L)  # the rows unfolded
    if attn_mask is not None or is_causal:
        grouped = scores.view(*laid_out, S)
        if attn_mask is not None:
            mask = group_mask(attn_mask, len(shape.scores), H_kv, G)  # broadcastable to (*B, H_kv, G, L, S)
            grouped = apply_mask_(grouped, mask.permute(*order, nb + 3))
        if is_causal:
            grouped = apply_mask_(grouped, causal_mask(L, S, query.device))
        scores = grouped.view(*B_kept, H_kv, R, S)
    empty_rows = attn_mask is not None or (is_causal and L > S)  # rows that may see no key
    if sinks is not None:  # each row's head's sink: rows are (*B_folded, G, L) per KV head
        sink_rows = sinks.view(H_kv, *[1] * len(B_folded), G, 1).expand(H_kv, *B_folded, G, L).reshape(H_kv, R, 1)
        weights = softmax_with_sinks(scores, sink_rows.to(scores.dtype), empty_rows)
    else:
        weights = softmax_rows(scores, empty_rows)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)

    out = torch.matmul(weights.to(value.dtype), value)  # (*B_kept, H_kv, R, D_v)
    back = [order.index(i) for i in range(nb + 3)]  # the inverse permutation, for out and weights
    out = out.view(*laid_out, shape.D_v).permute(*back, nb + 3)  # (*B, H_kv, G, L, D_v)
    out = out.reshape(*B, shape.H_q, L, shape.D_v).to(out_dtype)  # (*B, H_q, L, D_v)
    if not return_weights:
        return out, None
    weights = weights.view(*laid_out, S).permute(*back, nb + 3).reshape(shape.scores)
    return out, weights.to(out_dtype)
