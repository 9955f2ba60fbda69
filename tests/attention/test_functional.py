"""grouped_attention vs a float64 reference and vs torch SDPA on explicitly repeated K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.attention_cases import BATCHES, SHAPES, make, make_mask
from helpers.reference import TOL, attention64, bottom_right_allowed

import gqa

BACKENDS = ["reference", "grouped", "sdpa", "auto"]
# (H_q, H_kv, L, S, D): odd GQA, MHA, MQA, decode, prefill, more queries than keys


def check_close(out, ref, dtype, msg=""):
    tol = TOL[dtype]
    diff = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    assert torch.allclose(out.double(), ref, **tol), f"{msg} max abs diff {diff:.3e} (tol {tol})"


def run(backend, *args, **kw):
    try:
        return gqa.grouped_attention(*args, backend=backend, **kw)
    except ValueError as e:  # sdpa refuses where torch would copy K/V; that refusal is itself tested below
        if backend == "sdpa" and "math path" in str(e):
            pytest.skip("torch SDPA has no natively grouped kernel for this call")
        raise


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "Hq{}_Hkv{}_L{}_S{}_D{}".format(*s))
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{len(b)}")
@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool", "bool_2d", "float", "padding", "bool+causal"])
def test_matches_float64_reference(backend, shape, batch, mask_kind):
    H_q, _, L, S, D = shape
    q, k, v = make(batch, *shape)
    causal = "causal" in mask_kind
    mask = make_mask(mask_kind.replace("+causal", "").replace("causal", "none"), batch, H_q, L, S, q.dtype)
    out = run(backend, q, k, v, attn_mask=mask, is_causal=causal)
    ref, _ = attention64(q, k, v, mask, causal)
    assert out.shape == (*batch, H_q, L, D) and out.dtype == q.dtype
    check_close(out, ref, q.dtype, f"{backend} {mask_kind}")
    assert not out.isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "float", "bool"])
def test_dtypes(backend, dtype, mask_kind):
    shape = (8, 2, 4, 40, 16)
    q, k, v = make((2,), *shape, dtype=dtype)
    mask = make_mask({"causal": "none"}.get(mask_kind, mask_kind), (2,), 8, 4, 40, dtype)
    out = run(backend, q, k, v, attn_mask=mask, is_causal=mask_kind == "causal")
    ref, _ = attention64(q, k, v, mask, mask_kind == "causal")
    assert out.dtype == dtype
    check_close(out, ref, dtype, f"{backend} {dtype}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L,S", [(3, 7), (7, 7), (1, 16), (7, 3)])
def test_vs_sdpa_on_repeated_kv(backend, L, S):
    """torch SDPA on K/V repeated per query head, with our bottom-right causal rule given as an explicit mask."""
    q, k, v = make((2,), 12, 4, L, S, 8)
    k_rep, v_rep = k.repeat_interleave(3, dim=-3), v.repeat_interleave(3, dim=-3)
    expected = F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=bottom_right_allowed(L, S))
    out = run(backend, q, k, v, is_causal=True)
    if L > S:  # rows with no visible key: we return zeros, SDPA (2.13) too
        expected = torch.where(bottom_right_allowed(L, S).any(-1)[:, None], expected, 0.0)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    plain = F.scaled_dot_product_attention(q, k_rep, v_rep, scale=0.3)
    torch.testing.assert_close(run(backend, q, k, v, scale=0.3), plain, atol=2e-5, rtol=2e-5)


def test_causal_is_bottom_right_not_top_left():
    """With L < S the last query sees every key; torch's top-left is_causal would hide keys from it."""
    q, k, v = make((), 4, 2, 2, 6, 8)
    out = gqa.grouped_attention(q, k, v, is_causal=True)
    full = gqa.grouped_attention(q[..., -1:, :], k, v)  # the last query, unmasked
    torch.testing.assert_close(out[..., -1:, :], full)
    top_left = F.scaled_dot_product_attention(q, k.repeat_interleave(2, -3), v.repeat_interleave(2, -3), is_causal=True)
    assert not torch.allclose(out, top_left, atol=1e-3)


@pytest.mark.parametrize("backend", ["reference", "grouped"])
def test_value_dim_differs(backend):
    q, k, v = make((2,), 18, 6, 3, 7, 5, D_v=11)
    out = gqa.grouped_attention(q, k, v, is_causal=True, backend=backend)
    ref, _ = attention64(q, k, v, None, True)
    assert out.shape == (2, 18, 3, 11)
    check_close(out, ref, torch.float32)
    assert gqa.grouped_attention(q, k, v, backend="auto").shape == (2, 18, 3, 11)


