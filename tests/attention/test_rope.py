"""gqa.RoPE against independent references: HF transformers' RoPE init functions and ``apply_rotary_pos_emb``
(Llama half rotation, GPT-NeoX partial rotary) and a float64 complex-number rotation written here from the definition.
"""

from __future__ import annotations

import math

import pytest
import torch

import gqa

pytest.importorskip("transformers")

from transformers import GPTNeoXConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding
from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

LLAMA3_SMALL = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LLAMA32 = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


# ----------------------------------------------------------------------------------------------- references / helpers


def llama_config(head_dim: int, theta: float, scaling: dict | None = None, max_pos: int = 16384) -> LlamaConfig:
    rope_parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": theta}
    return LlamaConfig(
        hidden_size=2 * head_dim,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=head_dim,
        intermediate_size=8,
        num_hidden_layers=1,
        vocab_size=16,
        max_position_embeddings=max_pos,
        rope_parameters=rope_parameters,
    )


def hf_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    config = llama_config(head_dim, theta, scaling)
    if scaling is None:
        inv_freq, attention_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config)
    assert attention_factor == 1.0
    return inv_freq


def complex_rope_ref(
    x: torch.Tensor,
    positions: torch.Tensor,
    theta: float,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    inv_freq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotate ``x (*B, H, L, D)`` in float64 with complex numbers: pair ``k`` becomes ``z_k * exp(i * p * f_k)``.

    ``positions`` ``(L,)`` or ``(B, L)``, may be fractional. Pairs are ``(2k, 2k+1)`` when interleaved, else
    ``(k, k + rotary_dim/2)``. Features past ``rotary_dim`` pass through.
    """
    D = x.shape[-1]
    rd = D if rotary_dim is None else rotary_dim
    x64 = x.double()
    rot, rest = x64[..., :rd], x64[..., rd:]
    if inv_freq is None:
        inv_freq = theta ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    angles = positions.double()[..., None] * inv_freq.double()  # (*P, L, rd/2)
    rotor = torch.polar(torch.ones_like(angles), angles).unsqueeze(-3)  # (*P, 1, L, rd/2)
    if interleaved:
        z = torch.view_as_complex(rot.unflatten(-1, (rd // 2, 2)).contiguous())
        out = torch.view_as_real(z * rotor).flatten(-2)
    else:
        z = torch.complex(rot[..., : rd // 2], rot[..., rd // 2 :])
        zr = z * rotor
        out = torch.cat([zr.real, zr.imag], dim=-1)
    return torch.cat([out, rest], dim=-1)


def assert_matches_ref(out: torch.Tensor, ref: torch.Tensor, atol: float = 2e-5) -> None:
    """float32 output vs a float64 reference: float32 cos/sin and rotation cost ~1e-6, angles ~p * 6e-8 rad."""
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=atol)


def bands(inv_freq: torch.Tensor, scaling: dict) -> tuple[int, int, int]:
    """How many frequencies fall in Llama-3's kept / blended / divided bands (computed from the wavelengths)."""
    wavelen = 2 * math.pi / inv_freq.double()
    old = scaling["original_max_position_embeddings"]
    kept = int((wavelen < old / scaling["high_freq_factor"]).sum())
    divided = int((wavelen > old / scaling["low_freq_factor"]).sum())
    return kept, inv_freq.numel() - kept - divided, divided


# ------------------------------------------------------------------------------------------------------ frequencies


@pytest.mark.parametrize("head_dim", [2, 8, 10, 64, 128])
@pytest.mark.parametrize("theta", [10000.0, 500000.0, 100.0])
def test_inv_freq_default_matches_hf(head_dim, theta):
    rope = gqa.RoPE(head_dim, theta=theta)
    ref = hf_inv_freq(head_dim, theta)
    assert rope.inv_freq.dtype == torch.float32
    assert rope.inv_freq.shape == (head_dim // 2,)
    torch.testing.assert_close(rope.inv_freq, ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("head_dim", "theta", "scaling"),
    [(16, 10000.0, LLAMA3_SMALL), (32, 10000.0, LLAMA3_SMALL), (128, 500000.0, LLAMA31), (64, 500000.0, LLAMA32)],
)
def test_inv_freq_llama3_matches_hf(head_dim, theta, scaling):
    kept, blended, divided = bands(hf_inv_freq(head_dim, theta), scaling)
    assert kept and blended and divided, "the case must exercise all three Llama-3 bands"
    rope = gqa.RoPE(head_dim, theta=theta, scaling=scaling)
    ref = hf_inv_freq(head_dim, theta, scaling)
    torch.testing.assert_close(rope.inv_freq, ref, rtol=1e-6, atol=0)
    # the kept band is unchanged, the divided band is exactly 1/factor of the default
    default = hf_inv_freq(head_dim, theta)
    torch.testing.assert_close(rope.inv_freq[:kept], default[:kept], rtol=1e-6, atol=0)
    torch.testing.assert_close(rope.inv_freq[-divided:], default[-divided:] / scaling["factor"], rtol=1e-6, atol=0)


def test_llama3_accepts_full_hf_rope_parameters():
    """An HF config's ``rope_parameters`` (with ``rope_theta`` and ``rope_type`` in it) can be passed as ``scaling``."""
    config = llama_config(16, 10000.0, LLAMA3_SMALL)
    rope = gqa.RoPE(16, theta=config.rope_parameters["rope_theta"], scaling=config.rope_parameters)
    torch.testing.assert_close(rope.inv_freq, LlamaRotaryEmbedding(config).inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("head_dim", "theta", "scaling"),
    [
        (8, 10000.0, None),
        (10, 500000.0, None),
        (16, 10000.0, LLAMA3_SMALL),
        (64, 500000.0, LLAMA31),
        (16, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    ],
)
@pytest.mark.parametrize("shape", ["shared", "per_row"])
def test_cos_sin_match_hf_rotary_embedding(head_dim, theta, scaling, shape):
    torch.manual_seed(0)
    config = llama_config(head_dim, theta, scaling)
    hf = LlamaRotaryEmbedding(config)
    rope = gqa.RoPE(head_dim, theta=theta, scaling=scaling, max_position=64)
    if shape == "shared":
        position_ids = torch.arange(3, 190)[None]  # (1, L); crosses the initial table size
    else:
        position_ids = torch.stack([torch.arange(0, 40), torch.arange(150, 190), torch.randint(0, 200, (40,))])
    cos_ref, sin_ref = hf(torch.zeros(1, dtype=torch.float32), position_ids)
    cos, sin = rope.cos_sin(position_ids if shape == "per_row" else position_ids[0])
    if shape == "shared":
        cos, sin = cos[None], sin[None]
    assert cos.dtype == sin.dtype == torch.float32
    # HF forms the angles in float32 (error ~ p * 6e-8 rad), ours in float64
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=3e-5)
    torch.testing.assert_close(sin, sin_ref, rtol=0, atol=3e-5)
    # the low frequencies, where float32 angles are exact enough, match float64 math to float32 rounding
    angles = position_ids.double()[..., None] * hf.inv_freq.double()
    angles = torch.cat([angles, angles], dim=-1)
    low = (angles.abs() < 1.0).all(dim=tuple(range(angles.dim() - 1)))
    assert low.any()
    torch.testing.assert_close(cos.double()[..., low], angles.cos()[..., low], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin.double()[..., low], angles.sin()[..., low], rtol=0, atol=2e-6)


@pytest.mark.parametrize("factor", [2.0, 4.0, 0.5])
@pytest.mark.parametrize("key", ["rope_type", "type"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_linear_scaling_equals_positions_over_factor(factor, key, interleaved):
    torch.manual_seed(1)
    head_dim, theta = 12, 10000.0
    rope = gqa.RoPE(head_dim, theta=theta, interleaved=interleaved, scaling={key: "linear", "factor": factor})
    q, k = torch.randn(2, 3, 9, head_dim), torch.randn(2, 1, 9, head_dim)
    pos = torch.tensor([0, 1, 2, 3, 7, 8, 33, 100, 255])
    q_out, k_out = rope(q, k, pos)
    assert_matches_ref(q_out, complex_rope_ref(q, pos / factor, theta, interleaved=interleaved))
    assert_matches_ref(k_out, complex_rope_ref(k, pos / factor, theta, interleaved=interleaved))
    # HF divides the frequencies instead of the positions
    if factor >= 1.0:  # HF warns on factor < 1
        hf = hf_inv_freq(head_dim, theta, {"rope_type": "linear", "factor": factor})
        ref = complex_rope_ref(q, pos, theta, interleaved=interleaved, inv_freq=hf)
        torch.testing.assert_close(q_out.double(), ref, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------------------------------- rotations


@pytest.mark.parametrize("head_dim", [2, 8, 10, 64])
@pytest.mark.parametrize(("H_q", "H_kv"), [(4, 4), (6, 2), (3, 1)])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SMALL])
def test_half_rotation_matches_hf_apply_rotary_pos_emb(head_dim, H_q, H_kv, scaling):
    torch.manual_seed(2)
    theta = 10000.0
    config = llama_config(head_dim, theta, scaling)
    hf = LlamaRotaryEmbedding(config)
    rope = gqa.RoPE(head_dim, theta=theta, scaling=scaling)
    B, L = 2, 7
    q, k = torch.randn(B, H_q, L, head_dim), torch.randn(B, H_kv, L, head_dim)
    pos = torch.tensor([0, 1, 2, 5, 9, 40, 63])
    cos, sin = hf(q, pos[None].expand(B, L))
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    q_out, k_out = rope(q, k, pos)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)
    assert_matches_ref(q_out, complex_rope_ref(q, pos, theta, inv_freq=hf.inv_freq))


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(2, 2), (8, 8), (10, 10), (16, 8), (10, 4), (12, 2)])
def test_interleaved_matches_complex_reference(head_dim, rotary_dim):
    torch.manual_seed(3)
    theta = 10000.0
    rope = gqa.RoPE(head_dim, theta=theta, rotary_dim=rotary_dim, interleaved=True)
    q, k = torch.randn(2, 4, 6, head_dim), torch.randn(2, 2, 6, head_dim)
    pos = torch.tensor([0, 3, 4, 10, 11, 50])
    q_out, k_out = rope(q, k, pos)
    assert_matches_ref(q_out, complex_rope_ref(q, pos, theta, rotary_dim, interleaved=True))
    assert_matches_ref(k_out, complex_rope_ref(k, pos, theta, rotary_dim, interleaved=True))


