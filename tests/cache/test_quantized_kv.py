"""The quantized KV cache (``kv_dtype`` ``q8_0`` / ``q4_0``): its blocks against gguf.quants (llama.cpp's own layout
and rounding) and a float64 bound, attention over the blocks against float64 attention over what they hold (native
kernel and torch fallback, odd shapes, masks, windows, soft-cap, sinks, prompt chunks), every cache class holding
them, and bad choices refused with the argument's name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gqa
from gqa import kernels
from gqa.attention import quantized_cache
from gqa.attention.module import GroupedQueryAttention
from gqa.attention.rope import RoPE
from gqa.cache.kv import DynamicKVCache, StaticKVCache, kv_kinds
from gqa.cache.kv_dtypes import KV_DTYPES
from gqa.cache.quantize import as_stored, dequantize, held_values, quantize, reference_quantize, rotate
from gqa.cache.window import WindowKVCache

native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built on this machine")
BLOCKS = ["q8_0", "q4_0"]


@pytest.fixture(params=["native", "torch"])
def path(request, monkeypatch):
    """Run the test through the native kernels, then through the torch ops alone (no kernels)."""
    if request.param == "native":
        if not kernels.available():
            pytest.skip("native kernels not built on this machine")
    else:
        monkeypatch.setattr(kernels, "available", lambda: False)
    return request.param


def random_rows(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Rows whose blocks span several magnitudes, with exact zeros and ties in places."""
    x = torch.randn(*shape, generator=g) * torch.exp(3 * torch.rand(*shape[:-1], 1, generator=g) - 1.5)
    x.view(-1, shape[-1])[0, :32] = 0.0  # an all-zero block: scale 0
    x.view(-1, shape[-1])[1, :32] = torch.tensor([1.0, -1.0] * 16)  # equal magnitudes: the first one's sign wins
    return x