@pytest.mark.parametrize("backend", ["reference", "grouped", "auto"])
@pytest.mark.parametrize("batch", BATCHES, ids=lambda b: f"B{len(b)}")
def test_return_weights(backend, batch):
    q, k, v = make(batch, 18, 6, 3, 7, 5)
    mask = make_mask("bool", batch, 18, 3, 7, q.dtype)
    out, w = gqa.grouped_attention(q, k, v, mask, is_causal=True, return_weights=True, backend=backend)
    ref_out, ref_w = attention64(q, k, v, mask, True)
    assert w.shape == (*batch, 18, 3, 7)
    check_close(w, ref_w, torch.float32)
    check_close(out, ref_out, torch.float32)
    with pytest.raises(ValueError, match="cannot return attention weights"):
        gqa.grouped_attention(q, k, v, return_weights=True, backend="sdpa")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows_are_zero_with_finite_grads(backend):
    q, k, v = make((2,), 6, 2, 4, 5, 8)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = torch.ones(2, 6, 4, 5, dtype=torch.bool)
    mask[:, :, 1] = False  # query row 1 sees nothing, in every head
    mask[0, 3] = False  # and one whole head of one batch element
    out = run(backend, q, k, v, attn_mask=mask)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.equal(out[0, 3], torch.zeros_like(out[0, 3]))
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, 1], torch.zeros_like(q.grad[:, :, 1]))
    float_mask = torch.zeros(4, 5).masked_fill(~mask[0, 0], float("-inf"))
    out2 = run(backend, q.detach(), k.detach(), v.detach(), attn_mask=float_mask)
    assert not out2.isnan().any() and torch.equal(out2[:, :, 1], torch.zeros_like(out2[:, :, 1]))


@pytest.mark.parametrize("backend", ["reference", "grouped", "sdpa"])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "float"])
def test_gradcheck_float64(backend, mask_kind):
    q, k, v = make((2,), 4, 2, 3, 5, 4, dtype=torch.float64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    mask = make_mask("float", (2,), 4, 3, 5, torch.float64) if mask_kind == "float" else None
    if mask is not None:
        mask = mask.clamp_min(-1e9)  # gradcheck perturbs inputs; keep every row visible but strongly biased
    causal = mask_kind == "causal"

    def fn(q, k, v):
        return gqa.grouped_attention(q, k, v, mask, is_causal=causal, backend=backend)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "grouped", "sdpa"])
def test_grads_match_reference(backend):
    q, k, v = make((2,), 18, 6, 3, 7, 8)
    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    gqa.grouped_attention(*ours, is_causal=True, backend=backend).sum().backward()
    attention64(*ref, None, True)[0].sum().backward()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=1e-4, rtol=1e-4)


def test_dropout():
    """Dropped weights are 0 or the undropped weight / (1 - p); p = 0 is exact; the same seed repeats."""
    q, k, v = make((2,), 8, 2, 5, 9, 8)
    p = 0.4
    for backend in ("reference", "grouped", "auto"):
        torch.manual_seed(3)
        out, w = gqa.grouped_attention(q, k, v, dropout_p=p, return_weights=True, backend=backend)
        _, clean = attention64(q, k, v)
        kept = w != 0
        assert 0.4 < kept.float().mean() < 0.8
        torch.testing.assert_close(w[kept].double(), clean[kept] / (1 - p), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.double(), w.double() @ v.double().repeat_interleave(4, -3), atol=1e-5, rtol=1e-5)
        torch.manual_seed(3)
        again = gqa.grouped_attention(q, k, v, dropout_p=p, backend=backend)
        torch.testing.assert_close(again, out)
    with pytest.raises(ValueError, match="math path"):
        gqa.grouped_attention(q, k, v, dropout_p=p, backend="sdpa")


