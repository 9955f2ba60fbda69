"""Model loaders (GGUF and HF folders) and the tokenizer, against transformers and independent references.

Quantized GGUF tensors are checked two ways: types ``gguf.quants`` can quantize start from random float data and must
come back within that type's quantization error; K-quants (which it cannot quantize) start from random blocks and
must match the block formulas of ggml, written out here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

import gqa
from gqa.loaders import default_model_path, load_tokenizer, read_model
from gqa.loaders.gguf_file import unpermute_qk_
from gqa.loaders.lazy import open_lazy
from tests.helpers.k_quants import quantize as quantize_blocks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

# ---------------------------------------------------------------------------------------------------------------------
# Helpers: tiny HF models, and writing GGUF files the way llama.cpp's converter does


def tiny_hf(arch: str = "llama", tied: bool = False, **sizes) -> torch.nn.Module:
    """A random transformers Llama/Qwen2 causal LM; ``sizes`` override the default (2 layers, hidden 16, GQA 4/2)."""
    torch.manual_seed(0)
    kw = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)
    kw |= dict(num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tied)
    kw |= dict(bos_token_id=1, eos_token_id=2) | sizes
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    if arch == "qwen3":
        config = transformers.Qwen3Config(**kw, head_dim=4, rope_theta=10000.0)  # as gguf_meta writes it
        model = transformers.Qwen3ForCausalLM(config).eval()
        with torch.no_grad():  # the q/k norms start at ones: make them tell q from k
            for name, p in model.named_parameters():
                if "_norm" in name:
                    p.uniform_(0.5, 1.5)
        return model
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw)).eval()


def saved_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of ``model`` stores: its state dict less a tied ``lm_head.weight``."""
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        del sd["lm_head.weight"]
    return sd


_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GGUF_TOP["lm_head.weight"] = "output.weight"
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    if hf in _GGUF_TOP:
        return _GGUF_TOP[hf]
    i, module, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf).groups()
    return f"blk.{i}.{_GGUF_LAYER[module]}.{kind}"


def llamacpp_permute(x: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): per head, rows (2, D/2) -> (D/2, 2)."""
    return x.reshape(n_heads, 2, x.shape[0] // n_heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def unpermute_by_index(x: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of ``llamacpp_permute`` through the row index, independent of the loader's reshape."""
    idx = llamacpp_permute(np.arange(x.shape[0]), n_heads)  # GGUF row j holds HF row idx[j]
    out = np.empty_like(x)
    out[idx] = x
    return out