@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_are_gguf_quants_bytes_whichever_path(path, name, dtype):
    from gguf import GGMLQuantizationType, quants

    g = torch.Generator().manual_seed(0)
    x = random_rows(g, 3, 5, 96).to(dtype)  # batch dims; 3 blocks a row
    kv = KV_DTYPES[name]
    blocks = quantize(x, kv)
    assert blocks.dtype == torch.uint8 and blocks.shape == (3, 5, 96 // 32 * kv.block_bytes)
    want = quants.quantize(x.float().numpy().reshape(-1, 96), GGMLQuantizationType[name.upper()])
    np.testing.assert_array_equal(blocks.reshape(-1, blocks.shape[-1]).numpy(), want)
    back = dequantize(blocks, kv)
    np.testing.assert_array_equal(
        back.reshape(-1, 96).numpy(), quants.dequantize(want, GGMLQuantizationType[name.upper()])
    )


@pytest.mark.parametrize("name", BLOCKS)
def test_round_trip_is_within_half_a_step_of_the_float64_values(name):
    g = torch.Generator().manual_seed(1)
    x = random_rows(g, 64, 128).double()
    kv = KV_DTYPES[name]
    back = dequantize(reference_quantize(x, kv), kv).double()
    blocks = x.reshape(64, 4, 32)
    if name == "q8_0":
        step = blocks.abs().amax(-1, keepdim=True) / 127
        bound = step / 2 + 127 * step * 2.0**-11  # half a step, and the fp16 scale's rounding over 127 steps
    else:
        step = blocks.abs().amax(-1, keepdim=True) / 8
        bound = step / 2 + 8 * step * 2.0**-11 + step * 1e-6  # q clamps at 15: the largest positive value is 7 d
        bound = torch.maximum(bound, (blocks.abs().amax(-1, keepdim=True) - 7 * step).clamp_min(0) + step / 2)
    err = (back.reshape(64, 4, 32) - blocks).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0  # not a copy


def hadamard64(n: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of size ``n`` / sqrt(n), float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / n**0.5


@pytest.mark.parametrize(("D", "r"), [(32, 32), (64, 64), (96, 32), (128, 128), (256, 256), (512, 256)])
def test_keys_are_stored_hadamard_rotated_the_same_bits_whichever_path(path, D, r):
    g = torch.Generator().manual_seed(5)
    x = random_rows(g, 3, 4, D)
    turned = rotate(x)
    want = x.double().reshape(3, 4, D // r, r) @ hadamard64(r)  # block-diagonal, r values a block
    torch.testing.assert_close(turned.double(), want.reshape(3, 4, D), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotate(turned).double(), x.double(), atol=1e-5, rtol=1e-5)  # its own inverse
    for name in BLOCKS:
        kv = KV_DTYPES[name]
        stored = as_stored(x, kv, key=True)
        assert torch.equal(stored, reference_quantize(turned, kv))  # native and torch: the same rotation, bit for bit
        assert torch.equal(as_stored(x, kv), quantize(x, kv))  # values: not rotated
        torch.testing.assert_close(held_values(stored, kv, key=True), rotate(dequantize(stored, kv)))


def test_a_block_with_nan_or_inf_reads_back_as_nan_and_its_neighbours_do_not(path):
    x = torch.randn(2, 64)
    x[0, 3], x[1, 40] = float("nan"), float("inf")
    for kv in map(KV_DTYPES.get, BLOCKS):
        back = dequantize(quantize(x, kv), kv)
        assert bool(back[0, :32].isnan().all()) and bool(back[1, 32:].isnan().all())
        assert bool(back[0, 32:].isfinite().all()) and bool(back[1, :32].isfinite().all())


def reference_attention(q, k, v, *, causal, mask=None, window=None, softcap=None, sinks=None, scale=None):
    """float64 attention of ``q (B, H_q, L, D)`` over float ``k``, ``v`` ``(B, H_kv, S, D)``: K/V repeated per
    group, scores soft-capped, then masked (bottom-right causal, ``mask``, a left window), sinks in the denominator;
    a row that sees nothing is zeros."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    L, S = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(L)[:, None] + S - L, torch.arange(S)[None, :]
    allowed = torch.ones(L, S, dtype=torch.bool) if not causal else j <= i
    if window is not None:
        allowed = allowed & (j >= i - window)
    allowed = allowed.expand_as(scores)
    if mask is not None:
        allowed = allowed & mask if mask.dtype == torch.bool else allowed
        scores = scores if mask.dtype == torch.bool else scores + mask.double()
    scores = scores.masked_fill(~allowed, float("-inf"))
    extra = torch.full((*scores.shape[:-1], 1), float("-inf"), dtype=torch.float64)
    if sinks is not None:
        extra = sinks.double().view(1, -1, 1, 1).expand(extra.shape)
    full = torch.cat([scores, extra], -1)
    top = full.amax(-1, keepdim=True)
    w = torch.exp(full - torch.where(top == float("-inf"), 0.0, top))
    denom = w.sum(-1, keepdim=True)
    out = (w[..., :-1] @ v) / torch.where(denom > 0, denom, 1.0)
    return torch.where((allowed.any(-1, keepdim=True)), out, 0.0)


SHAPES = [  # B, H_q, H_kv, L, S, D
    (2, 18, 6, 3, 7, 64),  # odd heads and lengths
    (1, 9, 3, 1, 300, 64),  # SmolLM2's heads, one decoded token over several chunks
    (2, 4, 1, 5, 70, 128),  # MQA, a prompt chunk
    (1, 2, 2, 1, 40, 256),  # MHA, a big head
]


@pytest.mark.parametrize(("B", "Hq", "Hkv", "L", "S", "D"), SHAPES)
@pytest.mark.parametrize("kinds", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("bf16", "q4_0")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_blocks_is_float64_attention_over_their_values(path, B, Hq, Hkv, L, S, D, kinds, dtype):
    g = torch.Generator().manual_seed(2)
    kind = tuple(KV_DTYPES[name] for name in kinds)
    q = torch.randn(B, Hq, L, D, generator=g).to(dtype)
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    kq, vq = as_stored(k, kind[0], key=True), as_stored(v, kind[1])
    held = held_values(kq, kind[0], key=True), held_values(vq, kind[1])
    got = quantized_cache.quantized_cache_attention(q, kq, vq, kind, None, True, None)
    want = reference_attention(q, *held, causal=True)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert got.dtype == dtype and got.shape == (B, Hq, L, D)


@pytest.mark.parametrize("variant", ["mask", "float_mask", "window", "softcap", "sinks", "empty_rows"])
def test_masks_windows_softcap_and_sinks_over_blocks(path, variant):
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, L, S, D = 2, 6, 2, 3, 90, 32
    kind = (KV_DTYPES["q8_0"], KV_DTYPES["q4_0"])
    q = torch.randn(B, Hq, L, D, generator=g)
    k, v = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    kq, vq = as_stored(k, kind[0], key=True), as_stored(v, kind[1])
    held = held_values(kq, kind[0], key=True), held_values(vq, kind[1])
    kw: dict = {}
    mask = None
    if variant == "mask":  # a per-row padding mask (B, 1, 1, S)
        mask = (torch.arange(S) >= torch.tensor([0, 11])[:, None])[:, None, None]
    elif variant == "float_mask":
        mask = torch.randn(B, Hq, L, S, generator=g)
    elif variant == "window":
        kw = dict(window=17)
    elif variant == "softcap":
        kw = dict(softcap=0.7)
        q = q * 4
    elif variant == "sinks":
        kw = dict(sinks=torch.randn(Hq, generator=g))
    else:  # rows that see no key: zeros
        mask = torch.zeros(B, 1, L, S, dtype=torch.bool)
        mask[0, :, 1:] = True
    got = quantized_cache.quantized_cache_attention(q, kq, vq, kind, mask, True, None, **kw)
    window = kw.pop("window", None)
    want = reference_attention(q, *held, causal=True, mask=mask, window=window, **kw)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_the_torch_fallback_reads_chunks_and_never_the_whole_cache(monkeypatch):
    seen = []
    real = quantized_cache.dequantize
    monkeypatch.setattr(quantized_cache, "dequantize", lambda t, kv, *a: seen.append(t.shape[2]) or real(t, kv, *a))
    kind = (KV_DTYPES["q4_0"],) * 2
    k = quantize(torch.randn(1, 2, 2500, 32), kind[0])
    out = quantized_cache.chunked_attention(torch.randn(1, 4, 1, 32), k, k, kind, None, True, 0.2)
    assert out.shape == (1, 4, 1, 32) and max(seen) == quantized_cache.FALLBACK_CHUNK and sum(seen) == 2 * 2500


@pytest.mark.parametrize("cache_class", ["static", "dynamic", "window"])
@pytest.mark.parametrize("kinds", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "fp32")])
def test_every_cache_holds_blocks_and_the_module_attends_to_them(path, monkeypatch, cache_class, kinds):
    """A GQA module over a quantized cache (a left-padded prompt, then single tokens and a chunk): the cache holds
    exactly the blocks of a float cache's K/V, and each call's attention is float64 attention over the values held,
    padding (and the window) hidden."""
    import gqa.attention.module as module_file

    calls = []
    real = module_file.quantized_cache_attention
    monkeypatch.setattr(module_file, "quantized_cache_attention", lambda q, k, v, *a, **kw: record(q, k, v, a, kw))

    def record(q, k, v, a, kw):
        out = real(q, k, v, *a, **kw)
        calls.append((q, k, v, out))
        return out

    torch.manual_seed(4)
    E, Hq, Hkv, D, window = 64, 6, 2, 32, 12
    module = GroupedQueryAttention(E, Hq, Hkv, D, rope=RoPE(D), window=window if cache_class == "window" else None)
    module.eval()
    x = torch.randn(2, 30, E)

    def new(kv) -> object:
        if cache_class == "static":
            return StaticKVCache(2, Hkv, D, 32, kv_dtype=kv)
        if cache_class == "dynamic":
            return DynamicKVCache(2, Hkv, D, initial_len=4, kv_dtype=kv)
        return WindowKVCache(2, Hkv, D, 32, window + 1, spare=4, kv_dtype=kv)

    cache, plain = new(kinds), new("fp32")
    for c in (cache, plain):
        c.set_left_padding([0, 3])
    kind = kv_kinds(kinds, torch.float32)
    with torch.no_grad():
        for a, b in ((0, 20), (20, 21), (21, 22), (22, 27), (27, 28)):
            got = module(x[:, a:b], is_causal=True, cache=cache)
            module(x[:, a:b], is_causal=True, cache=plain)
            q, k, v, att = calls[-1]
            S = k.shape[2]
            first = cache._returned_offset if cache_class == "window" else 0  # the position of the first key
            for mine, theirs, kd, is_key in ((k, plain.key, kind[0], True), (v, plain.value, kind[1], False)):
                if cache_class == "window" and plain.slots < S:
                    continue  # a call longer than the slots: K/V joined, not the buffers
                assert torch.equal(mine, as_stored(theirs[:, :, :S], kd, key=is_key))
            held = held_values(k, kind[0], key=True), held_values(v, kind[1])
            pad = (torch.arange(first, first + S) >= cache.start[:, None])[:, None, None]  # (B, 1, 1, S)
            want = reference_attention(q, *held, causal=True, mask=pad, window=window if module.window else None)
            torch.testing.assert_close(att.double(), want, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(got, module.o_proj(att.transpose(1, 2).flatten(2)))
    assert len(calls) == 5


def test_bad_choices_name_the_argument():
    with pytest.raises(
        ValueError, match="kv_dtype must be one of fp32, bf16, fp16, q8_0, q4_0, fp8_e4m3, fp8, got 'q5_0'"
    ):
        StaticKVCache(1, 2, 64, 8, kv_dtype="q5_0")
    with pytest.raises(ValueError, match="a q4_0 KV cache needs a head dim that is a multiple of 32, got 40"):
        StaticKVCache(1, 2, 40, 8, kv_dtype="q4_0")
    with pytest.raises(ValueError, match="kv_dtype bf16 differs from the model's dtype fp32"):
        StaticKVCache(1, 2, 64, 8, kv_dtype="bf16")
    for fp8 in ("fp8_e4m3", "fp8", ("q8_0", "fp8")):  # the CUDA kernels read fp8, the CPU ones do not
        with pytest.raises(ValueError, match="kv_dtype fp8_e4m3 is read by the CUDA kernels only"):
            StaticKVCache(1, 2, 64, 8, kv_dtype=fp8)
    with pytest.raises(ValueError, match="kv_dtype fp8_e4m3 is read by the CUDA kernels only"):
        gqa.load_model(kv_dtype="fp8", tokenizer=False)
    with pytest.raises(ValueError, match=r"a name or a \(K, V\) pair"):
        StaticKVCache(1, 2, 64, 8, kv_dtype=("q8_0", "q8_0", "q8_0"))
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        gqa.load_model(kv_dtype="int4", tokenizer=False)


def test_blocks_take_their_bytes():
    static = StaticKVCache(2, 3, 64, 100, kv_dtype=("q8_0", "q4_0"), dtype=torch.bfloat16)
    assert static.nbytes == 2 * 3 * 100 * (2 * 34 + 2 * 18)
    assert static.key.dtype == torch.uint8 and static.kv_formats == (0, 1)
    assert StaticKVCache(2, 3, 64, 100, dtype=torch.bfloat16).nbytes == 2 * 3 * 100 * 64 * 2 * 2


def e4m3_float64(x: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 (the fn variant: no infinities, +-448 the largest) rounding written out in float64: 3 mantissa
    bits, exponents from -6 (below: subnormal steps of 2^-9), ties to even, saturated at +-448; NaN stays."""
    x = x.double()
    a = x.abs().clamp(max=448.0)
    exponent = torch.floor(torch.log2(a.clamp(min=2.0**-6)))  # the binade; subnormals share the smallest
    step = torch.exp2(exponent - 3)
    q = torch.round(a / step) * step  # torch.round: halves to even
    return torch.copysign(q.clamp(max=448.0), x).where(~x.isnan(), x)


def test_fp8_rows_round_to_the_nearest_e4m3_value():
    """fp8_e4m3 rows (uint8 bytes, one a value): values over six decades, subnormals, exact ties, +-448 and beyond,
    NaN — against the rounding written out in float64; keys stored rotated and read back within e4m3's step."""
    kind = KV_DTYPES["fp8_e4m3"]
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 3, 200, generator=g) * torch.exp(6 * torch.rand(4, 3, 1, generator=g) - 4)
    specials = [0.0, -0.0, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 1.0625, 1.1875, 448.0, 464.0, 1e6, -1e6, float("nan")]
    x[0, 0, : len(specials)] = torch.tensor(specials)  # 1.0625 / 1.1875: ties (to 1.0 / 1.25), 464: past 448
    stored = quantize(x, kind)
    assert stored.dtype == torch.uint8 and stored.shape == x.shape
    held = dequantize(stored, kind)
    want = e4m3_float64(x)
    assert torch.equal(held.double().isnan(), want.isnan()) and held[0, 0, 11].isnan()
    assert torch.equal(held.double().nan_to_num(), want.nan_to_num())
    assert held[0, 0, 5] == 1.0 and held[0, 0, 6] == 1.25 and held[0, 0, 8] == 448.0 and held[0, 0, 9] == 448.0
    k = torch.randn(2, 64, generator=g)
    back = held_values(as_stored(k, kind, key=True), kind, key=True)
    assert ((back - k).norm() / k.norm()).item() < 2**-4  # e4m3's relative step is 2^-3: half of it at most
    assert kv_kinds("fp8", torch.bfloat16) == (kind, kind) and kind.row_bytes(40) == 40 and kind.bits_per_value == 8
