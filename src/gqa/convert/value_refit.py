"""The joint least-squares refit of a merged layer's ``v_proj`` and ``o_proj``, given its attention weights.

After a merge, the ``o_proj`` refit (``refit.py``) fits ``o_proj`` to the source layer's output but keeps the merged
values: a subspace the value PCA chose without the attention or the refit in view. Here the values are solved too.
Merged KV head ``g`` keeps its value inside the span of its group's source value heads: ``V'_g = X W_g^T B_g^T``,
``W_g (r, E)`` the group's stacked source ``v_proj`` rows (``r = m * D``), ``B_g (D, r)``. Query head ``i`` (reading
``g(i)``) then outputs ``o_i = A_i X W_g^T B_g^T = U_i B_g^T``, with ``A_i (T, T)`` its attention weights in the
merged layer and ``U_i = A_i X W_g^T (T, r)`` the group's source values mixed by that attention. The layer output is

    y = sum_i U_i B_g(i)^T O_i^T,        O_i (E, D): query head i's o_proj columns,

bilinear in ``(B, O)``. Alternating least squares on ``||y - Y||^2`` plus ridges towards the merge's own
``W_o`` and ``B``: with ``B`` fixed, ``O`` is the ``o_proj`` refit (``solve_output``); with ``O`` fixed, ``B``
solves the normal equations

    sum_(i reads g) sum_j O_i^T O_j B_g(j) G_ji + lam B_g = sum_(i reads g) O_i^T R_i^T + lam B_g^merge

by conjugate gradients, with ``G_ij = U_i^T U_j (r, r)`` and ``R_i = U_i^T Y (r, E)``. Both steps only need these
Gram matrices (``ValueGrams``, summed over the calibration windows once per layer), so the iterations cost nothing
per token. Each step lowers the objective; where the merge is exact (copies), every step returns its input.

SmolLM2 3 -> 1 (docs/conversion.md): ``LICENSE.txt`` perplexity 26.7 with the ``o_proj`` refit alone, 20.4 with this
(19.5 with the slow-plane angle, ridge and calibration length re-tuned for it).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["VALUE_STEPS", "ValueGrams", "refit_values_and_output", "solve_output"]

# alternations; SmolLM2 3 -> 1, LICENSE ppl (before the re-tuning): 0 (o_proj refit alone) 26.7; 6 (CG to
# convergence) 20.6; 24 20.4
VALUE_STEPS = 24
_CG_STEPS = 10  # conjugate-gradient iterations per value solve, at most (warm-started from the last solve)
_CG_TOL = 1e-10  # stop when the squared residual falls below this fraction of the right-hand side's
_VALUE_RIDGE = 1e-6  # lam / (mean diag(O_i^T O_i) * mean diag(G_ii)): only keeps the value solve well posed


def solve_output(HH: Tensor, HY: Tensor, W0: Tensor, ridge: float) -> Tensor:
    """``W = argmin ||O W^T - Y||^2 + lam ||W - W0||^2`` from ``HH = O^T O (n, n)`` and ``HY = O^T Y (n, E)``, with
    ``lam = ridge * mean(diag(HH))``; solved in ``HH``'s dtype, returns ``(E, n)`` in ``W0``'s dtype."""
    HY, W = HY.to(HH.dtype), W0.to(HH.dtype)
    lam = ridge * HH.diagonal().mean()
    solved = torch.linalg.solve(
        HH + lam * torch.eye(HH.shape[0], dtype=HH.dtype, device=HH.device), HY + lam * W.T
    )  # (n, E)
    return solved.T.to(W0.dtype).contiguous()


class ValueGrams:
    """``G (H, r, H, r)``: ``G[i, :, j, :] = U_i^T U_j``; ``R (H, r, E)``: ``U_i^T Y``; summed over windows
    (float64). ``add`` takes one window's ``U (H, L, r)`` and ``Y (L, E)``."""

    def __init__(self, num_heads: int, rank: int, hidden: int, device: torch.device | str = "cpu") -> None:
        self.G = torch.zeros(num_heads * rank, num_heads * rank, dtype=torch.float64, device=device)
        self.R = torch.zeros(num_heads, rank, hidden, dtype=torch.float64, device=device)
        self.shape = (num_heads, rank)

    def add(self, U: Tensor, Y: Tensor) -> None:
        H, r = self.shape
        if U.dim() != 3 or U.shape[0] != H or U.shape[2] != r or Y.shape != (U.shape[1], self.R.shape[2]):
            raise ValueError(
                f"ValueGrams.add needs U (H={H}, L, r={r}) and Y (L, {self.R.shape[2]}); got U {tuple(U.shape)}, "
                f"Y {tuple(Y.shape)}"
            )
        flat = U.transpose(0, 1).reshape(U.shape[1], H * r)  # (L, H*r)
        self.G += (flat.T @ flat).double()
        self.R += torch.einsum("itk,te->ike", U, Y).double()

    def to(self, dtype: torch.dtype) -> ValueGrams:
        """The same sums in ``dtype`` (the solves run in the Grams' dtype)."""
        out = ValueGrams.__new__(ValueGrams)
        out.G, out.R, out.shape = self.G.to(dtype), self.R.to(dtype), self.shape
        return out