def test_mqa_and_mha_are_special_cases():
    q, k, v = make((2,), 8, 8, 4, 6, 8)
    torch.testing.assert_close(gqa.grouped_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    q1, k1, v1 = make((2,), 8, 1, 4, 6, 8)
    torch.testing.assert_close(
        gqa.grouped_attention(q1, k1, v1),
        F.scaled_dot_product_attention(q1, k1.expand(2, 8, 6, 8), v1.expand(2, 8, 6, 8)),
    )


def test_non_contiguous_inputs():
    """Keys/values as views of a larger buffer (as a static cache hands them out) and transposed queries."""
    q, k, v = make((2,), 6, 2, 3, 10, 8)
    big_k = torch.zeros(2, 2, 32, 8)
    big_v = torch.zeros(2, 2, 32, 8)
    big_k[:, :, :10], big_v[:, :, :10] = k, v
    q_t = q.transpose(-2, -3).contiguous().transpose(-2, -3)
    for backend in BACKENDS:
        out = gqa.grouped_attention(q_t, big_k[:, :, :10], big_v[:, :, :10], is_causal=True, backend=backend)
        check_close(out, attention64(q, k, v, None, True)[0], torch.float32, backend)


ALL_BACKENDS = [*BACKENDS, "fused"]


def runnable(backend: str, dtype: torch.dtype) -> None:
    if backend == "fused" and not gqa.kernels.available():
        pytest.skip("native kernels not built")
    if backend == "fused" and dtype not in (torch.float32, torch.bfloat16):
        pytest.skip("the fused kernel is float32/bfloat16 only")


@pytest.mark.parametrize("backend", ["reference", "grouped", "sdpa", "auto", "fused"])
def test_last_dim_strided_query_on_every_backend(backend):
    """A query whose features are strided (every other element of a wider tensor): ``auto`` runs it (on CPU it may
    pick the fused kernel, which reads contiguous rows) and every backend agrees with the reference."""
    runnable(backend, torch.float32)
    q_wide, k, v = make((2,), 8, 2, 1, 40, 32)
    q = q_wide[..., ::2]  # (2, 8, 1, 16), stride 2 in the last dim
    k, v = k[..., :16], v[..., :16].contiguous()
    with torch.inference_mode():
        check_close(run(backend, q, k, v), attention64(q, k, v)[0], torch.float32, backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["query", "key", "value"])
@pytest.mark.parametrize("S", [5, 700])  # below one SIMD vector of keys; several chunks and context splits
def test_nan_in_gives_nan_out_on_every_backend(backend, dtype, where, S):
    """A NaN in Q, K or V comes out as NaN exactly where the float64 reference has it, on every backend."""
    runnable(backend, dtype)
    q, k, v = make((2,), 8, 2, 1, S, 64, dtype=dtype)
    target = {"query": q, "key": k, "value": v}[where]
    target[1, 0, S // 2 if where != "query" else 0, 3] = float("nan")
    ref, _ = attention64(q, k, v)
    with torch.inference_mode():
        out = run(backend, q, k, v)
    assert ref.isnan().any()
    assert torch.equal(out.isnan(), ref.isnan()), f"{backend}: NaN pattern differs from the reference"
    finite = ~ref.isnan()
    check_close(out[finite].view(-1, 1), ref[finite].view(-1, 1), dtype, backend)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L", [1, 4, 40])  # decode (the grouped GEMV branch), a few rows, prefill-like
def test_peaked_scores_in_half_precision(backend, dtype, L):
    """Large scores (|q.k| / sqrt(D) up to ~100, a near one-hot softmax): every backend computes scores and softmax
    in float32, so the error stays at the output's own rounding. Half-precision scores were 0.07 off in bf16."""
    runnable(backend, dtype)
    q, k, v = make((2,), 8, 2, L, 64, 64, dtype=torch.float32, seed=4)
    q, k, v = (q * 4).to(dtype), (k * 4).to(dtype), v.to(dtype)
    ref, _ = attention64(q, k, v, None, True)  # the exact attention of the rounded inputs
    with torch.inference_mode():
        out = run(backend, q, k, v, is_causal=True)
    # one rounding of outputs |o| <= ~3 to the dtype (bf16: 2^-8 relative, fp16: 2^-11), plus float32 softmax
    tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"{backend} {dtype}: max error {err:.3g} > {tol}"


@pytest.mark.parametrize("backend", ["auto", "reference", "grouped"])
@pytest.mark.parametrize(("L", "S"), [(3, 0), (0, 5), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_empty_query_or_key_sequences(backend, L, S, causal):
    """No keys: every query sees nothing, so zeros (the fully-masked-row rule); no queries: an empty output."""
    q, k, v = make((2,), 6, 2, L, S, 8)
    mask = torch.ones(L, S, dtype=torch.bool)
    for m in (None, mask):
        out = gqa.grouped_attention(q, k, v, m, is_causal=causal, backend=backend)
        assert out.shape == (2, 6, L, 8) and torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("backend", ["fused", "sdpa"])
def test_empty_inputs_are_refused_by_the_fused_backends(backend):
    q, k, v = make((2,), 6, 2, 3, 0, 8)
    with pytest.raises(ValueError, match="empty inputs"):
        gqa.grouped_attention(q, k, v, is_causal=True, backend=backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bool_2d", "float"])
@pytest.mark.parametrize(("D", "D_v", "strided"), [(16, 16, False), (16, 16, True), (16, 8, False)])
def test_compiled_kernel_choice_matches_torch(dtype, mask_kind, D, D_v, strided):
    """Under torch.compile the SDPA backend asks torch's kernel choice on one-token stand-ins (the real query cannot
    be traced); on this CPU that answer must be the real inputs' answer."""
    from gqa.attention.backends.sdpa import _fused_choice, _fused_choice_probe, _layout, _mask_4d

    q, k, v = make((2,), 8, 2, 40, 40, 2 * D if strided else D, dtype=dtype, D_v=D_v)
    if strided:
        q = q[..., ::2]
        k = k[..., :D]
    shape = gqa.attention.checks.check_qkv(q, k, v)
    mask = make_mask(mask_kind, (2,), 8, 40, 40, dtype)
    mask = None if mask is None else _mask_4d(mask, shape)
    real = _fused_choice(q, k, v, mask, False, None, True)
    kind = None if mask is None else (mask.dim(), mask.dtype)
    assert _fused_choice_probe(_layout(q), _layout(k), _layout(v), kind, False, True) == real
