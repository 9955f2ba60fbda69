"""Block-quantized models on the edges: non-finite inputs to the quantized GEMV (``gqa::qlinear_rows_n`` quantizes
each input block to int8, which a NaN or an infinity has no value for) and models with quantized weights cast with
``Module.to(dtype)`` / ``.float()`` / ``.bfloat16()`` (the quantized embedding's row dtype must follow)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import gqa
from gqa import kernels
from gqa.decoding import native_step as decode_step
from gqa.models.quantized import (
    FORMATS,
    QuantizedEmbedding,
    QuantizedLinear,
    QuantizedTensor,
    dequantize,
    quantize,
    quantize_model,
    quantized_linears,
    uses_kernel,
)
from tests.helpers.int8_inputs import expected_input_products

gguf = pytest.importorskip("gguf")
from tests.helpers.k_quants import quantize as quantize_blocks  # noqa: E402 (needs gguf)

native = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")

M, K = 37, 512  # odd row count, 16 blocks (2 super-blocks of the K formats) per row


def blocks_of(w: torch.Tensor, fmt: str) -> QuantizedTensor:
    """``w`` in ``fmt``: gguf's quantizer, or the test's own for the K formats."""
    blocks = quantize_blocks(w.numpy(), gguf.GGMLQuantizationType[fmt.upper()])
    return QuantizedTensor(torch.from_numpy(blocks), FORMATS[fmt], tuple(w.shape))


def layer_of(fmt: str, seed: int = 0, m: int = M, bias: bool = True) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, K, generator=g)
    return QuantizedLinear(blocks_of(w, fmt), torch.randn(m, generator=g) if bias else None)


def reference(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear`` with the dequantized weight, in ``x``'s dtype: what non-finite inputs must give."""
    weight = dequantize(layer.blocks, layer.format, layer.in_features, x.dtype)
    return F.linear(x, weight, None if layer.bias is None else layer.bias.to(x.dtype))


def assert_nonfinite_like(y: torch.Tensor, expected: torch.Tensor) -> None:
    """Finite where ``expected`` is, and the same NaN / +inf / -inf where it is not."""
    bad = ~torch.isfinite(expected)
    assert torch.equal(torch.isfinite(y), ~bad), f"non-finite pattern differs: got {y}, expected {expected}"
    torch.testing.assert_close(y[bad], expected[bad], equal_nan=True, rtol=0, atol=0)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 6])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_nan_in_a_row_makes_that_row_nan_and_leaves_the_others(fmt, rows, dtype):
    layer = layer_of(fmt, seed=rows)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows + 10)).to(dtype)
    with torch.inference_mode():
        assert uses_kernel(x)
        clean = layer(x)
        bad_row = rows // 2
        x[bad_row, 100] = float("nan")  # in the 4th block of the row, not the first
        y = layer(x)
    assert torch.isnan(y[bad_row]).all(), y[bad_row]
    others = [r for r in range(rows) if r != bad_row]
    assert torch.equal(y[others], clean[others])  # bit for bit: the other rows take the integer path as before


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_infinite_inputs_give_what_the_float_product_gives(fmt, dtype):
    layer = layer_of(fmt, seed=3)
    with torch.no_grad():  # zero weights in column 7: inf * 0 is NaN in the float product
        w = layer.quantized().dequantize()
        w[::4, 7] = 0.0
        layer = QuantizedLinear(blocks_of(w, fmt), layer.bias)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4)).to(dtype)
    x[0, 7] = float("inf")  # +-inf per output, NaN where w = 0 (q8_0, q4_0, q5_0, q6_k)
    x[2, 40] = float("-inf")
    x[2, 150] = float("inf")  # inf - inf: NaN where the two weights have the same sign
    x[4, 7] = float("-inf")
    x[4, 9] = float("nan")  # NaN wins
    with torch.inference_mode():
        clean = layer(torch.stack([x[1], x[3]]))
        y = layer(x)
        expected = reference(layer, x)
    for r in (0, 2, 4):
        assert not torch.isfinite(expected[r]).any()
    assert torch.isposinf(expected[0]).any() and torch.isneginf(expected[0]).any()
    assert torch.isnan(expected[2]).any() and torch.isinf(expected[2]).any()
    if fmt not in ("q4_1", "q5_1", "q4_k", "q5_k"):  # their w = d * q + m is not exactly 0 there
        assert torch.isnan(expected[0]).any()
    assert_nonfinite_like(y, expected)
    assert torch.equal(y[[1, 3]], clean)


