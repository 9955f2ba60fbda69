"""``auto`` on CUDA (``gqa.attention.backends.cuda_routing``): a pure function of the call, checked on CPU with
hand-made ``CudaCall``s;
and the glue that builds the call from tensors (``gqa.attention.backends._cuda_backend``), with the device queries
faked."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import gqa
import gqa.attention.backends as backends
from gqa.attention.backends.cuda_routing import CudaCall, flash_supports, flash_takes, route_cuda, triton_takes
from gqa.attention.checks import AttnShape, check_qkv

BLACKWELL, HOPPER, AMPERE, TURING = (10, 0), (9, 0), (8, 0), (7, 5)
HALF = (torch.bfloat16, torch.float16)


def shape(L=1, S=512, H_q=32, H_kv=8, D=128, D_v=None, batch=(2,)):
    return AttnShape(tuple(batch), H_q, H_kv, L, S, D, D if D_v is None else D_v)


def call(L=1, S=512, dtype=torch.bfloat16, capability=HOPPER, D=128, D_v=None, batch=(2,), **kw):
    return CudaCall(capability=capability, dtype=dtype, shape=shape(L, S, D=D, D_v=D_v, batch=batch), **kw)


# decode (L <= 16) -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L", [1, 4, 16])
def test_decode_with_triton(L):
    """Decode runs the split-KV kernel unless SDPA's flash kernel takes it natively (half precision, no mask,
    sm80-sm90): float32, masks and GPUs outside flash's range go to triton."""
    for dtype in HALF:
        for cap in (HOPPER, AMPERE):
            assert route_cuda(call(L=L, dtype=dtype, capability=cap)) == "sdpa"
            assert route_cuda(call(L=L, dtype=dtype, capability=cap, is_causal=True)) == "sdpa"  # L <= S
        assert route_cuda(call(L=L, dtype=dtype, capability=TURING)) == "triton"
        assert route_cuda(call(L=L, dtype=dtype, capability=BLACKWELL)) == "triton"
        assert route_cuda(call(L=L, dtype=dtype, mask="bool")) == "triton"
        assert route_cuda(call(L=L, dtype=dtype, mask="float", is_causal=True)) == "triton"
        assert route_cuda(call(L=L, dtype=dtype, mask="bool", sdpa_native=True)) == "triton"
        assert triton_takes(call(L=L, dtype=dtype))  # it could run the maskless call: flash is preferred
    for cap in (BLACKWELL, HOPPER, AMPERE, TURING):
        assert route_cuda(call(L=L, dtype=torch.float32, capability=cap)) == "triton"
        assert route_cuda(call(L=L, dtype=torch.float32, capability=cap, mask="float")) == "triton"
        assert route_cuda(call(L=L, dtype=torch.float32, capability=cap, sdpa_native=True)) == "triton"


def test_decode_that_flash_refuses_goes_to_triton():
    assert route_cuda(call(D=100)) == "triton"  # flash: D % 8 != 0
    assert route_cuda(call(D=64, D_v=128)) == "triton"  # flash: D != D_v
    assert route_cuda(call(L=5, S=3, is_causal=True)) == "triton"  # flash: causal with L > S
    assert route_cuda(call(L=5, S=3)) == "sdpa"


@pytest.mark.parametrize(("capability", "expected"), [(HOPPER, "sdpa"), (AMPERE, "sdpa"), (TURING, "grouped")])
@pytest.mark.parametrize("dtype", HALF)
def test_half_decode_without_triton_needs_flash_capability(capability, expected, dtype):
    assert route_cuda(call(dtype=dtype, capability=capability, triton=False)) == expected


def test_decode_without_triton():
    assert route_cuda(call(dtype=torch.float32, triton=False)) == "grouped"
    assert route_cuda(call(dtype=torch.float32, triton=False, sdpa_native=True)) == "sdpa"
    c = call(triton=False, mask="bool")
    assert route_cuda(c) == "grouped"
    assert route_cuda(replace(c, sdpa_native=True)) == "sdpa"
    assert route_cuda(call(D=100, triton=False)) == "grouped"  # flash: D % 8 != 0
    assert route_cuda(call(capability=BLACKWELL, triton=False)) == "grouped"
    assert route_cuda(call(capability=BLACKWELL, triton=False, sdpa_native=True)) == "sdpa"


