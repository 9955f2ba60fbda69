"""A logit-aware refit of ``q_proj`` after a key merge, in closed form.

The key merge (``pca.py``) fits each source key head, per RoPE plane ``j``, as a complex multiple of the merged key,
``k_(h,j) ≈ u_(h,j) k'_j``, and each query head absorbs ``conj(u)``: one factor per plane and head for every token,
chosen by query energy. What the softmax sees is the score. Written per plane as complex numbers (``q_j = q[j] +
i q[j + D/2]``), query head ``i``'s score at positions ``(p, s)`` is ``Re(q_ij(p) conj(k_hj(s)) e^(i θ_j (p - s)))``;
RoPE's factor has modulus 1, so matching the complex products ``q_ij(p) conj(k_hj(s))`` matches the scores at every
relative position. For query position ``p``, the merged query that best matches them over the keys it attends to,
weighted by the **source** attention probabilities ``a_(p,s)``, is

    q'_ij(p) = q_ij(p) · Σ_s a_(p,s) conj(k_hj(s)) k'_j(s) / Σ_s a_(p,s) |k'_j(s)|²

— the merge's ``conj(u)`` where the rank-1 key fit is exact, and a context-dependent factor where it is not. These
per-token targets are then fitted by ``q_proj`` (ridge least squares on the layer's inputs, anchored at the merge's
own rows, float64), one shared Gram matrix for every head. Only the planes the merge fits one by one are refit: the
slow planes pooled across planes (``pca.slow_planes``) keep the merge's rows.

Shapes: ``x (B, L, E)`` calibration windows; ``A (B, H_q, L, L)`` source attention probabilities.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from ..models.config import ModelConfig
from .methods import AttentionWeights, with_bias_column, with_ones_column
from .pca import slow_planes
from .value_refit import solve_output

__all__ = ["refit_queries"]


def _planes(t: Tensor) -> Tensor:
    """``(..., D)`` real -> ``(..., D / 2)`` complex: dims ``j`` and ``j + D/2`` as one number (RoPE's pairing)."""
    half = t.shape[-1] // 2
    return torch.complex(t[..., :half].double(), t[..., half:].double())


def _heads(x: Tensor, weight: Tensor, bias: Tensor | None, n: int) -> Tensor:
    """``x (B, L, E)`` projected by ``weight (n * D, E)`` (+ ``bias``): ``(B, n, L, D)`` float64, without RoPE."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.unflatten(-1, (n, -1)).transpose(1, 2)


def refit_queries(
    cfg: ModelConfig,
    source: AttentionWeights,
    merged: AttentionWeights,
    X: list[Tensor],
    attention: Callable[[Tensor], Tensor],
    ridge: float,
) -> AttentionWeights:
    """``merged`` with the rows of ``q_proj`` (and ``q_bias``) for the planes fitted one by one solved again
    (module docstring).

    Parameters
    ----------
    cfg : the source model's config (``H_q``, ``H_kv``, ``D``, RoPE).
    source, merged : the layer's weights before and after the key merge.
    X : calibration windows ``(B, L, E)``, the layer's attention inputs.
    attention : ``x -> A (B, H_q, L, L)``, the source layer's attention probabilities on ``x``.
    ridge : ``lam / mean(diag(X^T X))`` of the ridge towards the merge's rows.
    """
    H, D = cfg.num_heads, cfg.head_dim
    n_src, n_new = source.k.shape[0] // D, merged.k.shape[0] // D
    src_of = torch.arange(H) // (H // n_src)  # the source KV head each query head read
    new_of = torch.arange(H) // (H // n_new)  # the merged KV head it reads now
    gram = rhs = None
    for x in X:
        A = attention(x).double()  # (B, H, L, L)
        q = _planes(_heads(x, source.q, source.q_bias, H))  # (B, H, L, D/2)
        k = _planes(_heads(x, source.k, source.k_bias, n_src))[:, src_of]
        k_new = _planes(_heads(x, merged.k, merged.k_bias, n_new))[:, new_of]
        cross = k.conj() * k_new  # (B, H, L, D/2)
        num = torch.complex(A @ cross.real, A @ cross.imag)
        factor = num / (A @ k_new.abs().square()).clamp_min(1e-30)
        target = q * factor  # (B, H, L, D/2) complex
        target = torch.cat([target.real, target.imag], -1).transpose(1, 2).flatten(2)  # (B, L, H * D)
        x1 = with_ones_column(x).flatten(0, 1)  # (B * L, E + 1)
        g, r = x1.T @ x1, x1.T @ target.flatten(0, 1)
        gram, rhs = (g, r) if gram is None else (gram + g, rhs + r)
    start = with_bias_column(merged.q, merged.q_bias)  # (H * D, E + 1)
    solved = solve_output(gram, rhs, start, ridge)  # (H * D, E + 1)
    fast = torch.ones(D // 2, dtype=torch.bool)
    fast[slow_planes(cfg)] = False
    rows = torch.cat([fast, fast]).repeat(H)  # (H * D,): the rows of the planes fitted one by one
    q = torch.where(rows[:, None].to(start.device), solved, start).to(merged.q.dtype)
    q_bias = q[:, -1].contiguous() if merged.q_bias is not None else None
    return dataclasses.replace(merged, q=q[:, :-1].contiguous(), q_bias=q_bias)