def gguf_meta(hf_cfg, arch: str) -> dict[str, object]:
    c = hf_cfg
    return {
        f"{arch}.block_count": c.num_hidden_layers,
        f"{arch}.context_length": c.max_position_embeddings,
        f"{arch}.embedding_length": c.hidden_size,
        f"{arch}.feed_forward_length": c.intermediate_size,
        f"{arch}.attention.head_count": c.num_attention_heads,
        f"{arch}.attention.head_count_kv": c.num_key_value_heads,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": c.rms_norm_eps,
        f"{arch}.rope.dimension_count": c.hidden_size // c.num_attention_heads,
        f"{arch}.vocab_size": c.vocab_size,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def write_gguf(path: Path, arch: str, meta: dict[str, object], arrays: dict[str, tuple[np.ndarray, Q | None]]) -> Path:
    """A GGUF file with ``meta`` (int -> uint32, float -> float32, str, list -> array) and ``arrays``: GGUF name ->
    (numpy array in torch layout, or the encoded bytes of a quantized type, which is then given)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    for name, (array, qtype) in arrays.items():
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def encode_model(sd: dict[str, torch.Tensor], hf_cfg, arch: str, qtype=lambda name: Q.F32):
    """GGUF arrays for an HF state dict: llama q/k rows permuted as llama.cpp does; ``qtype(hf_name)`` per tensor."""
    arrays = {}
    for name, t in sd.items():
        x = t.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            x = llamacpp_permute(x, hf_cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            x = llamacpp_permute(x, hf_cfg.num_key_value_heads)
        qt = qtype(name) if x.ndim == 2 else Q.F32
        if qt == Q.F32:
            arrays[gguf_name(name)] = (x, None)
        elif qt == Q.F16:
            arrays[gguf_name(name)] = (x.astype(np.float16), None)
        else:
            arrays[gguf_name(name)] = (quantize_blocks(x, qt), qt)
    return arrays


def write_model_gguf(path: Path, model: torch.nn.Module, qtype=lambda name: Q.F32, drop=(), **meta) -> Path:
    arch = model.config.model_type
    arrays = encode_model(saved_state(model), model.config, arch, qtype)
    for name in drop:
        del arrays[name]
    return write_gguf(path, arch, gguf_meta(model.config, arch) | meta, arrays)


# ---------------------------------------------------------------------------------------------------------------------
# SmolLM2 (the default model) against transformers' own GGUF loading


@pytest.fixture(scope="module")
def smol():
    return read_model(None)


@pytest.fixture(scope="module")
def smol_tok():
    return load_tokenizer()


def test_default_model_path():
    path = default_model_path()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_smollm2_config(smol):
    cfg, sd = smol
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.rope_theta == 1e5 and cfg.rope_scaling is None and cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings and not cfg.attention_bias and "lm_head.weight" not in sd
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, [2], 2)
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert all(t.dtype == torch.float32 for t in sd.values())


def test_smollm2_weights_match_transformers(smol, hf_smollm2):
    _, sd = smol
    ref = hf_smollm2.state_dict()
    assert set(ref) == set(sd) | {"lm_head.weight"}
    for name, t in sd.items():
        assert t.shape == ref[name].shape, name
        torch.testing.assert_close(t, ref[name], rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(ref["lm_head.weight"], sd["model.embed_tokens.weight"], rtol=0, atol=1e-6)


def test_unpermute_qk_inverts_llamacpp_permute_in_place():
    assert llamacpp_permute(np.arange(4), 1).tolist() == [0, 2, 1, 3]  # rotate-half pairs (0, 2), (1, 3) interleaved
    assert unpermute_qk_(torch.tensor([0, 2, 1, 3]), 1).tolist() == [0, 1, 2, 3]
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):  # float weights and biases, and rows of blocks
        for n_heads, D, rest in [(3, 8, (5,)), (2, 4, ()), (6, 2, (3,))]:
            w = torch.randint(0, 256, (n_heads * D, *rest)).to(dtype)
            permuted = torch.from_numpy(llamacpp_permute(w.float().numpy(), n_heads)).to(dtype)
            expected = torch.from_numpy(unpermute_by_index(permuted.float().numpy(), n_heads)).to(dtype)
            out = unpermute_qk_(permuted, n_heads)
            assert out.data_ptr() == permuted.data_ptr() and out.dtype == dtype  # in place: no second copy
            assert torch.equal(out, w)
            assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------------------------------------------
# Synthetic GGUF files


def test_tiny_llama_gguf_f32_f16_q8_0(tmp_path):
    """2 layers, hidden 16, 4 heads / 2 KV heads, vocab 32; F32 norms and embeddings, F16 projections, Q8_0 down."""
    model = tiny_hf("llama", tied=False)
    qtype = lambda n: Q.Q8_0 if "down_proj" in n else Q.F16 if "_proj" in n else Q.F32  # noqa: E731
    cfg, sd = read_model(write_model_gguf(tmp_path / "tiny.gguf", model, qtype))
    src = saved_state(model)
    assert set(sd) == set(src) and not cfg.tie_word_embeddings
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 16, 4, 2, 4)
    for name, want in src.items():
        got = sd[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        if "down_proj" in name:  # Q8_0: per block of 32, scale amax/127, error at most half a step (+ fp16 scale)
            step = want.abs().amax(dim=-1, keepdim=True) / 127
            assert ((got - want).abs() <= 0.6 * step).all(), name
        elif "_proj" in name:
            assert torch.equal(got, want.half().float()), name
        else:
            assert torch.equal(got, want), name


def test_qwen2_gguf_is_not_permuted(tmp_path):
    model = tiny_hf("qwen2", tied=True)
    cfg, sd = read_model(write_model_gguf(tmp_path / "qwen.gguf", model))
    assert cfg.arch == "qwen2" and cfg.attention_bias and cfg.tie_word_embeddings
    src = saved_state(model)
    assert set(sd) == set(src)
    for name, want in src.items():
        assert torch.equal(sd[name], want), name


def test_qwen3_gguf_keeps_its_qk_norms_and_matches_transformers(tmp_path):
    """llama.cpp's qwen3 architecture: q/k norms as attn_q_norm / attn_k_norm, q/k not permuted; logits as HF's."""
    model = tiny_hf("qwen3", tied=True)
    path = write_model_gguf(tmp_path / "qwen3.gguf", model)
    cfg, sd = read_model(path)
    assert cfg.arch == "qwen3" and cfg.qk_norm and not cfg.attention_bias
    src = saved_state(model)
    assert set(sd) == set(src)
    ours = gqa.load_model(path, tokenizer=False, dtype=torch.float32)
    ids = torch.randint(3, 32, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), model(ids).logits, atol=1e-5, rtol=1e-5)


def test_gguf_rope_scaling_and_folder(tmp_path):
    model = tiny_hf("llama")
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    write_model_gguf(tmp_path / "m.gguf", model, **meta)
    cfg, _ = read_model(tmp_path)  # a folder holding exactly one .gguf
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


# Quantizable by gguf.quants: per-block bound on |dequantized - source| as a multiple of the block's max |x|.
_BOUNDS = {Q.Q8_0: 0.6 / 127, Q.Q4_0: 1.05 / 8, Q.Q5_0: 1.05 / 16, Q.Q4_1: 1.2 / 15, Q.Q5_1: 1.2 / 31}


@pytest.mark.parametrize("qtype", [*_BOUNDS, Q.BF16], ids=lambda q: q.name)
def test_gguf_quantized_types_within_error(tmp_path, qtype):
    model = tiny_hf("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    with torch.no_grad():
        for p in model.parameters():
            scale = 0.1 + torch.rand(p.shape[0], *[1] * (p.dim() - 1))  # rows of varied scale (fp16 scales stay normal)
            p.copy_(torch.randn_like(p) * scale)
    _, sd = read_model(write_model_gguf(tmp_path / f"{qtype.name}.gguf", model, lambda n: qtype))
    for name, want in saved_state(model).items():
        got = sd[name]
        assert got.shape == want.shape, name
        if want.dim() == 1:
            assert torch.equal(got, want), name
        elif qtype == Q.BF16:
            assert ((got - want).abs() <= want.abs() * 2**-8).all(), name
        else:
            blocks = want.reshape(want.shape[0], -1, 32)  # (rows, blocks, 32)
            bound = _BOUNDS[qtype] * blocks.abs().amax(dim=-1, keepdim=True)
            err = (got.reshape(blocks.shape) - blocks).abs()
            assert (err <= bound).all(), f"{name}: max error / bound {(err / bound).max():.3f}"


# K-quants: ggml's dequantize_row_q{4,5,6}_K, block of 256 values, vectorized over blocks.


def _f16(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)  # (n, 2) bytes -> (n, 1)


def _scale_min_k4(s: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from the 12 packed bytes."""
    if j < 4:
        return s[:, j] & 63, s[:, j + 4] & 63
    return (s[:, j + 4] & 0xF) | ((s[:, j - 4] >> 6) << 4), (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)


def ref_q4_k(b: np.ndarray) -> np.ndarray:  # d, dmin, scales[12], qs[128]
    d, dmin, s, qs = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16].astype(np.int32), b[:, 16:144].astype(np.int32)
    out = np.empty((len(b), 256), np.float32)
    for j in range(8):
        sc, m = _scale_min_k4(s, j)
        q = qs[:, 32 * (j // 2) : 32 * (j // 2) + 32]
        q = q & 0xF if j % 2 == 0 else q >> 4
        out[:, 32 * j : 32 * j + 32] = d * sc[:, None] * q - dmin * m[:, None]
    return out


def ref_q5_k(b: np.ndarray) -> np.ndarray:  # d, dmin, scales[12], qh[32], qs[128]
    d, dmin, s = _f16(b[:, 0:2]), _f16(b[:, 2:4]), b[:, 4:16].astype(np.int32)
    qh, qs = b[:, 16:48].astype(np.int32), b[:, 48:176].astype(np.int32)
    out = np.empty((len(b), 256), np.float32)
    for j in range(8):
        sc, m = _scale_min_k4(s, j)
        q = qs[:, 32 * (j // 2) : 32 * (j // 2) + 32]
        q = (q & 0xF if j % 2 == 0 else q >> 4) + 16 * ((qh >> j) & 1)
        out[:, 32 * j : 32 * j + 32] = d * sc[:, None] * q - dmin * m[:, None]
    return out


def ref_q6_k(b: np.ndarray) -> np.ndarray:  # ql[128], qh[64], scales[16] int8, d
    ql, qh = b[:, 0:128].astype(np.int32), b[:, 128:192].astype(np.int32)
    sc, d = b[:, 192:208].copy().view(np.int8).astype(np.float32), _f16(b[:, 208:210])
    out = np.empty((len(b), 256), np.float32)
    l = np.arange(32)  # noqa: E741
    for n in range(2):  # two halves of 128 values
        lo, hi, s = ql[:, 64 * n : 64 * n + 64], qh[:, 32 * n : 32 * n + 32], sc[:, 8 * n : 8 * n + 8]
        quads = [
            (lo[:, :32] & 0xF) | ((hi & 3) << 4),
            (lo[:, 32:] & 0xF) | (((hi >> 2) & 3) << 4),
            (lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4),
            (lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4),
        ]
        for k, q in enumerate(quads):
            out[:, 128 * n + 32 * k + l] = d * s[:, l // 16 + 2 * k] * (q - 32)
    return out


_K_QUANTS = {Q.Q4_K: (144, ref_q4_k, [0, 2]), Q.Q5_K: (176, ref_q5_k, [0, 2]), Q.Q6_K: (210, ref_q6_k, [208])}


@pytest.mark.parametrize("qtype", list(_K_QUANTS), ids=lambda q: q.name)
def test_gguf_k_quants_match_ggml_formulas(tmp_path, qtype):
    size, ref, f16_offsets = _K_QUANTS[qtype]
    model = tiny_hf("llama", hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4)
    rng = np.random.default_rng(0)
    arrays, expected = {}, {}
    for name, t in saved_state(model).items():
        if t.dim() == 1:
            arrays[gguf_name(name)] = (t.numpy(), None)
            continue
        rows, cols = t.shape
        blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)
        for off in f16_offsets:  # finite super-block scales
            blocks[:, off : off + 2] = rng.uniform(1e-3, 1e-2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
        arrays[gguf_name(name)] = (blocks.reshape(rows, -1), qtype)
        x = ref(blocks).reshape(rows, cols)  # GGUF row order
        if ".q_proj." in name or ".k_proj." in name:
            x = unpermute_by_index(x, 4 if ".q_proj." in name else 2)
        expected[name] = torch.from_numpy(x)
    path = write_gguf(tmp_path / f"{qtype.name}.gguf", "llama", gguf_meta(model.config, "llama"), arrays)
    _, sd = read_model(path)
    for name, want in expected.items():
        torch.testing.assert_close(sd[name], want, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------------------------------
# HF checkpoint folders


@pytest.mark.parametrize(
    ("arch", "tied", "shard"),
    [("llama", False, False), ("llama", True, True), ("qwen2", True, False), ("qwen2", False, True)],
)
def test_hf_folder_roundtrip(tmp_path, arch, tied, shard):
    model = tiny_hf(arch, tied=tied)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="4KB" if shard else "50GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    cfg, sd = read_model(tmp_path)
    c = model.config
    assert (cfg.arch, cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (arch, 32, 16, 32)
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 4)
    assert cfg.tie_word_embeddings == tied and cfg.attention_bias == (arch == "qwen2")
    assert cfg.rms_norm_eps == c.rms_norm_eps and cfg.max_position_embeddings == c.max_position_embeddings
    src = saved_state(model)
    assert set(sd) == set(src)
    for name, want in src.items():
        assert torch.equal(sd[name], want), name


# ---------------------------------------------------------------------------------------------------------------------
# Bad files


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_model_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_hf("llama"))


@pytest.mark.parametrize("keep", [3, 100, 0.6])
def test_truncated_gguf(tmp_path, tiny_gguf, keep):
    data = tiny_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*(truncated or malformed|not a GGUF)"):
        read_model(path)


def test_gguf_bad_magic(tmp_path, tiny_gguf):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + tiny_gguf.read_bytes()[4:])
    with pytest.raises(ValueError, match=r"bad\.gguf: not a GGUF file: it starts with b'GGML'"):
        read_model(path)


def test_gguf_missing_tensor(tmp_path):
    path = write_model_gguf(tmp_path / "m.gguf", tiny_hf("llama"), drop=["blk.1.ffn_up.weight"])
    with pytest.raises(ValueError, match=r"m\.gguf: 1 tensor\(s\) missing: model\.layers\.1\.mlp\.up_proj\.weight"):
        read_model(path)


def test_gguf_shape_mismatch(tmp_path):
    path = write_model_gguf(tmp_path / "m.gguf", tiny_hf("llama"), **{"llama.feed_forward_length": 48})
    with pytest.raises(ValueError, match=r"gate_proj\.weight has shape \(32, 16\), expected \(48, 16\)"):
        read_model(path)


def test_gguf_unsupported_architecture(tmp_path):
    meta = gguf_meta(tiny_hf("llama").config, "gemma")
    path = write_gguf(tmp_path / "g.gguf", "gemma", meta, {"token_embd.weight": (np.zeros((32, 16), np.float32), None)})
    with pytest.raises(
        ValueError, match=r"unsupported GGUF architecture 'gemma'; supported: llama, qwen2, qwen3, gemma2, .*, smollm3"
    ):
        read_model(path)


def test_gguf_unsupported_quant_type(tmp_path):
    model = tiny_hf("llama")
    arrays = encode_model(saved_state(model), model.config, "llama")
    arrays["blk.0.ffn_down.weight"] = (np.zeros((16, 18), np.uint8), Q.IQ4_NL)  # 16 rows of one 32-value block
    path = write_gguf(tmp_path / "iq.gguf", "llama", gguf_meta(model.config, "llama"), arrays)
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_down\.weight has unsupported type IQ4_NL; supported:"):
        read_model(path)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ("rope_freqs.weight", r"rope_freqs\.weight, Llama-3\.1-style rope scaling\) are not supported"),
        ("blk.0.ffn_gate_exps.weight", r"tensors outside the llama layout: blk\.0\.ffn_gate_exps\.weight"),
        ("blk.0.attn_q_norm.weight", r"unexpected tensor\(s\) for a llama model .*self_attn\.q_norm\.weight"),
    ],
)
def test_gguf_unexpected_tensor(tmp_path, extra, match):
    model = tiny_hf("llama")
    arrays = encode_model(saved_state(model), model.config, "llama") | {extra: (np.ones(2, np.float32), None)}
    path = write_gguf(tmp_path / "x.gguf", "llama", gguf_meta(model.config, "llama"), arrays)
    with pytest.raises(ValueError, match=match):
        read_model(path)


def test_bad_paths(tmp_path, tiny_gguf):
    with pytest.raises(ValueError, match="no such file or folder"):
        read_model(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"no config\.json"):
        read_model(tmp_path)
    shutil.copy(tiny_gguf, tmp_path / "a.gguf")
    shutil.copy(tiny_gguf, tmp_path / "b.gguf")
    with pytest.raises(ValueError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\)"):
        read_model(tmp_path)


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    tiny_hf("llama").save_pretrained(tmp_path / "m")
    return tmp_path / "m"


@pytest.mark.parametrize(
    ("dtype", "want"),
    [("fp32", torch.float32), ("bf16", torch.bfloat16), ("FP16", torch.float16), ("bfloat16", torch.bfloat16),
     (" Float16 ", torch.float16), (torch.bfloat16, torch.bfloat16)],
)  # fmt: skip
def test_load_model_takes_the_clis_dtype_names(hf_dir, dtype, want):
    import gqa

    model = gqa.load_model(hf_dir, tokenizer=False, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {want}


@pytest.mark.parametrize("dtype", ["fp8", "int8", "float", ""])
def test_load_model_refuses_other_dtype_names_naming_dtype(hf_dir, dtype):
    import gqa

    with pytest.raises(
        ValueError, match=rf"dtype {re.escape(repr(dtype))} is not a dtype's name; choose from auto, fp32"
    ):
        gqa.load_model(hf_dir, tokenizer=False, dtype=dtype)


def test_hf_folder_bad_config(hf_dir):
    (hf_dir / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json: not a readable JSON file"):
        read_model(hf_dir)
    (hf_dir / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config\.json: unsupported model_type 'gpt2'"):
        read_model(hf_dir)


@pytest.mark.parametrize("damage", ["garbage", "truncate"])
def test_hf_folder_corrupt_safetensors(hf_dir, damage):
    file = hf_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(b"\x00garbage" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        read_model(hf_dir)


def test_hf_folder_missing_shard(tmp_path):
    tiny_hf("llama").save_pretrained(tmp_path, max_shard_size="4KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=re.escape(shard.name) + ": safetensors shard not found"):
        read_model(tmp_path)


def test_hf_folder_missing_and_misshapen_tensor(hf_dir):
    file = hf_dir / "model.safetensors"
    sd = load_file(file)
    save_file({k: v for k, v in sd.items() if k != "model.layers.1.self_attn.v_proj.weight"}, file)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) missing: model\.layers\.1\.self_attn\.v_proj\.weight"):
        read_model(hf_dir)
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 16)
    save_file(sd, file)
    with pytest.raises(ValueError, match=r"k_proj\.weight has shape \(16, 16\), expected \(8, 16\) from the config"):
        read_model(hf_dir)


# ---------------------------------------------------------------------------------------------------------------------
# Sizes nothing may divide by: zero, negative or fractional counts are a ValueError naming the file and the key

POSITIVE = "must be a positive integer, got"
DIVISIBLE = r"\((\d+)\) must be divisible by "


@pytest.mark.parametrize(
    ("arch", "change", "match"),
    [
        ("llama", {"num_attention_heads": 0}, f"num_attention_heads {POSITIVE} 0"),
        ("llama", {"num_key_value_heads": 0}, f"num_key_value_heads {POSITIVE} 0"),
        ("llama", {"head_dim": 0}, f"head_dim {POSITIVE} 0"),
        ("llama", {"hidden_size": 0}, f"hidden_size {POSITIVE} 0"),
        ("llama", {"num_hidden_layers": -2}, f"num_hidden_layers {POSITIVE} -2"),
        ("llama", {"num_attention_heads": 4.5}, rf"num_attention_heads {POSITIVE} 4\.5"),
        ("llama", {"num_key_value_heads": "2"}, f"num_key_value_heads {POSITIVE} '2'"),
        ("llama", {"num_key_value_heads": 3}, rf"num_attention_heads {DIVISIBLE}num_key_value_heads \(3\)"),
        ("llama", {"hidden_size": 18, "head_dim": None}, rf"hidden_size {DIVISIBLE}num_attention_heads \(4\)"),
        ("mistral", {"sliding_window": 0}, f"sliding_window {POSITIVE} 0"),
        ("gemma2", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a finite number > 0, got 0"),
        ("gemma3_text", {"sliding_window_pattern": 0}, f"sliding_window_pattern {POSITIVE} 0"),
        ("smollm3", {"no_rope_layer_interval": 0}, f"no_rope_layer_interval {POSITIVE} 0"),
    ],
)
def test_bad_sizes_in_config_json_name_the_file_and_key(tmp_path, arch, change, match):
    raw = {"model_type": arch, "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw | change))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "config.json")) + ": " + match):
        read_model(tmp_path)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("attention.head_count", 0, f"attention.head_count {POSITIVE} 0"),
        ("attention.head_count_kv", 0, f"attention.head_count_kv {POSITIVE} 0"),
        ("attention.head_count_kv", 3, rf"attention.head_count {DIVISIBLE}llama\.attention\.head_count_kv \(3\)"),
        ("rope.dimension_count", 0, f"rope.dimension_count {POSITIVE} 0"),
        ("embedding_length", 0, f"embedding_length {POSITIVE} 0"),
        ("block_count", 0, f"block_count {POSITIVE} 0"),
        ("context_length", 0, f"context_length {POSITIVE} 0"),
        ("attention.head_count", 2.5, rf"attention.head_count {POSITIVE} 2\.5"),
    ],
)
def test_bad_sizes_in_gguf_metadata_name_the_file_and_key(tmp_path, key, value, match):
    path = write_model_gguf(tmp_path / "m.gguf", tiny_hf("llama"), **{f"llama.{key}": value})
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": bad GGUF metadata: llama\." + match):
        read_model(path)


@pytest.mark.parametrize("field", ["num_heads", "num_kv_heads", "head_dim", "num_layers", "hidden_size"])
def test_model_config_refuses_zero_sizes(field):
    from gqa.models.config import ModelConfig

    with pytest.raises(ValueError, match=f"{field} {POSITIVE} 0"):
        ModelConfig(**{field: 0})


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer


def test_smollm2_tokenizer(smol_tok):
    tok = smol_tok
    text = "Grouped-query attention shares K/V heads: 9 query, 3 KV. Ünïcödé ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert (tok.eos_token_ids, tok.bos_token_id, tok.pad_token_id, tok.vocab_size) == ([2], 1, 2, 49152)
    chat = tok.apply_chat("What is GQA?")
    rendered = tok.decode(chat, skip_special_tokens=False)
    assert "<|im_start|>user\nWhat is GQA?<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")
    assert tok.apply_chat([{"role": "user", "content": "What is GQA?"}]) == chat


def test_smollm2_tokenizer_matches_transformers(smol_tok):
    path = default_model_path()
    ref = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ["Hello world", "  leading spaces\nand\ttabs", "<|im_start|>user\nhi<|im_end|>", "12345 + 678 = ?"]:
        assert smol_tok.encode(text) == ref.encode(text), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert smol_tok.apply_chat(messages) == ref.encode(want, add_special_tokens=False)


def test_tokenizer_from_hf_folder(hf_dir):
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "grouped": 5, "query": 6}
    raw = RawTokenizer(WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = Whitespace()
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    hf.save_pretrained(hf_dir)
    tok = load_tokenizer(hf_dir)
    assert tok.encode("hello grouped world") == [3, 5, 4]
    assert tok.encode("hello nope") == [3, 0]
    assert tok.decode([1, 3, 4, 2]) == "hello world"
    assert (tok.eos_token_ids, tok.bos_token_id, tok.pad_token_id, tok.vocab_size) == ([2], 1, 2, 7)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat("hello")
    hf.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    hf.save_pretrained(hf_dir)
    assert load_tokenizer(hf_dir).apply_chat("hello world") == [1, 3, 4, 2]


# ---------------------------------------------------------------------------------------------------------------------
# config.json keys left out: transformers' defaults


REQUIRED = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("extra", [{}, {"num_key_value_heads": 2}, {"num_key_value_heads": None, "head_dim": None}])
def test_config_defaults_are_transformers_defaults(arch, extra):
    """A config.json with only the sizes: every other field as transformers' own config class fills it in."""
    from gqa.models.config import ModelConfig

    raw = {"model_type": arch, **REQUIRED, **extra}
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    hf = cls(**{k: v for k, v in raw.items() if k != "model_type"})
    if hf.num_attention_heads % hf.num_key_value_heads:  # Qwen2's default of 32 KV heads does not fit 4 heads
        with pytest.raises(
            ValueError, match=r"num_attention_heads \(4\) must be divisible by num_key_value_heads \(32\)"
        ):
            ModelConfig.from_hf(raw)
        return
    ours = ModelConfig.from_hf(raw)
    eos = hf.eos_token_id
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.num_kv_heads == hf.num_key_value_heads
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        hf.bos_token_id,
        [] if eos is None else [eos] if isinstance(eos, int) else eos,
        hf.pad_token_id,
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_untied_checkpoint_without_the_tie_key_keeps_its_lm_head(tmp_path, arch):
    """config.json without ``tie_word_embeddings`` is untied (transformers' default): ``lm_head.weight`` is loaded,
    not replaced by the embeddings, and the logits are transformers' own."""
    import gqa

    ref = tiny_hf(arch, tied=False)
    ref.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("tie_word_embeddings", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    assert not model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, ref.lm_head.weight)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    ids = torch.randint(0, 32, (2, 7))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [("hidden_act", "gelu", "hidden_act"), ("mlp_bias", True, "mlp_bias"), ("use_sliding_window", True, "sliding")],
)
def test_config_options_this_model_lacks_are_refused(key, value, match):
    from gqa.models.config import ModelConfig

    arch = "qwen2" if key == "use_sliding_window" else "llama"
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({"model_type": arch, **REQUIRED, key: value})


# A Q4_K_M-like mix (llama.cpp's quantizer: Q4_K mostly, Q6_K for v and down in some layers and the output, Q5_0 or
# Q8_0 where a row is not whole 256-value super-blocks)
def q4_k_m(name: str) -> Q:
    if name == "lm_head.weight" or name.endswith(("0.self_attn.v_proj.weight", "1.mlp.down_proj.weight")):
        return Q.Q6_K
    if name.endswith("mlp.up_proj.weight"):
        return Q.Q5_K
    if name.endswith("1.self_attn.o_proj.weight"):
        return Q.Q5_0
    return Q.Q8_0 if "embed" in name else Q.Q4_K


def test_a_k_quant_gguf_stays_in_its_blocks_and_runs_as_transformers_reads_the_file(tmp_path):
    """Mixed Q4_K/Q5_K/Q6_K/Q5_0/Q8_0 tensors (hidden 256: real super-blocks) are kept as the file's bytes with
    ``dtype="auto"``; the model dequantized equals transformers' own GGUF loading of the file, and the kept one
    (int8 activations through the native kernels and the one-call step) stays within int8 rounding of it and decodes
    the same greedy tokens."""
    from gqa.models.quantized import QuantizedLinear, weight_bytes

    ref = tiny_hf("llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    path = write_model_gguf(tmp_path / "m.gguf", ref, q4_k_m)
    reader = gguf.GGUFReader(path)
    file_bytes = {t.name: int(t.n_bytes) for t in reader.tensors}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = gqa.load_model(path, tokenizer=False, dtype="auto")
    assert not [w for w in caught if "no native kernel" in str(w.message)]  # every type kept
    layers = {name: m for name, m in kept.named_modules() if isinstance(m, QuantizedLinear)}
    assert {m.format.name for m in layers.values()} == {"q4_k", "q5_k", "q6_k", "q5_0"}
    assert kept.model.embed_tokens.format.name == "q8_0" and kept.lm_head.format.name == "q6_k"
    assert layers["model.layers.1.mlp.down_proj"].blocks.nbytes == file_bytes["blk.1.ffn_down.weight"]
    assert sum(weight_bytes(kept).get(f, 0) for f in ("q4_k", "q5_k", "q6_k", "q5_0", "q8_0")) == sum(
        n for name, n in file_bytes.items() if "norm" not in name
    )
    by_type = {}
    for t in reader.tensors:
        by_type[t.tensor_type.name.lower()] = by_type.get(t.tensor_type.name.lower(), 0) + int(t.n_bytes)
    assert open_lazy(path).stored_bytes() == by_type  # what gqa info reports
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf").eval()
    dense = gqa.load_model(path, tokenizer=False, dtype=torch.float32)
    ids = torch.randint(3, 64, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(ids).logits
        torch.testing.assert_close(dense(ids), want, atol=1e-4, rtol=1e-4)  # the blocks read as gguf reads them
        got = kept(ids[:, :1], caches=kept.new_caches(2, 4)).float()  # a decode row: the kernels
    assert (got[:, 0] - want[:, 0]).abs().max() < 0.05 * want[:, 0].abs().max()
    prompt = [3, 7, 1, 9, 30, 41]  # (a random model's near ties part the two after ~8 tokens)
    assert kept.generate(prompt, max_new_tokens=8, eos_token_ids=[]) == dense.generate(
        prompt, max_new_tokens=8, eos_token_ids=[]
    )


def test_load_model_defaults_to_auto_as_the_cli_does(tmp_path):
    """``gqa.load_model(path)`` with no dtype is ``dtype="auto"`` (``gqa generate``'s default): a K-quant file's
    blocks are kept where the native kernels run and the activations are ``auto_dtype()``, not a float32 copy 8x the
    file's size; ``dtype=torch.float32`` still gives the float32 model."""
    from gqa import kernels
    from gqa.hardware import auto_dtype
    from gqa.models.quantized import QuantizedLinear

    ref = tiny_hf("llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    path = write_model_gguf(tmp_path / "m.gguf", ref, q4_k_m)
    default = gqa.load_model(path, tokenizer=False)
    assert default.dtype == auto_dtype()
    assert isinstance(default.model.layers[0].mlp.down_proj, QuantizedLinear) == kernels.vectorized()
    dense = gqa.load_model(path, tokenizer=False, dtype=torch.float32)
    assert dense.dtype == torch.float32 and not any(isinstance(m, QuantizedLinear) for m in dense.modules())


def test_kept_blocks_are_the_files_pages_and_q_k_are_reordered_in_them_without_changing_the_file(tmp_path):
    """Every kept weight of a llama GGUF, q and k projections included (their rows reordered in place on the
    copy-on-write map), lies in the file's one memory map: nothing is copied at load, and the file is unchanged."""
    import hashlib

    from gqa.models.quantized import QuantizedEmbedding, QuantizedLinear

    ref = tiny_hf("llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    path = write_model_gguf(tmp_path / "m.gguf", ref, q4_k_m)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    model = gqa.load_model(path, tokenizer=False, dtype="auto")
    blocks = [m.blocks for m in model.modules() if isinstance(m, QuantizedLinear | QuantizedEmbedding)]
    assert any(".q_proj" in n for n, m in model.named_modules() if isinstance(m, QuantizedLinear))
    start = min(b.data_ptr() for b in blocks)
    assert max(b.data_ptr() + b.nbytes for b in blocks) - start <= path.stat().st_size
    with torch.no_grad():
        model(torch.tensor([[3, 5, 7]]))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0])
def test_one_opened_gguf_read_twice_gives_hf_q_k_both_times_and_f16_pages_stay_the_files(tmp_path, qtype):
    """llama q/k rows are put in HF order in place on the file's copy-on-write map where they stay views of it (F32,
    kept Q8_0 blocks) — once per opened file: a second read of it gives the same weights and leaves the first read's
    alone — and in a copy where the caller converts them (F16), so that the map's pages stay the file's."""
    from gqa.loaders import open_model
    from gqa.models.quantized import QuantizedTensor

    ref = tiny_hf("llama", hidden_size=64, intermediate_size=64)  # 4 query heads, 2 KV heads of 16
    path = write_model_gguf(tmp_path / "m.gguf", ref, lambda name: qtype if "_proj" in name else Q.F32)
    keep = qtype == Q.Q8_0
    names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qk"]

    def values(state: dict) -> dict:
        return {n: (state[n].blocks if isinstance(state[n], QuantizedTensor) else state[n]).clone() for n in names}

    source = open_model(path)
    _, first = read_model(source, keep_quantized=keep)
    before = values(first)
    _, second = read_model(source, keep_quantized=keep)
    fresh = values(read_model(path, keep_quantized=keep)[1])  # a file opened anew
    for n in names:
        assert torch.equal(values(first)[n], before[n]) and torch.equal(values(second)[n], fresh[n]), n
        assert torch.equal(before[n], fresh[n]), n
        if not keep:  # HF's own weights (F16: within its rounding)
            torch.testing.assert_close(fresh[n], ref.state_dict()[n], rtol=0, atol=1e-3 if qtype == Q.F16 else 0)
    q = source.tensor("blk.0.attn_q.weight")
    on_disk = np.fromfile(path, dtype=np.uint8, count=q.nbytes, offset=q.offset)
    assert np.array_equal(source.data(q), on_disk) == (qtype == Q.F16)  # only the converted ones left the map alone


def test_the_serving_engine_runs_a_k_quant_gguf_batch_invariantly(tmp_path):
    """The mixed K-quant file through ``gqa serve``'s engine (the paged one-call step over Q4_K/Q5_K/Q6_K/Q5_0
    blocks): three requests served together get the tokens each gets alone, and the ones ``generate`` gives."""
    from gqa import kernels
    from gqa.serve.engine import Engine
    from gqa.serve.sampling import SamplingParams
    from tests.helpers.serving import serve_all

    if not kernels.vectorized():
        pytest.skip("the engine needs the SIMD kernels")
    ref = tiny_hf("llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_attention_heads=4)
    with torch.no_grad():
        ref.lm_head.weight.mul_(30)  # (clear winners: the int8 rounding of a prompt's rows does not flip them)
    model = gqa.load_model(write_model_gguf(tmp_path / "m.gguf", ref, q4_k_m), tokenizer=False, dtype="auto")
    prompts = [[5, 9, 17, 33, 2, 8, 40, 41, 7], [11], list(range(20, 50))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    together = serve_all(Engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=8), prompts, params)
    for prompt, tokens in zip(prompts, together, strict=True):
        assert serve_all(Engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=8), [prompt], params) == [tokens]
        assert tokens == model.generate(prompt, max_new_tokens=12, eos_token_ids=[])


def test_a_k_quant_gguf_decodes_as_llama_cpp_decodes_it(tmp_path):
    """The mixed K-quant file run by llama.cpp itself (where ``llama_cpp`` is installed: ``make llama-cpp``): its
    prompt logits within its int8 rounding of gqa's float32 ones, and the same greedy tokens. (The random model's
    lm_head is scaled up: its logits otherwise sit within rounding of each other.)"""
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = tiny_hf("llama", vocab_size=64, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  max_position_embeddings=512)  # fmt: skip
    with torch.no_grad():
        ref.lm_head.weight.mul_(30)
    vocab = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [f"<t{i}>" for i in range(64)],
             "tokenizer.ggml.scores": [0.0] * 64, "tokenizer.ggml.token_type": [1] * 64}  # fmt: skip
    path = write_model_gguf(tmp_path / "m.gguf", ref, q4_k_m, **vocab)
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=2, verbose=False, logits_all=True)
    kept = gqa.load_model(path, tokenizer=False, dtype="auto")
    dense = gqa.load_model(path, tokenizer=False, dtype=torch.float32)
    for prompt in ([3, 7, 1, 9, 30, 41], [5, 6, 7], [40, 41, 42, 43, 44]):
        llm.reset()
        llm.eval(prompt)
        theirs = torch.from_numpy(np.array(llm.scores[: len(prompt)]))
        with torch.no_grad():
            want = dense(torch.tensor([prompt]))[0]
        assert (theirs - want).abs().max() < 0.03 * want.abs().max()
        greedy = []
        for t in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            greedy.append(int(t))
            if len(greedy) == 12:
                break
        assert kept.generate(prompt, max_new_tokens=12, eos_token_ids=[]) == greedy, prompt


def test_a_type_without_a_native_kernel_is_read_dequantized_and_named_once(tmp_path):
    """Q3_K (no native kernel): with ``dtype="auto"`` the tensor is read as float32 (gguf's dequantization) and one
    warning names the type and the count; the other tensors stay in their blocks."""
    from gqa.models.quantized import QuantizedLinear

    model = tiny_hf("llama", hidden_size=256, intermediate_size=512)
    arrays = encode_model(saved_state(model), model.config, "llama", lambda n: Q.Q4_K if "proj" in n else Q.F32)
    rng = np.random.default_rng(0)
    size = gguf.GGML_QUANT_SIZES[Q.Q3_K][1]
    for name in ("blk.0.ffn_up.weight", "blk.1.ffn_up.weight"):  # (512, 256): 512 super-blocks of random bytes
        blocks = rng.integers(0, 256, (512, size), dtype=np.uint8)
        blocks[:, -2:] = np.full((512, 1), 0.01, np.float16).view(np.uint8)  # a finite scale d
        arrays[name] = (blocks, Q.Q3_K)
    path = write_gguf(tmp_path / "m.gguf", "llama", gguf_meta(model.config, "llama"), arrays)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = gqa.load_model(path, tokenizer=False, dtype="auto")
    said = [str(w.message) for w in caught if "no native kernel" in str(w.message)]
    assert said == ["2 Q3_K tensors: no native kernel for the type, dequantized to float32"], said
    up = kept.model.layers[0].mlp.up_proj
    assert not isinstance(up, QuantizedLinear) and isinstance(kept.model.layers[0].mlp.gate_proj, QuantizedLinear)
    want = gguf.quants.dequantize(arrays["blk.0.ffn_up.weight"][0], Q.Q3_K).reshape(512, 256)
    torch.testing.assert_close(up.weight.float(), torch.from_numpy(want).to(up.weight.dtype).float())


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_q5_gguf_weights_stay_in_their_blocks_and_match_their_float_twin(tmp_path, qtype):
    """Q5_0 (what llama.cpp's Q4_K_M writes for rows not a multiple of 256) and Q5_1 projections are kept as blocks
    with ``dtype="auto"`` (the native kernels multiply them) and give the logits of the same weights dequantized,
    within the int8 rounding of the activations; the decode steps agree with each other on greedy tokens."""
    from gqa.models.quantized import QuantizedLinear

    model = tiny_hf("llama", hidden_size=64, intermediate_size=128)
    path = write_model_gguf(tmp_path / "m.gguf", model, lambda n: qtype if n.endswith("proj.weight") else Q.F32)
    kept = gqa.load_model(path, tokenizer=False, dtype="auto")
    dense = gqa.load_model(path, tokenizer=False, dtype=kept.dtype)  # the blocks dequantized, same compute dtype
    layers = [m for m in kept.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 7 and {m.format.name for m in layers} == {qtype.name.lower()}
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = dense(ids).float(), kept(ids).float()
        step = [kept(ids[:, :1], caches=kept.new_caches(2, 4)).float()]  # one row at a time: the kernel's path
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (step[0][:, 0] - want[:, 0]).abs().max() < 0.05 * want.abs().max()
    prompt = [3, 7, 1, 9]
    assert kept.generate(prompt, max_new_tokens=8, eos_token_ids=[]) == dense.generate(
        prompt, max_new_tokens=8, eos_token_ids=[]
    )