def test_interleaved_pairs_adjacent_features():
    """GPT-J layout by hand: only feature 0 set; at angle p * 1 it rotates into feature 1, nothing else moves."""
    rope = gqa.RoPE(6, theta=10000.0, interleaved=True)
    x = torch.zeros(1, 1, 1, 6)
    x[..., 0] = 1.0
    p = 2
    out, _ = rope(x, x, torch.tensor([p]))
    expected = torch.tensor([math.cos(p), math.sin(p), 0, 0, 0, 0], dtype=torch.float32)
    torch.testing.assert_close(out.reshape(6), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 8), (16, 4), (12, 6), (64, 16), (10, 2)])
def test_partial_rotary_matches_gpt_neox(head_dim, rotary_dim):
    torch.manual_seed(4)
    theta = 10000.0
    heads = 2
    config = GPTNeoXConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        intermediate_size=8,
        num_hidden_layers=1,
        vocab_size=16,
        rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rotary_dim / head_dim},
    )
    hf = GPTNeoXRotaryEmbedding(config)
    assert hf.inv_freq.numel() == rotary_dim // 2
    rope = gqa.RoPE(head_dim, theta=theta, rotary_dim=rotary_dim)
    B, L = 2, 5
    q, k = torch.randn(B, heads, L, head_dim), torch.randn(B, 1, L, head_dim)
    pos = torch.tensor([0, 1, 6, 7, 30])
    cos, sin = hf(q, pos[None].expand(B, L))
    q_ref, k_ref = neox_apply_rotary_pos_emb(q, k, cos, sin)
    q_out, k_out = rope(q, k, pos)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)
    # the pass-through features are bit-identical to the input
    assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])
    assert torch.equal(k_out[..., rotary_dim:], k[..., rotary_dim:])
    assert not torch.allclose(q_out[..., 1:rotary_dim], q[..., 1:rotary_dim])


