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

Slow planes are pooled across planes. A plane that turns less than ``SLOW_PLANE_ANGLE`` radians over
``SLOW_PLANE_SPAN`` positions (``inv_freq_j * (span - 1) < angle``; SmolLM2, theta 1e5, D 64: planes 18-31 of 32) is
nearly position-free there, and a rank-1 fit per plane wastes it: when several old heads use the same slow plane,
all but one lose it while other slow planes of the merged head stay unused. So the ``n`` slow dimensions of the
merged key are fitted jointly, like the values, by a PCA of the group's slow key dimensions ``Z = [K_1 C_1^{1/2} ...
K_m C_m^{1/2}] (T, m*n)`` in the metric of the queries that read them (``C_h = sum_{i reads h} E[q_i q_i^T]`` over the
slow dimensions, so the mean squared score error ``E[(q_i . (k_h - U_h k'))^2]`` is what the PCA minimises, queries
taken independent of keys): with the top-``n`` eigenvectors ``P`` of ``Z^T Z``, ``k' = sum_h P_h^T C_h^{1/2} k_h`` and
``k_h ≈ U_h k'``, ``U_h = C_h^{-1/2} P_h``, absorbed as ``q_i <- U_h^T q_i`` on those dimensions. ``U_h`` mixes slow
planes, so it commutes with RoPE only approximately — up to the angle between the planes' rotations, small inside the
span; the refit (``refit.py``) then sees the real rotations. A group is pooled only where this lowers the score
error of the per-plane fit, so where that is exact (copies) the RoPE-exact answer is kept. SmolLM2 3 -> 1 with the
``o_proj`` refit (docs/conversion.md): ``LICENSE.txt`` perplexity 48.0 -> 26.7 at window 512, 50.8 -> 38.1 at 2048.

Biases (Qwen2) ride along: ``X`` gets a column of ones and each weight its bias as an extra column.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attention.rope import RoPE
from ..models.config import ModelConfig
from .methods import AttentionWeights, register_method, with_bias_column, with_ones_column

# radians. SmolLM2 3 -> 1 (docs/bench/conversion-history.md), LICENSE ppl with the o_proj refit: 48.0 with no plane
# pooled, 31.6 with 8, 26.7 with 12 (0.5 rad), 27.9 with 16; with the v_proj/o_proj refit: 20.39 with 12, 19.84 with
# 14 (this angle, 1.0 rad), 20.13 with 15 (1.5 rad, more calibration text), 21.13 with 16 (2.0 rad)
SLOW_PLANE_ANGLE = 1.0
SLOW_PLANE_SPAN = 512  # positions: the calibration and evaluation window


def slow_planes(cfg: ModelConfig, angle: float = SLOW_PLANE_ANGLE, span: int = SLOW_PLANE_SPAN) -> Tensor:
    """The RoPE planes of ``cfg`` (indices in ``[0, head_dim / 2)``) that turn less than ``angle`` radians over
    ``span`` consecutive positions, with the model's RoPE scaling; ``(n_slow,)`` int64, ascending."""
    rope = RoPE(cfg.head_dim, theta=cfg.rope_theta, scaling=cfg.rope_scaling, max_position=1)
    turn = rope.inv_freq.double() * rope.position_scale * (span - 1)  # (head_dim / 2,)
    return torch.nonzero(turn < angle).flatten()


def _sqrt_and_inv_sqrt(S: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric ``S^{1/2}`` and ``S^{-1/2}`` of a PSD ``(D, D)`` matrix (tiny eigenvalues floored)."""
    evals, U = torch.linalg.eigh(S)
    evals = evals.clamp_min(evals.max() * 1e-10)
    return U @ torch.diag(evals.sqrt()) @ U.T, U @ torch.diag(evals.rsqrt()) @ U.T


def _merge_in_metric(X: Tensor, W: list[Tensor], S: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """PCA merge of ``m`` projections ``W_h (n, E')`` into one, each weighted by its metric ``S_h (n, n)`` (PSD).

    Returns ``(W' (n, E'), [U_h (n, n)])`` with ``W_h x ≈ U_h W' x``, minimising the summed ``||W_h x - U_h W' x||^2``
    in the metrics ``S_h`` over the rows ``x`` of ``X (T, E')``: ``W' = sum_h P_h^T S_h^{1/2} W_h``, ``U_h = S_h^{-1/2}
    P_h``, ``P (m*n, n)`` the top eigenvectors of ``Z^T Z``, ``Z = [X W_1^T S_1^{1/2} ...]``.
    """
    n = W[0].shape[0]
    S_half, S_inv_half = zip(*(_sqrt_and_inv_sqrt(s) for s in S), strict=True)
    Z = torch.cat([(X @ w.T) @ s for w, s in zip(W, S_half, strict=True)], dim=1)  # (T, m*n)
    P = torch.linalg.eigh(Z.T @ Z).eigenvectors[:, -n:]  # (m*n, n): top-n principal directions
    blocks = P.split(n, dim=0)  # P_h (n, n)
    merged = sum(p.T @ s @ w for p, s, w in zip(blocks, S_half, W, strict=True))  # (n, E')
    return merged, [si @ p for si, p in zip(S_inv_half, blocks, strict=True)]


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
    merged, U = _merge_in_metric(X, V, [sum(o.T @ o for o in os_) for os_ in outs])
    return merged, [[o @ u for o in os_] for os_, u in zip(outs, U, strict=True)]


def second_moment(X: Tensor) -> Tensor:
    """``E[x x^T] (E', E')`` over the rows of ``X (T, E')``: ``E[(x . a)(x . b)] = a M b^T`` without a ``(T, n)``
    product per weight."""
    return X.T @ X / X.shape[0]


def merge_keys(
    X: Tensor, K: list[Tensor], Q: list[list[Tensor]], slow: Tensor | None = None
) -> tuple[Tensor, list[list[Tensor]]]:
    """Merge ``m`` key heads into one with RoPE-commuting per-plane complex factors (HF half-rotation layout), the
    ``slow`` planes pooled across planes where that fits their scores better (module docstring).

    Parameters
    ----------
    X : ``(T, E')`` calibration inputs (ones column for biases).
    K : ``m`` key weights ``(D, E')``; rows ``j`` and ``j + D/2`` form frequency plane ``j``.
    Q : per old head, the ``q_proj`` row blocks ``(D, E')`` of the query heads that read it.
    slow : ``(n_slow,)`` plane indices in ``[0, D/2)`` to pool (``slow_planes``); ``None``: none.

    Returns
    -------
    ``(K' (D, E'), Q')`` with ``Q'`` shaped like ``Q``.
    """
    M = second_moment(X)
    merged, new_Q = _merge_keys_per_plane(X, K, Q, M)
    if slow is None or len(slow) == 0:
        return merged, new_Q
    half = K[0].shape[0] // 2
    rows = torch.cat([slow, slow + half])  # both coordinates of each slow plane
    C = [sum(q[rows] @ M @ q[rows].T for q in qs) for qs in Q]  # E[q q^T] per old head
    pooled, U = _merge_in_metric(X, [k[rows] for k in K], C)
    pooled_Q = [[u.T @ q[rows] for q in qs] for qs, u in zip(Q, U, strict=True)]
    # pool only where it fits the slow scores better: never where the per-plane fit is already exact (copies), so
    # that an exact, RoPE-commuting answer is kept

    def energy(L: Tensor, R: Tensor) -> Tensor:  # E[(x^T A y)^2] = tr(A^T M A M) for A = L^T R, x and y independent
        return ((L @ M @ L.T) * (R @ M @ R.T)).sum()  # tokens; = tr(L M L^T R M R^T): (rows, rows), not (E', E')

    def score_error(k_new: Tensor, q_new: list[list[Tensor]]) -> Tensor:  # E[(q_i(x).k_h(y) - q'_i(x).k'(y))^2]
        return sum(
            energy(torch.cat([q[rows], -qn]), torch.cat([k[rows], k_new]))  # A = q^T k - qn^T k_new
            for k, qs, qns in zip(K, Q, q_new, strict=True) for q, qn in zip(qs, qns, strict=True)
        )  # fmt: skip

    per_plane = score_error(merged[rows], [[q[rows] for q in qs] for qs in new_Q])
    scale = sum(energy(q[rows], k[rows]) for k, qs in zip(K, Q, strict=True) for q in qs)
    if per_plane - score_error(pooled, pooled_Q) <= 1e-9 * scale:
        return merged, new_Q
    merged[rows] = pooled
    for new_qs, pqs in zip(new_Q, pooled_Q, strict=True):
        for new_q, pq in zip(new_qs, pqs, strict=True):
            new_q[rows] = pq
    return merged, new_Q


def _merge_keys_per_plane(
    X: Tensor, K: list[Tensor], Q: list[list[Tensor]], M: Tensor
) -> tuple[Tensor, list[list[Tensor]]]:
    """``merge_keys`` without pooling: a rank-1 complex fit per plane (``M``: ``second_moment(X)``)."""
    D = K[0].shape[0]
    half = D // 2
    keys = torch.stack([torch.complex(X @ k[:half].T, X @ k[half:].T) for k in K])  # (m, T, half)
    energy = torch.stack([sum(((q @ M) * q).sum(-1).view(2, half).sum(0) for q in qs) for qs in Q]).clamp_min(
        1e-12
    )  # (m, half): query energy E[(x . q_row)^2] per old head and plane
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
    X = with_ones_column(activations)  # (T, E + 1): biases as a last column
    slow = slow_planes(cfg)  # RoPE planes whose key dims are pooled across planes

    q, k, v = (with_bias_column(t, b) for t, b in ((w.q, w.q_bias), (w.k, w.k_bias), (w.v, w.v_bias)))
    o = w.o.double()
    q_new, o_new, k_new, v_new = q.clone(), o.clone(), [], []
    for g in range(num_kv_heads):
        old = range(g * m, (g + 1) * m)
        readers = [range(h * G, (h + 1) * G) for h in old]  # query heads reading each old KV head
        K = [k[h * D : (h + 1) * D] for h in old]
        V = [v[h * D : (h + 1) * D] for h in old]
        Q = [[q[i * D : (i + 1) * D] for i in r] for r in readers]
        outs = [[o[:, i * D : (i + 1) * D] for i in r] for r in readers]
        merged_k, Q2 = merge_keys(X, K, Q, slow)
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