@native
def test_nonfinite_inputs_to_several_matrices_at_once():
    """``quantized_linears``: one kernel call over matrices of every format; one of them spans several threads'
    tiles, so each part's non-finite blocks are added at its own rows."""
    layers = [layer_of("q8_0", 1, 200), layer_of("q4_0", 2, 24, bias=False), layer_of("q4_1", 3, 41)]
    layers += [layer_of("q6_k", 4, 33), layer_of("q4_k", 5, 70)]
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(5))
    x[1, 33] = float("nan")
    x[3, 159] = float("-inf")
    with torch.inference_mode():
        clean = quantized_linears(x[[0, 2]].clone(), layers)
        outs = quantized_linears(x, layers)
        for layer, out, before in zip(layers, outs, clean, strict=True):
            assert torch.isnan(out[1]).all()
            assert_nonfinite_like(out, reference(layer, x))
            assert torch.equal(out[[0, 2]], before)


@native
def test_tiny_blocks_quantize_to_zero_not_garbage():
    """A block of values below ~3.7e-37 has a scale whose reciprocal overflows to inf: no int8 for x * inf."""
    layer = layer_of("q8_0", seed=6)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(7))
    x[0, 32:64] = 1e-38
    x[1, :32] = 0.0
    with torch.inference_mode():
        y = layer(x)
        expected = reference(layer, x)
    assert torch.isfinite(y).all()
    assert (y - expected).abs().max() < 0.02 * expected.abs().max()


# Where each format's fp16 scales sit in a block: d, then m (q4_1, q5_1) or dmin (q4_k, q5_k); q6_k's d at its end.
SCALES_AT = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_1": (0, 2), "q5_1": (0, 2), "q4_k": (0, 2), "q5_k": (0, 2),
             "q6_k": (208,)}  # fmt: skip