@pytest.mark.parametrize("interleaved", [False, True])
def test_partial_rotary_passes_rest_through(interleaved):
    torch.manual_seed(5)
    rope = gqa.RoPE(12, theta=100.0, rotary_dim=4, interleaved=interleaved)
    q, k = torch.randn(3, 2, 5, 12), torch.randn(3, 2, 5, 12)
    pos = torch.arange(10, 15)
    q_out, k_out = rope(q, k, pos)
    assert torch.equal(q_out[..., 4:], q[..., 4:]) and torch.equal(k_out[..., 4:], k[..., 4:])
    assert_matches_ref(q_out, complex_rope_ref(q, pos, 100.0, 4, interleaved=interleaved))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_per_row_position_ids(interleaved, dtype):
    torch.manual_seed(6)
    head_dim, theta = 10, 10000.0
    rope = gqa.RoPE(head_dim, theta=theta, interleaved=interleaved)
    B, L = 3, 6
    q, k = torch.randn(B, 4, L, head_dim), torch.randn(B, 2, L, head_dim)
    position_ids = torch.stack([torch.arange(L), torch.arange(20, 20 + L), torch.tensor([0, 0, 0, 1, 2, 3])])
    position_ids = position_ids.to(dtype)
    q_out, k_out = rope(q, k, position_ids)
    assert_matches_ref(q_out, complex_rope_ref(q, position_ids, theta, interleaved=interleaved))
    assert_matches_ref(k_out, complex_rope_ref(k, position_ids, theta, interleaved=interleaved))
    for b in range(B):  # each row equals rotating that row alone at its positions
        q_b, k_b = rope(q[b], k[b], position_ids[b])
        torch.testing.assert_close(q_out[b], q_b, rtol=0, atol=0)
        torch.testing.assert_close(k_out[b], k_b, rtol=0, atol=0)
    if not interleaved:  # HF takes (B, L) positions too
        cos, sin = LlamaRotaryEmbedding(llama_config(head_dim, theta))(q, position_ids)
        q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
        torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_unbatched_and_extra_batch_dims(interleaved):
    torch.manual_seed(7)
    rope = gqa.RoPE(8, theta=10000.0, interleaved=interleaved)
    pos = torch.tensor([4, 5, 6])
    q3, k3 = torch.randn(2, 3, 8), torch.randn(1, 3, 8)  # (H, L, D)
    q_out, k_out = rope(q3, k3, pos)
    assert_matches_ref(q_out, complex_rope_ref(q3, pos, 10000.0, interleaved=interleaved))
    assert_matches_ref(k_out, complex_rope_ref(k3, pos, 10000.0, interleaved=interleaved))
    q5, k5 = torch.randn(2, 3, 4, 3, 8), torch.randn(2, 3, 2, 3, 8)  # (B1, B2, H, L, D)
    q_out, k_out = rope(q5, k5, pos)
    assert_matches_ref(q_out, complex_rope_ref(q5, pos, 10000.0, interleaved=interleaved))
    assert_matches_ref(k_out, complex_rope_ref(k5, pos, 10000.0, interleaved=interleaved))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("top", [8, 9, 1023, 1500])