def _heads_gram(grams: ValueGrams, Bq: Tensor) -> tuple[Tensor, Tensor]:
    """``O^T O (H*D, H*D)`` and ``O^T Y (H*D, E)`` of the per-head outputs ``o_i = U_i Bq_i^T``."""
    H, r = grams.shape
    G = grams.G.view(H, r, H, r)
    HH = torch.einsum("iak,ikjl,jbl->iajb", Bq, G, Bq).flatten(0, 1).flatten(1, 2)
    return HH, torch.einsum("iak,ike->iae", Bq, grams.R).flatten(0, 1)


def _solve_values(
    grams: ValueGrams, B: Tensor, Wo: Tensor, groups: Tensor, anchor: Tensor | None = None, iterations: int = _CG_STEPS
) -> Tensor:
    """The value step (module docstring): ``B (N, D, r)`` given the ``o_proj`` blocks ``Wo (H, E, D)``, by conjugate
    gradients from ``B`` (at most ``iterations``), with the ridge pulling towards ``anchor`` (default ``B``)."""
    H, r = grams.shape
    G = grams.G.view(H, r, H, r)
    P = torch.einsum("iea,jeb->ijab", Wo, Wo)  # O_i^T O_j
    lam = _VALUE_RIDGE * P.diagonal(dim1=0, dim2=1).diagonal().mean() * G.diagonal(dim1=0, dim2=2).diagonal().mean()

    def hessian(X: Tensor) -> Tensor:  # (N, D, r) -> (N, D, r)
        per_head = torch.einsum("ijab,jbl,jlik->iak", P, X[groups], G)  # sum_j O_i^T O_j X_g(j) G_ji
        return torch.zeros_like(X).index_add_(0, groups, per_head) + lam * X

    anchor = B if anchor is None else anchor
    rhs = torch.zeros_like(B).index_add_(0, groups, torch.einsum("iea,ike->iak", Wo, grams.R)) + lam * anchor
    x = B.clone()
    res = rhs - hessian(x)
    p, rs, stop = res.clone(), (res * res).sum(), _CG_TOL * (rhs * rhs).sum()
    for _ in range(iterations):
        if rs <= stop:
            break
        Ap = hessian(p)
        alpha = rs / (p * Ap).sum()
        x, res = x + alpha * p, res - alpha * Ap
        rs_next = (res * res).sum()
        p, rs = res + rs_next / rs * p, rs_next
    return x


def refit_values_and_output(
    grams: ValueGrams,
    B: Tensor,
    W_o: Tensor,
    groups: Tensor,
    steps: int,
    ridge: float,
    dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor]:
    """Alternate the output and value solves ``steps`` times, then solve the output once more, in ``dtype`` (the
    Grams are summed in float64 either way).

    Parameters
    ----------
    grams : the layer's ``ValueGrams`` (``H`` query heads, ``r = m * D``).
    B : ``(N, D, r)`` the merged values in their groups' source bases (``V'_g = B_g W_g``).
    W_o : ``(E, H * D)`` the merged ``o_proj`` weight (the output solve's ridge anchor).
    groups : ``(H,)`` int64, the new KV head each query head reads.
    steps : value solves, ``>= 0`` (0: the ``o_proj`` refit alone).
    ridge : the output solve's ``lam / mean(diag(O^T O))``.

    Returns
    -------
    ``(B (N, D, r), W_o (E, H * D))``, in ``dtype`` and ``W_o``'s dtype.
    """
    H, r = grams.shape
    D = B.shape[1]
    if B.dim() != 3 or B.shape[2] != r or W_o.shape[1] != H * D or groups.shape != (H,):
        raise ValueError(
            f"refit_values_and_output needs B (N, D, {r}), W_o (E, {H} * D), groups ({H},); got B {tuple(B.shape)}, "
            f"W_o {tuple(W_o.shape)}, groups {tuple(groups.shape)}"
        )
    grams = grams.to(dtype)
    B0 = B = B.to(dtype)
    W = solve_output(*_heads_gram(grams, B[groups]), W_o, ridge)
    for _ in range(steps):  # the ridges pull towards the merge's own B and W_o: one objective, never raised
        B = _solve_values(grams, B, W.to(dtype).view(W.shape[0], H, D).transpose(0, 1), groups, anchor=B0)
        W = solve_output(*_heads_gram(grams, B[groups]), W_o, ridge)
    return B, W
