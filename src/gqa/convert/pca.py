"""The ``pca`` merge: fewer KV heads without training, calibrated on the activations of a short text.

For each new KV head, the ``m`` old heads of its group are merged so that what the attention *reads* changes least:

Values (no RoPE): the group's value outputs ``Y = [X W_v1^T ... X W_vm^T] (T, m*D)`` are compressed to ``D`` dims by a
PCA in the metric of ``o_proj``: head ``h``'s block is weighted by ``S_h^{1/2}``, with ``S_h = sum_{i uses h} W_o,i^T
W_o,i``, so directions that ``o_proj`` amplifies count more. With the top-``D`` eigenvectors ``P`` of ``Z^T Z`` (``Z``
= weighted ``Y``), the shared value is ``V' = sum_h Z_h P_h`` and head ``h`` is rebuilt as ``V_h ≈ V' P_h^T
S_h^{-1/2}``; that ``(D, D)`` map is absorbed into the ``o_proj`` columns of each query head ``i`` that used ``h``:
``W_o,i <- W_o,i S_h^{-1/2} P_h``.

Keys (RoPE): only transforms that commute with RoPE may be used, i.e. per frequency plane ``j`` a scaled 2x2 rotation —
a complex number. Writing plane ``j`` of key head ``h`` as ``k_hj = a_hj + i b_hj``, the merged key is
``k'_j = sum_h c_hj k_hj`` with ``k_hj ≈ u_hj k'_j``: a rank-1 complex fit per plane across the group's heads, computed
as the top eigenvector ``v_j`` of the ``(m, m)`` Hermitian covariance of ``sqrt(w_hj) k_hj`` over the calibration
tokens, where ``w_hj`` is the mean energy of the queries that read head ``h`` on plane ``j``. Then ``c_hj =
conj(v_hj) sqrt(w_hj)``, ``u_hj = v_hj / sqrt(w_hj)``, and since ``Re(q conj(u k')) = Re((q conj(u)) conj(k'))``, each
query head multiplies its plane ``j`` by ``conj(u_hj)``, absorbed into the rows of ``q_proj``. Rotations commute with
RoPE's, so the merged model is exact wherever the fit is.

Biases (Qwen2) ride along: ``X`` gets a column of ones and each weight its bias as an extra column.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..models.config import ModelConfig
from .methods import AttentionWeights, register_method


def _sqrt_and_inv_sqrt(S: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric ``S^{1/2}`` and ``S^{-1/2}`` of a PSD ``(D, D)`` matrix (tiny eigenvalues floored)."""
    evals, U = torch.linalg.eigh(S)
    evals = evals.clamp_min(evals.max() * 1e-10)
    return U @ torch.diag(evals.sqrt()) @ U.T, U @ torch.diag(evals.rsqrt()) @ U.T


def merge_values(X: Tensor, V: list[Tensor], outs: list[list[Tensor]]) -> tuple[Tensor, list[list[Tensor]]]:
    """Merge ``m`` value heads into one.

    Parameters
    ----------
    X : ``(T, E')`` calibration inputs of the layer (with a ones column when weights carry a bias).
    V : ``m`` value weights ``(D, E')``.
    outs : per old head, the ``o_proj`` column blocks ``(E_out, D)`` of the query heads that read it.

    Returns
    -------
    ``(V' (D, E'), outs')`` with ``outs'`` shaped like ``outs``.
    """
    D = V[0].shape[0]
    S_half, S_inv_half = zip(*(_sqrt_and_inv_sqrt(sum(o.T @ o for o in os_)) for os_ in outs), strict=True)
    Z = torch.cat([(X @ v.T) @ s for v, s in zip(V, S_half, strict=True)], dim=1)  # (T, m*D)
    P = torch.linalg.eigh(Z.T @ Z).eigenvectors[:, -D:]  # (m*D, D): top-D principal directions
    blocks = P.split(D, dim=0)  # P_h (D, D)
    merged = sum(p.T @ s @ v for p, s, v in zip(blocks, S_half, V, strict=True))  # (D, E')
    new_outs = [[o @ si @ p for o in os_] for os_, si, p in zip(outs, S_inv_half, blocks, strict=True)]
    return merged, new_outs