def test_table_growth_matches_fresh_large_table(interleaved, top):
    torch.manual_seed(8)
    theta, head_dim = 10000.0, 16
    small = gqa.RoPE(head_dim, theta=theta, interleaved=interleaved, max_position=8)
    assert small.cos_cached.shape[0] == 8
    big = gqa.RoPE(head_dim, theta=theta, interleaved=interleaved, max_position=4096)
    pos = torch.tensor([0, 1, 7, top // 2, top - 1, top])
    q, k = torch.randn(1, 2, 6, head_dim), torch.randn(1, 1, 6, head_dim)
    q_small, k_small = small(q, k, pos)
    assert small.cos_cached.shape[0] > top and small.sin_cached.shape[0] > top
    q_big, k_big = big(q, k, pos)
    torch.testing.assert_close(q_small, q_big, rtol=0, atol=0)
    torch.testing.assert_close(k_small, k_big, rtol=0, atol=0)
    # float32 frequencies cost ~ p * 6e-8 rad of angle at position p
    ref = complex_rope_ref(q, pos, theta, interleaved=interleaved)
    torch.testing.assert_close(q_small.double(), ref, rtol=0, atol=1e-6 + 4e-7 * top)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("interleaved", [False, True])
def test_half_precision_keeps_dtype(dtype, tol, interleaved):
    torch.manual_seed(9)
    theta = 10000.0
    rope = gqa.RoPE(16, theta=theta, rotary_dim=12, interleaved=interleaved)
    q, k = torch.randn(2, 4, 5, 16).to(dtype), torch.randn(2, 2, 5, 16).to(dtype)
    pos = torch.tensor([0, 2, 9, 31, 100])
    q_out, k_out = rope(q, k, pos)
    assert q_out.dtype == dtype and k_out.dtype == dtype
    for x, out in ((q, q_out), (k, k_out)):
        ref = complex_rope_ref(x, pos, theta, 12, interleaved=interleaved)  # exact rotation of the rounded input
        # one rounding to the output dtype (relative error tol/2) on values of size <= ~4
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        assert torch.equal(out[..., 12:], x[..., 12:])


# ----------------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"head_dim": 8, "rotary_dim": 5}, ValueError, r"rotary_dim \(5\) must be even"),
        ({"head_dim": 7}, ValueError, r"rotary_dim \(7\) must be even"),
        ({"head_dim": 8, "rotary_dim": 0}, ValueError, r"must be even and >= 2"),
        ({"head_dim": 8, "rotary_dim": 10}, ValueError, r"rotary_dim \(10\) must not exceed head_dim \(8\)"),
        ({"head_dim": 8, "theta": 0.0}, ValueError, r"theta must be > 0"),
        ({"head_dim": 8, "theta": -10000.0}, ValueError, r"theta must be > 0"),
        ({"head_dim": 8, "scaling": {"rope_type": "yarn", "factor": 2.0}}, ValueError, r"unsupported rope scaling"),
        ({"head_dim": 8, "scaling": {"type": "dynamic", "factor": 2.0}}, ValueError, r"'dynamic'"),
        (
            {"head_dim": 8, "scaling": {**LLAMA3_SMALL, "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
            ValueError,
            r"high_freq_factor",
        ),
    ],
)
def test_constructor_errors(kwargs, exc, match):
    head_dim = kwargs.pop("head_dim")
    with pytest.raises(exc, match=match):
        gqa.RoPE(head_dim, **kwargs)


def test_wrong_head_dim_raises():
    rope = gqa.RoPE(8)
    q, k = torch.randn(1, 2, 3, 6), torch.randn(1, 2, 3, 6)
    with pytest.raises(ValueError, match=r"RoPE was built for head_dim 8, got a tensor of shape \(1, 2, 3, 6\)"):
        rope(q, k, torch.arange(3))


@pytest.mark.parametrize(
    ("position_ids", "match"),
    [
        (torch.arange(4), r"must end in the sequence length L=3"),
        (torch.arange(2), r"must end in the sequence length L=3"),
        (torch.tensor(0), r"must end in the sequence length"),
        (torch.zeros(2, 4, dtype=torch.long), r"must end in the sequence length L=3"),
        (torch.zeros(3, 3, dtype=torch.long), r"batch dims do not match"),
    ],
)
def test_position_ids_shape_errors(position_ids, match):
    rope = gqa.RoPE(8)
    q, k = torch.randn(2, 2, 3, 8), torch.randn(2, 1, 3, 8)
    with pytest.raises(ValueError, match=match):
        rope(q, k, position_ids)


def test_key_length_mismatch_raises():
    rope = gqa.RoPE(8)
    with pytest.raises(ValueError, match=r"must end in the sequence length L=3"):
        rope(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8), torch.arange(3))


@pytest.mark.parametrize("position_ids", [torch.tensor([0, -1, 2]), torch.tensor([[0, 1, 2], [-5, 0, 1]])])
def test_negative_positions_raise(position_ids):
    rope = gqa.RoPE(8)
    q, k = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    with pytest.raises(ValueError, match=r"position_ids must be >= 0, got min -"):
        rope(q, k, position_ids)
    with pytest.raises(ValueError, match=r"position_ids must be >= 0"):
        rope.cos_sin(position_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.complex64])
