"""The attention call's test shapes (odd head counts, leading batch dims) and inputs and masks made from them."""

from __future__ import annotations

import torch

SHAPES = [(18, 6, 3, 7, 5), (4, 4, 5, 5, 8), (8, 1, 1, 9, 16), (6, 2, 1, 33, 8), (6, 3, 12, 12, 4), (4, 2, 6, 3, 8)]


BATCHES = [(), (2,), (2, 3)]


def make(batch, H_q, H_kv, L, S, D, dtype=torch.float32, D_v=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, H_q, L, D, generator=g).to(dtype)
    k = torch.randn(*batch, H_kv, S, D, generator=g).to(dtype)
    v = torch.randn(*batch, H_kv, S, D_v or D, generator=g).to(dtype)
    return q, k, v


def make_mask(kind, batch, H_q, L, S, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "bool":  # per batch and head, with one fully masked query row
        m = torch.rand(*batch, H_q, L, S, generator=g) > 0.4
        m[..., 0, :] = False
        return m
    if kind == "bool_2d":
        return torch.rand(L, S, generator=g) > 0.3
    if kind == "float":  # additive, with -inf entries and finite biases
        m = torch.randn(*batch, 1, L, S, generator=g)
        return m.masked_fill(torch.rand(m.shape, generator=g) > 0.7, float("-inf")).to(dtype)
    if kind == "padding":  # (B, 1, 1, S): some keys hidden per row
        keep = torch.ones(*batch, 1, 1, S, dtype=torch.bool)
        keep[..., : S // 3] = False
        return keep
    raise ValueError(kind)
