"""The native CPU kernels (``gqa.kernels``): GEMV and fused decode attention vs float64 references."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from helpers.attention_cases import BATCHES, SHAPES, make, make_mask
from helpers.reference import attention64
from torch._dynamo.testing import CompileCounter

import gqa
from gqa import kernels
from gqa.attention.backends import choose_backend
from gqa.models.linear import Linear, linear, linears, uses_kernel

DISABLED = os.environ.get("GQA_DISABLE_KERNELS") == "1"
pytestmark = pytest.mark.skipif(DISABLED, reason="GQA_DISABLE_KERNELS=1")

# Outputs rounded to the dtype after float32 accumulation: one rounding (bf16: 2 ** -8 relative) plus sums.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-4), torch.bfloat16: dict(rtol=2**-7, atol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def test_kernels_are_built():
    # `make` builds them (python -m gqa.kernels); a machine without them would silently lose the fast paths.
    assert kernels.available(), f"native kernels not built at {kernels.library_path()}"


@pytest.fixture
def simd(monkeypatch):
    """Route as on a CPU the kernels vectorize for (``kernels.vectorized``), so the routing into the kernels is
    exercised and checked on every CPU: without SIMD ``gqa.models.linear`` and ``auto`` leave float32 to PyTorch's
    ops."""
    monkeypatch.setattr(kernels, "vectorized", kernels.available)


@pytest.fixture
def no_simd(monkeypatch):
    """Route as on a CPU without AVX-512 or AVX2 (ARM, old x86), where the kernels are scalar loops."""
    monkeypatch.setattr(kernels, "vectorized", lambda: False)


def test_simd_width_is_what_the_cpu_has():
    # built -march=native: AVX-512 where the CPU has it, else AVX2 + FMA, else plain loops
    flags = set(kernels._cpu_flags().split())
    expected = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 1
    assert kernels.simd_width() == (expected if kernels.available() else 0)
    assert kernels.vectorized() == (kernels.simd_width() > 1)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    diff = (out.double() - ref).abs().max().item() if out.numel() else 0.0
    assert torch.allclose(out.double(), ref, **TOL[dtype]), f"max abs diff {diff:.3e}"


# ---- linear_rows ------------------------------------------------------------------------------------------------

# (N rows, K in, M out): K not a multiple of 16/32, M not a multiple of 4, N above the 4-row register tile
LINEAR_SHAPES = [(1, 5, 3), (3, 37, 67), (8, 576, 1536), (5, 1536, 576), (2, 64, 1), (4, 48, 9)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,M", LINEAR_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rows_matches_float64(dtype, N, K, M, bias, simd):
    g = torch.Generator().manual_seed(N * 1000 + K + M)
    x = torch.randn(N, K, generator=g).to(dtype)
    w = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(M, generator=g).to(dtype) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0.0)
    _close(torch.ops.gqa.linear_rows(x, w, b), ref, dtype)
    assert uses_kernel(x, w, b)
    _close(linear(x, w, b), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_leading_dims_and_strided_input(dtype, simd):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1, 40, generator=g).to(dtype)[..., ::2]  # (2, 1, 20), not contiguous
    w = torch.randn(7, 20, generator=g).to(dtype)
    assert uses_kernel(x, w)
    out = linear(x, w)
    assert out.shape == (2, 1, 7)
    _close(out, x.double() @ w.double().T, dtype)


def test_linear_falls_back_where_the_kernel_does_not_apply(simd):
    w = torch.randn(6, 8)
    assert not uses_kernel(torch.randn(9, 8), w)  # a GEMM: more than KERNEL_MAX_ROWS rows
    assert not uses_kernel(torch.randn(1, 8).half(), w.half())  # float16
    assert not uses_kernel(torch.randn(1, 8), w.t().contiguous().t())  # strided weight
    wg = w.clone().requires_grad_()
    assert not uses_kernel(torch.randn(1, 8), wg)  # training: the kernel has no backward
    with torch.no_grad():
        assert uses_kernel(torch.randn(1, 8), wg)


def test_linear_module_is_nn_linear_with_gradients():
    torch.manual_seed(0)
    ours, theirs = Linear(8, 6), torch.nn.Linear(8, 6)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(1, 8, requires_grad=True)
    out = ours(x)
    out.sum().backward()
    ref = theirs(x.detach())
    torch.testing.assert_close(out.detach(), ref)
    assert ours.weight.grad is not None and x.grad is not None
    with torch.inference_mode():
        torch.testing.assert_close(ours(x.detach()), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 3, 6])
def test_linear_rows_n_matches_float64(dtype, N):
    # Several matrices of one input in one parallel region: sizes that do not fill whole 4-row tiles, mixed biases.
    g = torch.Generator().manual_seed(N)
    K = 72
    x = torch.randn(N, K, generator=g).to(dtype)
    ws = [torch.randn(M, K, generator=g).to(dtype) for M in (9, 3, 130)]
    bs = [torch.randn(9, generator=g).to(dtype), None, torch.randn(130, generator=g).to(dtype)]
    outs = torch.ops.gqa.linear_rows_n(x, ws, bs)
    assert [o.shape for o in outs] == [(N, 9), (N, 3), (N, 130)]
    for out, w, b in zip(outs, ws, bs, strict=True):
        _close(out, x.double() @ w.double().T + (0.0 if b is None else b.double()), dtype)


def test_linears_equals_each_layer(simd):
    torch.manual_seed(1)
    layers = [Linear(16, 8, bias=True), Linear(16, 4, bias=False), Linear(16, 12)]
    x = torch.randn(2, 1, 16)
    with torch.inference_mode():
        assert all(uses_kernel(x, m.weight, m.bias) for m in layers)
        for out, m in zip(linears(x, layers), layers, strict=True):
            assert out.shape == (2, 1, m.out_features)
            _close(out, F.linear(x.double(), m.weight.double(), None if m.bias is None else m.bias.double()), x.dtype)
    outs = linears(x, layers)  # with gradients: the modules themselves
    assert all(o.grad_fn is not None for o in outs)


def test_linear_rows_rejects_bad_inputs():
    with pytest.raises(RuntimeError, match="disagree on K"):
        torch.ops.gqa.linear_rows(torch.randn(1, 4), torch.randn(3, 5), None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.gqa.linear_rows(torch.randn(1, 4).half(), torch.randn(3, 4).half(), None)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.gqa.linear_rows(torch.randn(1, 4), torch.randn(3, 4), torch.randn(2))


# ---- fused decode attention ---------------------------------------------------------------------------------------


def fused(q, k, v, **kw):
    return gqa.grouped_attention(q, k, v, backend="fused", **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H_q,H_kv,L,S,D", SHAPES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("mask_kind", ["none", "bool", "bool_2d", "float", "padding"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_fused_matches_float64(dtype, H_q, H_kv, L, S, D, batch, mask_kind, is_causal):
    q, k, v = make(batch, H_q, H_kv, L, S, D, dtype)
    mask = make_mask(mask_kind, batch, H_q, L, S, dtype)
    ref, _ = attention64(q, k, v, mask, is_causal)
    _close(fused(q, k, v, attn_mask=mask, is_causal=is_causal), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_long_context_is_split_and_recombined(dtype):
    # One head and one row: the context is split across tasks; the splits' partial softmaxes must combine exactly.
    q, k, v = make((1,), 4, 1, 1, 3001, 64, dtype, seed=5)
    keep = torch.rand(1, 1, 1, 3001, generator=torch.Generator().manual_seed(2)) > 0.5
    keep[..., :2000] = False  # whole early splits see nothing
    ref, _ = attention64(q, k, v, keep)
    _close(fused(q, k, v, attn_mask=keep), ref, dtype)
    scale = 0.3
    ref, _ = attention64(q, k, v, scale=scale)
    _close(fused(q, k, v, scale=scale), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H_q,L", [(5, 1), (6, 1), (7, 1), (3, 3), (2, 5)])
def test_fused_row_tiles_rescale_every_row(dtype, H_q, L):
    # A KV head's R = G * L query rows share each value row in tiles of 4, then one tile of the last 1-3 rows; over
    # 200 keys (4 chunks) every tile's rows must be rescaled by their own running maxima.
    q, k, v = make((2,), H_q, 1, L, 200, 64, dtype, seed=H_q * 10 + L)
    q = q * 3  # sharper softmaxes: the running maxima move from chunk to chunk
    ref, _ = attention64(q, k, v, None, L > 1)
    _close(fused(q, k, v, is_causal=L > 1), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_reads_strided_cache_views(dtype):
    # A static cache hands out K/V as slices of (B, H_kv, S_max, D) buffers: strided, never copied.
    q, k_buf, v_buf = make((2,), 6, 2, 1, 50, 16, dtype, D_v=24)
    k, v = k_buf[:, :, :37], v_buf[:, :, :37]
    assert not k.is_contiguous()
    ref, _ = attention64(q, k, v)
    _close(fused(q, k, v), ref, dtype)


def test_fused_empty_rows_are_zero():
    q, k, v = make((2,), 4, 2, 5, 3, 8)  # L > S causal: the first two query rows see no key
    out = fused(q, k, v, is_causal=True)
    assert torch.all(out[..., :2, :] == 0) and torch.isfinite(out).all()
    ref, _ = attention64(q, k, v, is_causal=True)
    _close(out, ref, torch.float32)


def test_fused_refuses_what_it_cannot_do():
    q, k, v = make((1,), 4, 2, 1, 9, 8)
    with pytest.raises(ValueError, match="float16"):
        fused(q.half(), k.half(), v.half())
    with pytest.raises(ValueError, match="weights"):
        gqa.grouped_attention(q, k, v, backend="fused", return_weights=True)
    with pytest.raises(ValueError, match="gradients"):
        fused(q.requires_grad_(), k, v)


def _choice(q, k, v, **kw):
    from gqa.attention.checks import check_qkv

    shape = check_qkv(q, k, v)
    args = dict(attn_mask=None, dropout_p=0.0, is_causal=False, scale=shape.D**-0.5, return_weights=False)
    args.update(kw)
    return choose_backend(q, k, v, shape=shape, **args)


def test_auto_uses_fused_for_inference_decode_only(simd):
    q, k, v = make((2,), 8, 2, 1, 64, 16)
    assert _choice(q, k, v) == "fused"
    assert _choice(q, k, v.requires_grad_()) == "grouped"  # training keeps the differentiable path
    assert _choice(q.half(), k.half(), v.half()) == "grouped"
    assert _choice(q, k, v.detach(), return_weights=True) == "grouped"
    q, k, v = make((1,), 9, 1, 1, 64, 16)  # SmolLM2 as MQA: 9 rows per KV head, in both dtypes
    assert _choice(q, k, v) == "fused" and _choice(q.bfloat16(), k.bfloat16(), v.bfloat16()) == "fused"
    q, k, v = make((1,), 32, 1, 64, 64, 16)  # prefill: G * L rows far above FUSED_ROWS
    assert _choice(q, k, v) != "fused"


def test_without_simd_float32_goes_to_pytorch_and_bf16_decode_stays_fused(no_simd):
    """Built without SIMD the kernels lose to PyTorch in float32 (decode attention 4-8x, GEMV 1.3-1.5x, measured
    with such a build on an AMD EPYC) but the fused decode still beats the emulated bf16 matmuls."""
    q, k, v = make((1,), 9, 1, 1, 64, 16)  # SmolLM2 as MQA
    assert _choice(q, k, v) == "grouped"
    assert _choice(q.bfloat16(), k.bfloat16(), v.bfloat16()) == "fused"
    w = torch.randn(6, 8)
    with torch.inference_mode():
        assert not uses_kernel(torch.randn(1, 8), w) and not uses_kernel(torch.randn(1, 8).bfloat16(), w.bfloat16())
        torch.testing.assert_close(linear(torch.randn(2, 8), w).shape, torch.Size([2, 6]))
    out = gqa.grouped_attention(q, k, v, is_causal=True)  # auto, through grouped: still right
    torch.testing.assert_close(out, attention64(q, k, v, None, is_causal=True)[0].float(), rtol=1e-5, atol=1e-5)


def test_kernels_compile_into_one_graph():
    q, k, v = make((1,), 6, 2, 1, 40, 16)
    w = torch.randn(24, 16)
    keep = torch.rand(1, 1, 1, 40) > 0.2

    def step(q, k, v, w, keep):
        out = gqa.grouped_attention(q, k, v, attn_mask=keep, backend="fused")
        return linear(out, w)

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(q, k, v, w, keep), step(q, k, v, w, keep))
    assert counter.frame_count == 1
    eager = F.linear(attention64(q, k, v, keep)[0].float(), w)
    torch.testing.assert_close(step(q, k, v, w, keep), eager, rtol=1e-4, atol=1e-4)