def test_needs_grad_decode_is_not_triton():
    assert not triton_takes(call(needs_grad=True))
    assert route_cuda(call(needs_grad=True)) == "sdpa"  # flash takes it (bf16, no mask)
    assert route_cuda(call(needs_grad=True, dtype=torch.float32)) == "grouped"
    assert route_cuda(call(needs_grad=True, mask="bool")) == "grouped"
    assert route_cuda(call(needs_grad=True, D=100)) == "grouped"
    assert route_cuda(call(needs_grad=True, capability=TURING)) == "grouped"


@pytest.mark.parametrize("kw", [dict(return_weights=True), dict(dropout_p=0.1)])
@pytest.mark.parametrize("L", [1, 128])
def test_weights_and_dropout_are_grouped(kw, L):
    for dtype in (torch.float32, torch.bfloat16):
        assert route_cuda(call(L=L, S=128, dtype=dtype, **kw)) == "grouped"
        assert route_cuda(call(L=L, S=128, dtype=dtype, triton=False, **kw)) == "grouped"
        assert route_cuda(call(L=L, S=128, dtype=dtype, sdpa_native=True, **kw)) == "grouped"


def test_decode_head_dim_limits():
    assert route_cuda(call(D=256, dtype=torch.float32)) == "triton"
    assert route_cuda(call(D=64, D_v=256, dtype=torch.float32)) == "triton"
    assert triton_takes(call(D=256)) and triton_takes(call(D=8, D_v=256))
    assert not triton_takes(call(D=512))
    assert not triton_takes(call(D=64, D_v=512))
    assert route_cuda(call(D=512)) == "grouped"  # and flash: D > 256
    assert route_cuda(call(D=512, dtype=torch.float32)) == "grouped"


def test_seventeen_new_tokens_are_not_triton():
    assert triton_takes(call(L=16, S=100))
    assert not triton_takes(call(L=17, S=100))
    assert route_cuda(call(L=16, S=100, dtype=torch.float32)) == "triton"
    assert route_cuda(call(L=17, S=100, dtype=torch.float32)) == "grouped"
    assert route_cuda(call(L=16, S=100, mask="bool")) == "triton"
    assert route_cuda(call(L=17, S=100, mask="bool")) == "grouped"
    assert route_cuda(call(L=17, S=100)) == "sdpa"


def test_unsupported_dtype_is_not_triton():
    assert not triton_takes(call(dtype=torch.float64))
    assert route_cuda(call(dtype=torch.float64)) == "grouped"


# prefill --------------------------------------------------------------------------------------------------------


def test_float32_prefill_is_grouped():
    assert route_cuda(call(L=512, S=512, dtype=torch.float32)) == "grouped"
    assert route_cuda(call(L=512, S=512, dtype=torch.float32, is_causal=True)) == "grouped"
    assert route_cuda(call(L=512, S=512, dtype=torch.float32, sdpa_native=True)) == "sdpa"  # torch said so


@pytest.mark.parametrize("dtype", HALF)
def test_half_prefill_is_sdpa(dtype):
    assert route_cuda(call(L=512, S=512, dtype=dtype)) == "sdpa"
    assert route_cuda(call(L=512, S=512, dtype=dtype, is_causal=True)) == "sdpa"  # L == S
    assert route_cuda(call(L=100, S=612, dtype=dtype, is_causal=True)) == "sdpa"  # L < S: causal_lower_right
    assert route_cuda(call(L=612, S=100, dtype=dtype, is_causal=True)) == "grouped"  # L > S: rows see nothing
    assert route_cuda(call(L=612, S=100, dtype=dtype)) == "sdpa"  # not causal: fine
    assert route_cuda(call(L=512, S=512, dtype=dtype, capability=TURING)) == "grouped"
    assert route_cuda(call(L=512, S=512, dtype=dtype, capability=BLACKWELL)) == "grouped"  # flash: sm80-sm90 only
    assert route_cuda(call(L=512, S=512, dtype=dtype, capability=BLACKWELL, sdpa_native=True)) == "sdpa"


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_prefill_with_mask(mask):
    c = call(L=512, S=512, mask=mask)
    assert not flash_takes(c)
    assert route_cuda(c) == "grouped"
    assert route_cuda(replace(c, sdpa_native=True)) == "sdpa"
    assert route_cuda(replace(c, sdpa_native=True, return_weights=True)) == "grouped"
    assert route_cuda(replace(c, sdpa_native=True, dropout_p=0.5)) == "grouped"


