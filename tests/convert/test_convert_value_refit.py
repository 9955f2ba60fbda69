"""The joint ``v_proj``/``o_proj`` refit: the value solve against an explicit least-squares problem, the alternation
never raising the error, and bad input."""

from __future__ import annotations

import itertools

import pytest
import torch

from gqa.convert.value_refit import ValueGrams, _solve_values, refit_values_and_output

H, N, D, M, E, T = 4, 2, 3, 2, 5, 60  # query heads, new KV heads, head dim, old heads per group, hidden, tokens
R = M * D
GROUPS = torch.tensor([0, 0, 1, 1])


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(H, T, R, generator=g, dtype=torch.float64)
    Y = torch.randn(T, E, generator=g, dtype=torch.float64)
    grams = ValueGrams(H, R, E)
    for part in range(3):  # summed over windows
        grams.add(U[:, part * 20 : (part + 1) * 20], Y[part * 20 : (part + 1) * 20])
    return U, Y, grams


def _output(U, B, Wo):  # sum_i U_i B_g(i)^T Wo_i^T, Wo (H, E, D)
    return sum(U[i] @ B[GROUPS[i]].T @ Wo[i].T for i in range(H))


def test_grams_are_the_sums_over_windows():
    U, Y, grams = _problem()
    flat = U.transpose(0, 1).reshape(T, H * R)
    torch.testing.assert_close(grams.G, flat.T @ flat)
    torch.testing.assert_close(grams.R, torch.stack([U[i].T @ Y for i in range(H)]))


def test_value_solve_is_the_least_squares_solution():
    """With ``O`` fixed the output is linear in ``B``: build that map column by column and solve it with
    ``torch.linalg.lstsq``; the conjugate-gradient solve from the Grams must land on the same ``B``."""
    U, Y, grams = _problem()
    Wo = torch.randn(H, E, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    columns = []
    for n in range(N * D * R):
        unit = torch.zeros(N * D * R, dtype=torch.float64)
        unit[n] = 1
        columns.append(_output(U, unit.view(N, D, R), Wo).flatten())
    want = torch.linalg.lstsq(torch.stack(columns, 1), Y.flatten()[:, None]).solution.view(N, D, R)
    got = _solve_values(grams, torch.zeros(N, D, R, dtype=torch.float64), Wo, GROUPS, iterations=500)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_alternation_lowers_the_error_step_by_step():
    U, Y, grams = _problem()
    g = torch.Generator().manual_seed(2)
    B0 = torch.randn(N, D, R, generator=g, dtype=torch.float64)
    W0 = torch.randn(E, H * D, generator=g, dtype=torch.float64)

    def error(steps):
        B, W = refit_values_and_output(grams, B0, W0, GROUPS, steps, ridge=0.0)
        return float(((_output(U, B, W.view(E, H, D).transpose(0, 1)) - Y) ** 2).sum())

    errors = [error(s) for s in range(5)]
    assert all(b <= a * (1 + 1e-9) for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 0.9 * errors[0], errors  # the value steps do something the output solve alone cannot


def test_exact_start_is_kept():
    """Where ``B``, ``W`` already reproduce ``Y`` exactly, every step returns them."""
    U, _, _ = _problem()
    g = torch.Generator().manual_seed(3)
    B0 = torch.randn(N, D, R, generator=g, dtype=torch.float64)
    W0 = torch.randn(E, H * D, generator=g, dtype=torch.float64)
    Y = _output(U, B0, W0.view(E, H, D).transpose(0, 1))
    grams = ValueGrams(H, R, E)
    grams.add(U, Y)
    B, W = refit_values_and_output(grams, B0, W0, GROUPS, 3, ridge=1e-2)
    torch.testing.assert_close(B, B0)
    torch.testing.assert_close(W, W0)


@pytest.mark.parametrize(
    ("U", "Y", "message"),
    [((H, T, R + 1), (T, E), r"U \(H=4, L, r=6\)"), ((H, T, R), (T + 1, E), r"Y \(L, 5\)"), ((T, R), (T, E), "U")],
)
def test_grams_bad_input(U, Y, message):
    with pytest.raises(ValueError, match=message):
        ValueGrams(H, R, E).add(torch.zeros(U), torch.zeros(Y))


def test_refit_values_bad_input():
    _, _, grams = _problem()
    with pytest.raises(ValueError, match=r"B \(N, D, 6\).*got B \(2, 3, 5\)"):
        refit_values_and_output(grams, torch.zeros(N, D, R - 1), torch.zeros(E, H * D), GROUPS, 1, 0.0)
    with pytest.raises(ValueError, match=r"groups \(4,\)"):
        refit_values_and_output(grams, torch.zeros(N, D, R), torch.zeros(E, H * D), GROUPS[:3], 1, 0.0)