def test_float_position_ids_raise(dtype):
    rope = gqa.RoPE(8)
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match=r"position_ids must be an integer tensor"):
        rope(q, k, torch.arange(3).to(dtype))
    with pytest.raises(TypeError, match=r"position_ids must be an integer tensor"):
        rope.cos_sin(torch.arange(3).to(dtype))


# ------------------------------------------------------------------------------------- regressions (bugs once found)


def test_position_ids_for_first_of_several_batch_dims():
    torch.manual_seed(10)
    rope = gqa.RoPE(8)
    q = torch.randn(2, 2, 3, 4, 8)  # (B1, B2, H, L, D)
    position_ids = torch.tensor([[0, 1, 2, 3], [10, 11, 12, 13]])  # (B1, L)
    try:
        q_out, _ = rope(q, q, position_ids)
    except ValueError:
        return  # rejecting a (B1, L) row of positions for two batch dims is fine too
    ref = complex_rope_ref(q, position_ids[:, None, :], 10000.0)  # every b2 of row b1 uses position_ids[b1]
    err = (q_out.double() - ref).abs().max().item()
    assert err < 1e-5, f"(B1, L) position_ids accepted for a (B1, B2, H, L, D) query but misapplied (max err {err})"


@pytest.mark.parametrize("dtype", [torch.int16, torch.int8, torch.uint8])
@pytest.mark.filterwarnings("ignore:indexing with dtype torch.uint8")
def test_small_integer_position_ids(dtype):
    torch.manual_seed(11)
    rope = gqa.RoPE(8)
    q = torch.randn(1, 2, 3, 8)
    position_ids = torch.tensor([0, 5, 7])
    q_out, _ = rope(q, q, position_ids.to(dtype))
    assert_matches_ref(q_out, complex_rope_ref(q, position_ids, 10000.0))