def test_prefill_head_dims_flash_refuses():
    assert route_cuda(call(L=512, S=512, D=100)) == "grouped"  # D % 8 != 0
    assert route_cuda(call(L=512, S=512, D=96)) == "sdpa"
    assert route_cuda(call(L=512, S=512, D=64, D_v=128)) == "grouped"  # D != D_v
    assert route_cuda(call(L=512, S=512, D=264)) == "grouped"  # D > 256
    assert route_cuda(call(L=512, S=512, D=256)) == "sdpa"


def test_flash_supports():
    assert flash_supports(AMPERE, torch.bfloat16, 128, 128)
    assert flash_supports(HOPPER, torch.float16, 8, 8)
    assert flash_supports((8, 6), torch.float16, 256, 256)
    assert not flash_supports(TURING, torch.float16, 128, 128)
    assert not flash_supports(BLACKWELL, torch.float16, 128, 128)
    assert not flash_supports(HOPPER, torch.float32, 128, 128)
    assert not flash_supports(HOPPER, torch.float16, 100, 100)
    assert not flash_supports(HOPPER, torch.float16, 128, 64)
    assert not flash_supports(HOPPER, torch.float16, 264, 264)


def test_needs_grad_prefill():
    assert route_cuda(call(L=512, S=512, needs_grad=True)) == "sdpa"
    assert route_cuda(call(L=512, S=512, needs_grad=True, dtype=torch.float32)) == "grouped"


@pytest.mark.parametrize(
    "kw", [dict(L=0), dict(S=0), dict(batch=(0,)), dict(batch=(3, 0)), dict(L=0, S=0), dict(L=512, S=0)]
)
def test_empty_shapes_are_grouped(kw):
    for dtype in (torch.float32, torch.bfloat16):
        assert route_cuda(call(dtype=dtype, **kw)) == "grouped"
        assert route_cuda(call(dtype=dtype, triton=False, **kw)) == "grouped"
        assert route_cuda(call(dtype=dtype, sdpa_native=True, **kw)) == "grouped"


# window, soft-capping, sinks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("capability", [BLACKWELL, HOPPER, AMPERE, TURING])
def test_variants_never_go_to_sdpa(dtype, capability):
    """A window, soft-cap or sinks: decode to the split-KV kernel, prefill to FlexAttention, whatever flash could do
    with the plain call; without either, the grouped matmul; sinks that need a gradient, the grouped matmul."""
    for mask in (None, "bool"):
        for L, S in [(1, 512), (16, 100), (17, 100), (512, 512)]:
            c = call(L=L, S=S, dtype=dtype, capability=capability, mask=mask, is_causal=True, variant=True, flex=True)
            decode = L <= 16
            assert route_cuda(c) == ("triton" if decode else "flex")
            assert route_cuda(replace(c, triton=False)) == "flex"
            assert route_cuda(replace(c, flex=False)) == ("triton" if decode else "grouped")
            assert route_cuda(replace(c, triton=False, flex=False, sdpa_native=True)) == "grouped"
            assert route_cuda(replace(c, sinks_grad=True)) == "grouped"
            assert route_cuda(replace(c, needs_grad=True)) == "flex"  # FlexAttention has a backward; the kernel not
            assert route_cuda(replace(c, return_weights=True)) == "grouped"
            assert route_cuda(replace(c, dropout_p=0.1)) == "grouped"
            assert route_cuda(replace(c, variant=False)) != "flex"


def test_flex_is_a_backend_and_supports_says_why():
    from gqa.attention.backends import flex

    assert gqa.BACKENDS["flex"] is flex.flex_attention_rows
    q, k, v = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    assert flex.supports(q, k, v, dropout_p=0.0, return_weights=False) is None
    assert "weights" in flex.supports(q, k, v, dropout_p=0.0, return_weights=True)
    assert "dropout" in flex.supports(q, k, v, dropout_p=0.5, return_weights=False)
    assert "dtype" in flex.supports(q.long(), k.long(), v.long(), dropout_p=0.0, return_weights=False)
    sinks = torch.zeros(4, requires_grad=True)
    assert "sinks that require grad" in flex.supports(q, k, v, dropout_p=0.0, return_weights=False, sinks=sinks)
    with torch.no_grad():
        assert flex.supports(q, k, v, dropout_p=0.0, return_weights=False, sinks=sinks) is None


# the registry and the CPU policy --------------------------------------------------------------------------------


def test_triton_is_a_backend():
    assert "triton" in gqa.BACKENDS
    assert gqa.BACKENDS["triton"] is backends.triton_attention


def _choose(q, k, v, mask=None, is_causal=False, return_weights=False, dropout_p=0.0):
    s = check_qkv(q, k, v)
    return backends.choose_backend(
        q, k, v, shape=s, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=s.D**-0.5,
        return_weights=return_weights,
    )  # fmt: skip


