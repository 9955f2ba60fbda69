"""Independent float64 oracle for the tests: explicit per-head K/V repetition, explicit index comparisons.

It shares no code with ``gqa``: it repeats K/V with ``repeat_interleave`` (fine in a test) and writes the
bottom-right causal rule as ``j <= i + S - L`` from index grids.
"""

from __future__ import annotations

import torch

TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


def bottom_right_allowed(L: int, S: int) -> torch.Tensor:
    i = torch.arange(L)[:, None]
    j = torch.arange(S)[None, :]
    return j <= i + (S - L)


def attention64(q, k, v, mask=None, is_causal=False, scale=None):
    """float64 attention on ``(*B, H_q, L, D)`` queries and ``(*B, H_kv, S, D)`` keys; returns ``(out, weights)``."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[-3] // k.shape[-3]
    k = k.repeat_interleave(G, dim=-3)
    v = v.repeat_interleave(G, dim=-3)
    L, S = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    allowed = torch.ones(scores.shape, dtype=torch.bool)
    if mask is not None:
        if mask.dtype == torch.bool:
            allowed = allowed & mask
        else:
            scores = scores + mask.double()
    if is_causal:
        allowed = allowed & bottom_right_allowed(L, S)
    scores = scores.masked_fill(~allowed, float("-inf"))
    visible = (scores != float("-inf")).any(-1, keepdim=True)  # a row with any key not masked out (NaN counts)
    weights = torch.where(visible, torch.softmax(scores.masked_fill(~visible, 0.0), -1), torch.zeros(()).double())
    return weights @ v, weights