def merge_keys(X: Tensor, K: list[Tensor], Q: list[list[Tensor]]) -> tuple[Tensor, list[list[Tensor]]]:
    """Merge ``m`` key heads into one with RoPE-commuting per-plane complex factors (HF half-rotation layout).

    Parameters
    ----------
    X : ``(T, E')`` calibration inputs (ones column for biases).
    K : ``m`` key weights ``(D, E')``; rows ``j`` and ``j + D/2`` form frequency plane ``j``.
    Q : per old head, the ``q_proj`` row blocks ``(D, E')`` of the query heads that read it.

    Returns
    -------
    ``(K' (D, E'), Q')`` with ``Q'`` shaped like ``Q``.
    """
    D = K[0].shape[0]
    half = D // 2
    keys = torch.stack([torch.complex(X @ k[:half].T, X @ k[half:].T) for k in K])  # (m, T, half)
    energy = torch.stack([sum(((X @ q.T) ** 2).mean(0).view(2, half).sum(0) for q in qs) for qs in Q]).clamp_min(
        1e-12
    )  # (m, half): query energy per old head and plane
    weighted = keys * energy.sqrt()[:, None, :]
    cov = torch.einsum("atj,btj->jab", weighted, weighted.conj())  # (half, m, m) Hermitian
    v = torch.linalg.eigh(cov).eigenvectors[:, :, -1].T  # (m, half): top eigenvector per plane
    c = v.conj() * energy.sqrt()  # k'_j = sum_h c_hj k_hj
    u = v / energy.sqrt()  # k_hj ≈ u_hj k'_j

    merged = torch.zeros_like(K[0])
    for h, k in enumerate(K):
        a, b = k[:half], k[half:]
        merged[:half] += c[h].real[:, None] * a - c[h].imag[:, None] * b
        merged[half:] += c[h].imag[:, None] * a + c[h].real[:, None] * b
    new_Q = []
    for h, qs in enumerate(Q):
        ur, ui = u[h].real[:, None], u[h].imag[:, None]
        new_Q.append([torch.cat([ur * q[:half] + ui * q[half:], ur * q[half:] - ui * q[:half]]) for q in qs])
    return merged, new_Q


@register_method("pca")
def pca_merge(w: AttentionWeights, cfg: ModelConfig, num_kv_heads: int, activations: Tensor | None) -> AttentionWeights:
    """The ``pca`` method (module docstring): calibrated, RoPE-commuting key merge and ``o_proj``-weighted value PCA."""
    if activations is None:
        raise ValueError("method 'pca' needs calibration activations: pass calibration_text (or use 'mean'/'first')")
    H_q, H_kv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G, m = H_q // H_kv, H_kv // num_kv_heads  # query heads per old KV head; old KV heads per new one
    X = activations.double()
    X = torch.cat([X, torch.ones(X.shape[0], 1, dtype=X.dtype)], 1)  # (T, E + 1): biases as a last column

    def aug(weight: Tensor, bias: Tensor | None) -> Tensor:  # (rows, E) -> (rows, E + 1)
        b = torch.zeros(weight.shape[0], dtype=weight.dtype) if bias is None else bias
        return torch.cat([weight, b[:, None]], 1).double()

    q, k, v, o = aug(w.q, w.q_bias), aug(w.k, w.k_bias), aug(w.v, w.v_bias), w.o.double()
    q_new, o_new, k_new, v_new = q.clone(), o.clone(), [], []
    for g in range(num_kv_heads):
        old = range(g * m, (g + 1) * m)
        readers = [range(h * G, (h + 1) * G) for h in old]  # query heads reading each old KV head
        K = [k[h * D : (h + 1) * D] for h in old]
        V = [v[h * D : (h + 1) * D] for h in old]
        Q = [[q[i * D : (i + 1) * D] for i in r] for r in readers]
        outs = [[o[:, i * D : (i + 1) * D] for i in r] for r in readers]
        merged_k, Q2 = merge_keys(X, K, Q)
        merged_v, O2 = merge_values(X, V, outs)
        k_new.append(merged_k)
        v_new.append(merged_v)
        for r, qs, os_ in zip(readers, Q2, O2, strict=True):
            for i, qi, oi in zip(r, qs, os_, strict=True):
                q_new[i * D : (i + 1) * D] = qi
                o_new[:, i * D : (i + 1) * D] = oi
    k_all, v_all = torch.cat(k_new), torch.cat(v_new)
    dt = w.q.dtype

    def split(t: Tensor, had_bias: bool) -> tuple[Tensor, Tensor | None]:
        return t[:, :-1].to(dt).contiguous(), (t[:, -1].to(dt).contiguous() if had_bias else None)

    (q_w, q_b), (k_w, k_b), (v_w, v_b) = (split(t, b is not None) for t, b in
                                          ((q_new, w.q_bias), (k_all, w.k_bias), (v_all, w.v_bias)))  # fmt: skip
    return AttentionWeights(q=q_w, k=k_w, v=v_w, o=o_new.to(dt).contiguous(), q_bias=q_b, k_bias=k_b, v_bias=v_b)