def test_cpu_policy_never_routes_through_cuda(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("CUDA routing consulted for CPU tensors")

    monkeypatch.setattr(backends, "route_cuda", boom)
    monkeypatch.setattr(backends, "_cuda_backend", boom)
    monkeypatch.setattr(backends, "device_capability", boom)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # even where the kernel could run on CPU tensors
    g = torch.Generator().manual_seed(0)
    cases = [
        (torch.float32, 1, 64, {}),
        (torch.bfloat16, 1, 64, {}),
        (torch.float32, 3, 64, dict(is_causal=True)),
        (torch.float32, 64, 64, dict(is_causal=True)),
        (torch.float32, 1, 64, dict(mask=torch.ones(64, dtype=torch.bool))),
    ]
    for dtype, L, S, kw in cases:
        q = torch.randn(2, 8, L, 32, generator=g).to(dtype)
        k = torch.randn(2, 2, S, 32, generator=g).to(dtype)
        v = torch.randn(2, 2, S, 32, generator=g).to(dtype)
        assert _choose(q, k, v, **kw) in ("fused", "grouped", "sdpa"), (dtype, L, S, kw)
        assert _choose(q, k, v, return_weights=True, **kw) == "grouped"
        assert _choose(q, k, v, dropout_p=0.1, **kw) == "grouped"
        out = gqa.grouped_attention(q, k, v, kw.get("mask"), is_causal=kw.get("is_causal", False))
        assert gqa.last_backend() in ("fused", "grouped", "sdpa")
        assert out.shape == (2, 8, L, 32)


@pytest.mark.parametrize("installed", [True, False])
def test_cuda_glue_builds_the_call(monkeypatch, installed):
    """``_cuda_backend`` turns tensors into a ``CudaCall`` (mask kind, needs_grad, capability, triton installed) and
    asks torch's dispatcher (``sdpa_is_native``) only where the rules alone would give ``grouped``."""
    seen, asked = [], []

    def spy(c):
        seen.append(c)
        return route_cuda(c)

    def native(*args, **kwargs):
        asked.append(kwargs)
        return True

    monkeypatch.setattr(backends, "device_capability", lambda device: AMPERE)
    monkeypatch.setattr(backends, "triton_runs", lambda *args: installed)
    monkeypatch.setattr(backends, "route_cuda", spy)
    monkeypatch.setattr(backends, "sdpa_is_native", native)
    q = torch.randn(2, 8, 1, 32)
    k = torch.randn(2, 2, 64, 32)
    v = torch.randn(2, 2, 64, 32)
    s = check_qkv(q, k, v)
    args = dict(dropout_p=0.0, is_causal=True, scale=0.1, return_weights=False)
    decode = "triton" if installed else "sdpa"  # without triton: float32 decode is grouped, unless torch says native

    assert backends._cuda_backend(q, k, v, s, None, **args) == decode
    c = seen[0]
    assert (c.capability, c.dtype, c.shape, c.mask, c.is_causal, c.needs_grad, c.triton) == (
        AMPERE, torch.float32, s, None, True, False, installed,
    )  # fmt: skip
    assert len(asked) == (0 if installed else 1)
    assert seen[-1].sdpa_native == (not installed)

    assert backends._cuda_backend(q, k, v, s, torch.ones(2, 1, 1, 64, dtype=torch.bool), **args) == decode
    assert seen[-1].mask == "bool"
    assert backends._cuda_backend(q, k, v, s, torch.zeros(64), **args) == decode
    assert seen[-1].mask == "float"

    q.requires_grad_(True)
    assert backends._cuda_backend(q, k, v, s, None, **args) == "sdpa"  # no backward in the kernel: torch's answer
    assert seen[-1].needs_grad
    with torch.no_grad():
        assert backends._cuda_backend(q, k, v, s, None, **args) == decode
    assert not seen[-1].needs_grad

    half = [t.detach().half() for t in (q, k, v)]
    before = len(asked)
    assert backends._cuda_backend(*half, s, None, **args) == "sdpa"  # flash decodes half natively on sm80
    assert len(asked) == before  # the rules decided: torch not asked

    asked.clear()
    with_weights = dict(args, return_weights=True)
    assert backends._cuda_backend(q.detach(), k, v, s, None, **with_weights) == "grouped"
    assert backends._cuda_backend(q.detach(), k, v, s, None, **dict(args, dropout_p=0.1)) == "grouped"
    assert asked == []  # weights/dropout: grouped whatever torch would say


@pytest.mark.parametrize("capability", [BLACKWELL, HOPPER, TURING])
@pytest.mark.parametrize("installed", [True, False])
def test_cuda_glue_agrees_with_route_cuda(monkeypatch, capability, installed):
    """Whatever shortcut ``_cuda_backend`` takes, it answers what ``route_cuda`` says for the same call."""
    monkeypatch.setattr(backends, "device_capability", lambda device: capability)
    monkeypatch.setattr(backends, "triton_runs", lambda *args: installed)
    monkeypatch.setattr(backends, "sdpa_is_native", lambda *args, **kwargs: False)
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for L, S, D, D_v in [(1, 64, 32, 32), (4, 3, 32, 32), (20, 64, 32, 32), (64, 64, 36, 36), (2, 64, 16, 32)]:
            q = torch.randn(2, 8, L, D, generator=g).to(dtype)
            k = torch.randn(2, 2, S, D, generator=g).to(dtype)
            v = torch.randn(2, 2, S, D_v, generator=g).to(dtype)
            s = check_qkv(q, k, v)
            for mask, is_causal, weights, dropout in [
                (None, False, False, 0.0),
                (None, True, False, 0.0),
                (torch.ones(S, dtype=torch.bool), True, False, 0.0),
                (torch.zeros(S, dtype=dtype), False, False, 0.0),
                (None, False, True, 0.0),
                (None, True, False, 0.2),
            ]:
                got = backends._cuda_backend(
                    q, k, v, s, mask, dropout_p=dropout, is_causal=is_causal, scale=0.1, return_weights=weights
                )
                kind = None if mask is None else ("bool" if mask.dtype == torch.bool else "float")
                c = CudaCall(capability, dtype, s, kind, is_causal, dropout, weights, False, installed)
                assert got == route_cuda(c), (dtype, L, S, D, D_v, kind, is_causal, weights, dropout)


def test_cuda_glue_asks_the_kernel_about_strides(monkeypatch):
    """A key whose last dim is strided, or batch dims that cannot merge without a copy, is not given to the split-KV
    kernel (which refuses it): ``auto`` must pick a backend that runs, not raise."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # supports() then accepts CPU tensors as the GPU's
    monkeypatch.setattr(backends, "device_capability", lambda device: HOPPER)
    monkeypatch.setattr(backends, "sdpa_is_native", lambda *args, **kwargs: False)
    pytest.importorskip("triton")
    q, v = torch.randn(1, 8, 1, 64), torch.randn(1, 2, 128, 64)
    dense = torch.randn(1, 2, 128, 64)
    args = dict(dropout_p=0.0, is_causal=False, scale=0.125, return_weights=False)
    assert backends._cuda_backend(q, dense, v, check_qkv(q, dense, v), None, **args) == "triton"
    strided = torch.randn(1, 2, 128, 128)[..., ::2]
    assert backends._cuda_backend(q, strided, v, check_qkv(q, strided, v), None, **args) == "grouped"
    q5, v5 = torch.randn(3, 2, 8, 1, 64), torch.randn(3, 2, 2, 128, 64)
    unmergeable = torch.randn(2, 3, 2, 128, 64).transpose(0, 1)
    assert backends._cuda_backend(q5, unmergeable, v5, check_qkv(q5, unmergeable, v5), None, **args) == "grouped"


def test_cuda_glue_routes_variants(monkeypatch):
    """``_cuda_backend(variant=True)``: never the flash shortcut, FlexAttention asked about the tensors."""
    monkeypatch.setattr(backends, "device_capability", lambda device: HOPPER)
    monkeypatch.setattr(backends, "triton_runs", lambda *args: True)
    monkeypatch.setattr(backends, "sdpa_is_native", lambda *args, **kwargs: True)
    args = dict(dropout_p=0.0, is_causal=True, scale=0.125, return_weights=False)
    for L, expected in ((1, "triton"), (64, "flex")):
        q = torch.randn(1, 8, L, 64).half()
        k, v = torch.randn(1, 2, 64, 64).half(), torch.randn(1, 2, 64, 64).half()
        s = check_qkv(q, k, v)
        assert backends._cuda_backend(q, k, v, s, None, **args) == "sdpa"  # the plain call: flash
        assert backends._cuda_backend(q, k, v, s, None, **args, variant=True) == expected
        assert backends._cuda_backend(q, k, v, s, None, **args, variant=True, sinks_grad=True) == "grouped"
