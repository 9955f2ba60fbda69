"""The calibrated ``pca`` merge: exact where an exact answer exists, and far better than mean-pooling on SmolLM2."""

from __future__ import annotations

import math

import pytest
import torch

from gqa.convert import _calibration_activations, convert_state
from gqa.convert import pca as pca_module
from gqa.convert.pca import SLOW_PLANE_ANGLE, SLOW_PLANE_SPAN, merge_keys, merge_values, slow_planes
from gqa.models import CausalLM, ModelConfig


def _model(cfg: ModelConfig, state: dict) -> CausalLM:
    return CausalLM.from_state(cfg, state)


def _activations(model: CausalLM, ids: torch.Tensor) -> list[torch.Tensor]:
    acts = []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda _m, a: acts.append(a[0].flatten(0, 1)))
             for layer in model.model.layers]  # fmt: skip
    with torch.inference_mode():
        model(ids)
    for h in hooks:
        h.remove()
    return acts


@pytest.mark.parametrize("theta", [1e3, 1e8])  # 1e3: no slow plane; 1e8: planes 2 and 3 of 4 are slow and pooled
@pytest.mark.parametrize("bias", [False, True])
def test_merging_copies_of_one_head_is_exact(bias, theta):
    """1 KV head expanded to 3 identical heads, then merged back with pca: the same function as before."""
    torch.manual_seed(0)
    cfg1 = ModelConfig(arch="qwen2" if bias else "llama", vocab_size=64, hidden_size=48, intermediate_size=64,
                       num_layers=2, num_heads=6, num_kv_heads=1, head_dim=8, max_position_embeddings=64,
                       attention_bias=bias, tie_word_embeddings=not bias, rope_theta=theta)  # fmt: skip
    assert slow_planes(cfg1).tolist() == ([] if theta == 1e3 else [2, 3])
    base = CausalLM(cfg1).eval()
    for p in base.parameters():  # biases start at zero; make them matter
        torch.nn.init.normal_(p, std=0.3)
    state = {k: v for k, v in base.state_dict().items() if not (cfg1.tie_word_embeddings and k == "lm_head.weight")}
    cfg3, state3 = convert_state(cfg1, state, 3)  # exact expansion
    ids = torch.randint(0, 64, (1, 40))
    acts = _activations(_model(cfg3, state3), ids)
    cfg_back, state_back = convert_state(cfg3, state3, 1, "pca", acts)
    with torch.inference_mode():
        torch.testing.assert_close(_model(cfg_back, state_back)(ids), base(ids), atol=1e-4, rtol=1e-4)


def test_single_head_groups_are_identity_maps():
    """m = 1 (nothing to merge): the key and value maps must reproduce scores and outputs exactly."""
    torch.manual_seed(1)
    X = torch.randn(50, 12, dtype=torch.float64)
    k, v = torch.randn(8, 12, dtype=torch.float64), torch.randn(8, 12, dtype=torch.float64)
    qs = [torch.randn(8, 12, dtype=torch.float64) for _ in range(2)]
    os_ = [torch.randn(10, 8, dtype=torch.float64) for _ in range(2)]
    k2, (q2,) = merge_keys(X, [k], [qs])
    v2, (o2,) = merge_values(X, [v], [os_])
    for q, q_new in zip(qs, q2, strict=True):  # q . k is preserved (RoPE at position 0: a plain dot product)
        torch.testing.assert_close((X @ q_new.T) @ (X @ k2.T).T, (X @ q.T) @ (X @ k.T).T)
    for o, o_new in zip(os_, o2, strict=True):
        torch.testing.assert_close((X @ v2.T) @ o_new.T, (X @ v.T) @ o.T)