def test_bool_position_ids_raise_type_error():
    rope = gqa.RoPE(8)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match=r"position_ids must be an integer tensor"):
        rope(q, q, torch.tensor([True, False, True]))


@pytest.mark.parametrize("theta", [float("nan"), float("inf")])
def test_non_finite_theta_raises(theta):
    with pytest.raises(ValueError, match=r"theta"):
        gqa.RoPE(8, theta=theta)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear"},
        {"rope_type": "linear", "factor": 0.0},
        {"rope_type": "linear", "factor": -2.0},
        {**LLAMA3_SMALL, "factor": 0.0},
    ],
    ids=["linear_missing", "linear_zero", "linear_negative", "llama3_zero"],
)
def test_bad_scaling_factor_raises_value_error(scaling):
    with pytest.raises(ValueError, match=r"factor"):
        gqa.RoPE(8, scaling=scaling)


# ------------------------------------------------------------------------------------------- module dtype and device


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cast", ["to", "method", "model"])
def test_tables_stay_float32_when_the_module_is_cast(dtype, interleaved, cast):
    """``.to(bf16)`` must not round the frequencies: at position 9000 a bf16 ``inv_freq`` is off by ~1 on unit-scale
    inputs. Positions run past the initial table (16) and past the default one (8192), so the table regrows from
    the frequencies after the cast."""
    torch.manual_seed(10)
    theta, D = 100000.0, 64
    rope = gqa.RoPE(D, theta=theta, interleaved=interleaved, max_position=16)
    if cast == "to":
        rope = rope.to(dtype)
    elif cast == "method":
        rope = {torch.bfloat16: rope.bfloat16, torch.float16: rope.half, torch.float64: rope.double}.get(
            dtype, rope.float
        )()
    else:  # inside a module tree, as gqa.load_model(dtype=...) casts the whole model
        rope = torch.nn.Sequential(gqa.GroupedQueryAttention(2 * D, 2, 1, rope=rope)).to(dtype)[0].rope
    assert {rope.inv_freq.dtype, rope.cos_cached.dtype, rope.sin_cached.dtype} == {torch.float32}
    pos = torch.tensor([0, 15, 16, 8191, 8192, 9000, 20000])
    q, k = torch.randn(1, 2, 7, D).to(dtype), torch.randn(1, 1, 7, D).to(dtype)
    q_out, k_out = rope(q, k, pos)
    assert q_out.dtype == dtype and rope.cos_cached.dtype == torch.float32 and rope.cos_cached.shape[0] > 20000
    for x, out in ((q, q_out), (k, k_out)):
        ref = complex_rope_ref(x, pos, theta, interleaved=interleaved)  # exact rotation of the rounded input
        # rounding to the output dtype on values |x| <= ~4, plus float32 frequencies (~p * 6e-8 rad at position p)
        tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}.get(dtype, 1e-5)
        err = (out.double() - ref).abs() - 4 * 4e-7 * pos[:, None].double()
        assert err.max().item() <= tol, f"{dtype}: max error {err.max().item():.3g} over the rounding budget"


def test_device_moves_keep_float32_tables():
    rope = gqa.RoPE(8, theta=10000.0).to("meta")
    assert rope.inv_freq.device.type == "meta" and rope.inv_freq.dtype == torch.float32
    rope = gqa.RoPE(8, theta=10000.0).to(device="cpu", dtype=torch.bfloat16)
    assert rope.inv_freq.device.type == "cpu" and rope.cos_cached.dtype == torch.float32
