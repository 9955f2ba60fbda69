"""The logit-aware ``q_proj`` refit (``gqa.convert.query_refit``): exact merges stay exact, and on a real merge the
attention-weighted score error falls on windows the refit never saw; only the one-by-one planes' rows change."""

from __future__ import annotations

import pytest
import torch
from helpers.checkpoints import tiny_refit_model

from gqa.convert import convert_state
from gqa.convert.methods import convert_layer, layer_weights
from gqa.convert.pca import slow_planes
from gqa.convert.query_refit import refit_queries
from gqa.models import CausalLM


def _layer0(cfg, state, ids):
    """Layer 0's attention inputs for ``ids (B, L)``, its module and RoPE tables."""
    model = CausalLM.from_state(cfg, state)
    layer = model.model.layers[0]
    x = layer.input_layernorm(model.model.embed_tokens(ids))
    cos_sin = model.model.rope.cos_sin(torch.arange(ids.shape[1]))

    def probabilities(inputs):
        return layer.self_attn(inputs, is_causal=True, rope_cos_sin=cos_sin, need_weights=True)[1]

    return x, layer, cos_sin, probabilities


def _scores(x, w, n_kv, cfg, cos_sin):
    """``(B, H, L, L)`` float64 attention scores of weights ``w`` on ``x``, computed by hand (RoPE half rotation)."""
    H, D = cfg.num_heads, cfg.head_dim

    def heads(weight, bias, n):
        out = x.double() @ weight.double().T + (0 if bias is None else bias.double())
        out = out.unflatten(-1, (n, D)).transpose(1, 2)  # (B, n, L, D)
        cos, sin = (t.double() for t in cos_sin)
        half = D // 2
        rotated = torch.cat([-out[..., half:], out[..., :half]], -1)
        return out * cos + rotated * sin

    q, k = heads(w.q, w.q_bias, H), heads(w.k, w.k_bias, n_kv)
    return q @ k[:, torch.arange(H) // (H // n_kv)].transpose(-1, -2) / D**0.5


@pytest.mark.parametrize("bias", [False, True])
def test_an_exact_merge_stays_exact(bias):
    """1 KV head expanded to 3 copies and merged back with pca: the merge is exact and so is the refit's target, so
    the refit returns the merge's rows (to float rounding)."""
    cfg1, state1 = tiny_refit_model(bias, 1)
    cfg3, state3 = convert_state(cfg1, state1, 3)
    ids = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x, _, _, probabilities = _layer0(cfg3, state3, ids)
        w = layer_weights(state3, 0)
        merged = convert_layer(w, cfg3, 1, "pca", x.flatten(0, 1))
        refit = refit_queries(cfg3, w, merged, [x], probabilities, ridge=1e-6)
    torch.testing.assert_close(refit.q, merged.q, atol=2e-4, rtol=1e-4)
    if bias:
        torch.testing.assert_close(refit.q_bias, merged.q_bias, atol=2e-4, rtol=1e-4)


def test_a_real_merge_scores_closer_on_held_out_windows():
    """3 -> 1 KV heads: the source-attention-weighted squared score error on other windows falls, and only the rows
    of the planes merged one by one move."""
    cfg, state = tiny_refit_model(True, 3)
    g = torch.Generator().manual_seed(1)
    calib, held = torch.randint(0, 64, (8, 48), generator=g), torch.randint(0, 64, (4, 48), generator=g)
    with torch.no_grad():
        x, _, cos_sin, probabilities = _layer0(cfg, state, calib)
        w = layer_weights(state, 0)
        merged = convert_layer(w, cfg, 1, "pca", x.flatten(0, 1))
        refit = refit_queries(cfg, w, merged, [x[:4], x[4:]], probabilities, ridge=1e-3)  # two batches
        xh, _, cos_sin, probabilities = _layer0(cfg, state, held)
        A = probabilities(xh).double()
        want = _scores(xh, w, 3, cfg, cos_sin)

        def error(weights):
            return float((A * (_scores(xh, weights, 1, cfg, cos_sin) - want).square()).sum())

        assert error(refit) < 0.99 * error(merged), (error(refit), error(merged))  # ~3% lower here
    D = cfg.head_dim
    slow = slow_planes(cfg)
    moved = (refit.q != merged.q).any(-1).view(cfg.num_heads, D)
    assert moved[:, [p for p in range(D // 2) if p not in slow.tolist()]].all()
    assert not moved[:, torch.cat([slow, slow + D // 2])].any()