def test_key_merge_commutes_with_rope():
    """Scores after RoPE at arbitrary positions are preserved when the heads are complex multiples of one key."""
    import gqa

    torch.manual_seed(2)
    D, E, T = 8, 12, 30
    X = torch.randn(T, E, dtype=torch.float64)
    base = torch.randn(D, E, dtype=torch.float64)
    rot = torch.tensor([0.3, -1.2, 2.0, 0.7])  # per-plane angle and scale: key head 1 = a scaled rotation of head 0
    scale = torch.tensor([1.5, 0.5, 2.0, 1.0], dtype=torch.float64)
    c, s = (scale * rot.double().cos())[:, None], (scale * rot.double().sin())[:, None]
    other = torch.cat([c * base[:4] - s * base[4:], s * base[:4] + c * base[4:]])
    q0, q1 = torch.randn(D, E, dtype=torch.float64), torch.randn(D, E, dtype=torch.float64)
    k_new, (q0n,), (q1n,) = (lambda r: (r[0], *r[1]))(merge_keys(X, [base, other], [[q0], [q1]]))
    rope = gqa.RoPE(D, theta=100.0)
    pos = torch.arange(T)
    cos, sin = rope.cos_sin(pos)

    def scores(q, k):
        qr = rope.rotate((X @ q.T).float()[None], cos, sin)[0]
        kr = rope.rotate((X @ k.T).float()[None], cos, sin)[0]
        return qr @ kr.T

    torch.testing.assert_close(scores(q0n, k_new), scores(q0, base), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(scores(q1n, k_new), scores(q1, other), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    ("theta", "scaling"), [(1e5, None), (1e4, None), (1e4, {"rope_type": "linear", "factor": 8.0})]
)
def test_slow_planes_turn_less_than_the_angle_over_the_span(theta, scaling):
    cfg = ModelConfig(head_dim=64, rope_theta=theta, rope_scaling=scaling)
    factor = 1.0 if scaling is None else scaling["factor"]
    expected = [j for j in range(32) if theta ** (-2 * j / 64) / factor * (SLOW_PLANE_SPAN - 1) < SLOW_PLANE_ANGLE]
    assert slow_planes(cfg).tolist() == expected
    assert expected[-1] == 31 and len(expected) < 32
    if theta == 1e5 and scaling is None:  # SmolLM2
        assert expected == list(range(18, 32))


def test_slow_planes_are_pooled_across_planes():
    """Two key heads put different content in the same slow plane (2) and nothing in the other (3): one complex
    factor per plane cannot keep both, pooling the slow planes can (plain dot products, i.e. position 0)."""
    torch.manual_seed(3)
    D, E, T = 8, 12, 60
    X = torch.randn(T, E, dtype=torch.float64)
    a, b = torch.randn(D, E, dtype=torch.float64), torch.randn(D, E, dtype=torch.float64)
    b[[0, 1, 4, 5]] = a[[0, 1, 4, 5]]  # fast planes 0 and 1 shared
    a[[3, 7]], b[[3, 7]] = 0, 0  # slow plane 3 unused
    qa, qb = torch.randn(D, E, dtype=torch.float64), torch.randn(D, E, dtype=torch.float64)

    def error(slow):
        k_new, (qa_new,), (qb_new,) = (lambda r: (r[0], *r[1]))(merge_keys(X, [a, b], [[qa], [qb]], slow))
        return max(((X @ q_new.T) @ (X @ k_new.T).T - (X @ q.T) @ (X @ k.T).T).abs().max().item()
                   for q, q_new, k in ((qa, qa_new, a), (qb, qb_new, b)))  # fmt: skip

    assert error(torch.tensor([2, 3])) < 1e-8
    assert error(None) > 1.0


def test_pca_beats_mean_on_smollm2(monkeypatch):
    from gqa.loaders import load_tokenizer, read_model

    cfg, state = read_model(None)
    tok = load_tokenizer(None)
    text = "Grouped-query attention shares key and value heads between groups of query heads. " * 3
    calib = "The quick brown fox jumps over the lazy dog. " + (__doc__ or "") + " " + merge_keys.__doc__
    acts = _calibration_activations(cfg, state, tok, calib)
    ids = torch.tensor([tok.encode(text)])

    def ppl(method: str) -> float:
        c, s = convert_state(cfg, state, 1, method, acts)
        with torch.inference_mode():
            logits = _model(c, s)(ids[:, :-1])
        return math.exp(torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]).item())

    pca, mean = ppl("pca"), ppl("mean")
    assert pca < mean / 5, f"pca {pca:.1f} vs mean {mean:.1f}"
    monkeypatch.setattr(pca_module, "slow_planes", lambda cfg: torch.empty(0, dtype=torch.long))
    per_plane = ppl("pca")  # keys fitted one plane at a time only
    assert pca < per_plane, f"pca {pca:.1f} vs pca without pooled slow planes {per_plane:.1f}"


def test_pca_needs_calibration():
    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=4, max_position_embeddings=16)  # fmt: skip
    state = {k: v for k, v in CausalLM(cfg).state_dict().items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="needs calibration activations"):
        convert_state(cfg, state, 1, "pca", None)