def with_scales(blocks: np.ndarray, fmt: str, edits: list[tuple[int, int, int, float]]) -> np.ndarray:
    """``blocks (M, row bytes)`` with ``(row, block, scale field, value)`` written as fp16."""
    out = blocks.copy()
    size = FORMATS[fmt].block_bytes
    for row, block, field, value in edits:
        at = block * size + SCALES_AT[fmt][field]
        out[row, at : at + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
    return out


def scale_sweep(fmt: str) -> tuple[np.ndarray, list[int]]:
    """Weight blocks ``(M, K)`` of ``fmt`` whose rows put inf, -inf, NaN and finite extremes (65504, a subnormal, 0)
    in each scale field of a first, middle and last block, alone and together (two blocks of opposite infinities; d
    and m both infinite), the first row left as it is; and each row's first edited block (0 for the first row)."""
    last = K // FORMATS[fmt].block_values - 1
    edits = [[]]
    for field in range(len(SCALES_AT[fmt])):
        for value in (math.inf, -math.inf, math.nan, 65504.0, 2.0**-24, 0.0):
            edits += [[(block, field, value)] for block in (0, last // 2, last)]
        edits.append([(0, field, math.inf), (last, field, -math.inf)])
    if len(SCALES_AT[fmt]) == 2:
        edits += [[(1, 0, math.inf), (1, 1, -math.inf)], [(1, 0, -math.inf), (1, 1, -math.inf)]]
    w = np.random.default_rng(11).standard_normal((1, K)).astype(np.float32)
    w = np.repeat(np.where(np.abs(w) < 0.3, np.where(w < 0, -0.3, 0.3), w), len(edits), axis=0)  # none near 0
    w[2::4, [3, K - 29]] = 0.0  # but in every fourth row: q - offset = 0 (inf * 0) in the first and the last block
    blocks = quantize_blocks(w, gguf.GGMLQuantizationType[fmt.upper()])
    rows = [(r, b, f, v) for r, e in enumerate(edits) for b, f, v in e]
    return with_scales(blocks.reshape(len(edits), -1), fmt, rows), [e[0][0] if e else 0 for e in edits]


def gguf_weights(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """``(M, K)`` float32: gguf's dequantization of ``blocks`` (inf * 0 is NaN there: numpy's warning silenced)."""
    with np.errstate(invalid="ignore"):
        return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[fmt.upper()]).reshape(blocks.shape[0], K)


def float_math(x: np.ndarray, blocks: np.ndarray, fmt: str) -> np.ndarray:
    """``(N, M)``: float32 math on what the quantized path multiplies: x as its int8 path quantizes it (numpy) times
    gguf's dequantized weights, summed. inf * 0 is NaN, +inf meets -inf in NaN."""
    weights = gguf_weights(blocks, fmt)
    with np.errstate(invalid="ignore"):
        return (expected_input_products(x)[:, None, :] * weights[None]).sum(-1, dtype=np.float32)


def aligned_inputs(blocks: np.ndarray, fmt: str, first: list[int], seed: int) -> np.ndarray:
    """``(M, K)`` float32 inputs, row r random but for the block of row r's first edit, where each input has the
    sign of row r's weight there (r even) or the opposite sign (r odd): every product of that block has one sign, so an
    infinite weight there gives +-inf in float math unless one is NaN."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((blocks.shape[0], K)).astype(np.float32)
    signs = np.sign(gguf_weights(blocks, fmt))
    size = FORMATS[fmt].block_values  # the K formats' scales are a super-block's
    for r, b in enumerate(first):
        cols = slice(b * size, (b + 1) * size)
        sign = np.where(np.isnan(signs[r, cols]) | (signs[r, cols] == 0), 1, signs[r, cols])
        x[r, cols] = (1 - 2 * (r % 2)) * sign * rng.uniform(0.5, 1.5, size)
    return x


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_nonfinite_weight_scales_give_what_ggufs_weights_give_in_float(fmt, dtype):
    """An fp16 scale (d, m, dmin) of inf, -inf or NaN: the product gives what gguf's dequantized weights give in
    float32 math with the inputs as quantized (``float_math``) — NaN where an infinite weight meets a zero or +inf
    meets -inf, else the infinity — where the integer path's d_w * d_x * (q . q_x) gave +-inf for NaN and the reverse.
    Inputs whose block agrees in sign with the edited one's weights (so float math has infinities), random ones, an
    all-zero block, a non-finite input; one row alone, 3 rows, 21 (the lanes); finite extremes stay finite and close;
    and ``dequantize`` is gguf's, NaN for NaN."""
    blocks, first = scale_sweep(fmt)
    layer = QuantizedLinear(QuantizedTensor(torch.from_numpy(blocks), FORMATS[fmt], (blocks.shape[0], K)))
    out = dequantize(layer.blocks, layer.format, K, torch.float32)
    torch.testing.assert_close(out, torch.from_numpy(gguf_weights(blocks, fmt)), equal_nan=True, rtol=0, atol=0)
    x = np.concatenate([aligned_inputs(blocks, fmt, first, seed=12), np.random.default_rng(13).standard_normal(
        (8, K)).astype(np.float32)])  # fmt: skip
    x[-1, 64:96] = 0.0
    x[-2, 70] = np.inf
    x = torch.from_numpy(x).to(dtype)
    expected = torch.from_numpy(float_math(x.float().numpy(), blocks, fmt))
    assert expected.isnan().any() and expected.isposinf().any() and expected.isneginf().any()
    finite = torch.isfinite(expected)
    rtol = 1e-5 if dtype == torch.float32 else 8e-3  # bfloat16 outputs
    with torch.inference_mode():
        for n in (1, 3, 21):
            y = torch.cat([layer(x[r : r + n]) for r in range(0, x.shape[0], n)]).float()
            assert_nonfinite_like(y, expected)
            torch.testing.assert_close(y[finite], expected[finite], rtol=rtol, atol=rtol * expected[finite].abs().max())


def tiny_model(fmt: str = "q4_0"):
    from gqa.models import CausalLM, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    model = CausalLM(cfg).eval()
    quantize_model(model, fmt)
    return model


def first_decode_logits(model, prompt: list[int], token: int) -> torch.Tensor:
    """Logits ``(vocab,)`` of one decode step after ``prompt``, through the native decode step (asserted)."""
    from gqa.decoding.steps import select_step

    caches = model.new_caches(1, len(prompt) + 1)
    with torch.inference_mode():
        model(torch.tensor([prompt]), caches=caches, last_only=True)
        step = select_step(model, caches)
        assert step.name == "native" and decode_step.applies(model, torch.tensor([[token]]), caches)
        logits = step(torch.tensor([[token]]), caches)[0, 0]
    return logits.float()


@native
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_quantized_models_decode_step_propagates_nonfinite_values(value):
    """A non-finite final-norm weight puts a NaN / inf into every ``lm_head`` input (q8_0): the logits must be the
    float product's, not finite numbers."""
    model = tiny_model()
    inputs = []
    model.lm_head.register_forward_pre_hook(lambda module, args: inputs.append(args[0].clone()))
    with torch.no_grad():
        model.model.norm.weight[5] = value
    logits = first_decode_logits(model, [1, 2, 3], 4)  # one gqa::decode_model call: lm_head inside it
    with pytest.MonkeyPatch.context() as m:
        m.setattr(decode_step, "decode_weights", lambda *args: None)
        per_layer = first_decode_logits(model, [1, 2, 3], 4)  # a call per layer, then the lm_head module (hooked)
    expected = reference(model.lm_head, inputs[-1]).view(-1)
    assert not torch.isfinite(expected).any()
    for out in (logits, per_layer):
        if math.isnan(value):
            assert torch.isnan(out).all()
        assert_nonfinite_like(out, expected)


def test_quantized_embedding_dtype_follows_module_to():
    emb = QuantizedEmbedding(quantize(torch.randn(10, 64), "q8_0"), torch.bfloat16)
    assert emb.dtype == torch.bfloat16 and list(emb.state_dict()) == ["blocks"]  # nothing new saved
    ids = torch.tensor([[1, 7]])
    for cast, dtype in [
        (lambda m: m.float(), torch.float32),
        (lambda m: m.to(torch.bfloat16), torch.bfloat16),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.to(torch.float32), torch.float32),
    ]:
        cast(emb)
        assert emb.dtype == dtype and emb(ids).dtype == dtype and emb(ids).shape == (1, 2, 64)
        assert emb.blocks.dtype == torch.uint8
    with pytest.raises(TypeError, match="float dtype"):
        QuantizedEmbedding(quantize(torch.randn(10, 64), "q8_0"), torch.int64)


# SmolLM2 with quantized weights: quantize="q8_0" (every weight re-quantized from float) and dtype="auto" (the GGUF's
# own Q4_1 / Q8_0 blocks), each loaded in float32 and in bfloat16, then cast to the other dtype.
PROMPT = [1, 504, 3575, 282, 4649, 314]  # token ids; no tokenizer needed
TOKEN = 7042


@pytest.fixture(scope="module")
def loaded():
    """``{(source, dtype): (model, first decode-step logits)}``, loaded lazily, once per module."""
    models: dict = {}

    def get(source: str, dtype: torch.dtype):
        if (source, dtype) not in models:
            if source == "q8_0":
                model = gqa.load_model(dtype=dtype, quantize="q8_0", tokenizer=False)
            else:  # dtype="auto" keeps the GGUF's blocks; it picks bfloat16 where the CPU has native bf16
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(gqa.loaders.model, "auto_dtype", lambda device: dtype)
                    model = gqa.load_model(dtype="auto", tokenizer=False)
                assert isinstance(model.model.layers[0].mlp.gate_proj, QuantizedLinear)
            assert model.dtype == dtype and model.model.embed_tokens.dtype == dtype
            models[source, dtype] = model, first_decode_logits(model, PROMPT, TOKEN)
        return models[source, dtype]

    return get


def check_cast(model, dtype: torch.dtype, reference_logits: torch.Tensor, source: str) -> None:
    assert model.dtype == dtype and model.model.embed_tokens.dtype == dtype
    for module in model.modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            assert module.blocks.dtype == torch.uint8
    tokens = model.generate(PROMPT, max_new_tokens=4, eos_token_ids=[])
    assert len(tokens) == 4
    logits = first_decode_logits(model, PROMPT, TOKEN)
    assert logits.argmax() == reference_logits.argmax()
    if source == "auto":  # the GGUF's own blocks either way: the same numbers
        torch.testing.assert_close(logits, reference_logits, atol=0.1, rtol=0.01)
    else:  # q8_0 blocks quantized from float32 or from bf16-rounded weights: within bf16 noise (logits up to ~22;
        # float32- and bfloat16-loaded models differ by up to 1.15, 0.39 on average; a crash or garbage by far more)
        diff = (logits - reference_logits).abs()
        assert diff.max() < 2.5 and diff.mean() < 0.8, (diff.max(), diff.mean())
        assert F.cosine_similarity(logits, reference_logits, dim=0) > 0.99


@native
@pytest.mark.parametrize("source, cast", [("q8_0", "to"), ("auto", "bfloat16")])  # each cast once: loads are slow
def test_a_float32_quantized_model_cast_to_bfloat16_decodes(loaded, source, cast):
    model = copy.deepcopy(loaded(source, torch.float32)[0])
    model = model.to(torch.bfloat16) if cast == "to" else model.bfloat16()
    # the same model loaded in bfloat16 (q8_0: quantized from bf16-rounded weights, so blocks may differ slightly)
    check_cast(model, torch.bfloat16, loaded(source, torch.bfloat16)[1], source)


@native
@pytest.mark.parametrize("source, cast", [("q8_0", "float"), ("auto", "to")])
def test_a_bfloat16_quantized_model_cast_to_float32_decodes(loaded, source, cast):
    model = copy.deepcopy(loaded(source, torch.bfloat16)[0])
    model = model.to(torch.float32) if cast == "to" else model.float()
    check_cast(model, torch.float32, loaded(source, torch.float32)[1], source)
