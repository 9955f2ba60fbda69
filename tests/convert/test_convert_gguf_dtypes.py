"""Converting a GGUF with mixed tensor types (llama.cpp's usual layout: BF16 or F16 matrices, F32 norms and biases):
with ``--dtype source`` every tensor keeps its own dtype, so an expansion (exact) writes the untouched tensors bit for
bit and computes the logits of the source; an explicit ``--dtype`` casts every tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open

import gqa
from gqa.cli import main as cli
from gqa.convert.streaming import stream_convert
from gqa.convert.writer import write_config
from gqa.loaders.lazy import open_lazy

H, KV, D, E, F, V, LAYERS = 6, 2, 4, 24, 64, 32, 2  # 6 query heads, 2 KV heads; expanded to 6
pytestmark = pytest.mark.filterwarnings("ignore:.*no usable tokenizer:UserWarning")  # the GGUF files have none
IDS = torch.tensor([[1, 5, 3, 9, 4, 7, 2, 8, 6, 0, 3, 31], [4, 4, 7, 1, 9, 3, 5, 2, 2, 6, 8, 17]])  # (B=2, L=12)

_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
          "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}  # fmt: skip
_LAYER |= {f"self_attn.{p}_proj.{kind}": f"attn_{p}.{kind}" for p in "qkv" for kind in ("weight", "bias")}


def _permute(x: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row permutation of a llama q/k projection (``convert_hf_to_gguf.py``'s ``LlamaModel.permute``)."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def write_mixed_gguf(path: Path, arch: str, matrix: Q, quantized: tuple[str, ...] = ()) -> Path:
    """A random untied 2-layer ``arch`` (llama: no biases; qwen2: q/k/v biases) GGUF: 2-D weights of type ``matrix``
    (BF16 or F16; those named in ``quantized`` Q8_0), norms (around 1) and biases F32, every value random."""
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,), "lm_head.weight": (V, E)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,)}
        shapes |= {p + "self_attn.q_proj.weight": (H * D, E), p + "self_attn.k_proj.weight": (KV * D, E)}
        shapes |= {p + "self_attn.v_proj.weight": (KV * D, E), p + "self_attn.o_proj.weight": (E, H * D)}
        shapes |= {p + "mlp.gate_proj.weight": (F, E), p + "mlp.up_proj.weight": (F, E)}
        shapes |= {p + "mlp.down_proj.weight": (E, F)}
        if arch == "qwen2":
            shapes |= {p + "self_attn.q_proj.bias": (H * D,), p + "self_attn.k_proj.bias": (KV * D,)}
            shapes |= {p + "self_attn.v_proj.bias": (KV * D,)}
    w = gguf.GGUFWriter(str(path), arch)
    meta = {"block_count": LAYERS, "context_length": 64, "embedding_length": E, "feed_forward_length": F,
            "attention.head_count": H, "attention.head_count_kv": KV, "rope.dimension_count": D,
            "vocab_size": V}  # fmt: skip
    for key, value in meta.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=g) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0)
        if arch == "llama" and ".q_proj." in name:
            x = _permute(x, H)
        elif arch == "llama" and ".k_proj." in name:
            x = _permute(x, KV)
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{_LAYER[rest]}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]  # fmt: skip
        if len(shape) == 1:
            w.add_tensor(gname, x.numpy())  # F32
        elif any(q in name for q in quantized):
            w.add_tensor(gname, gguf.quants.quantize(x.numpy(), Q.Q8_0), raw_dtype=Q.Q8_0)
        elif matrix == Q.BF16:
            w.add_tensor(gname, x.bfloat16().view(torch.int16).numpy(), raw_dtype=Q.BF16)
        else:
            w.add_tensor(gname, x.half().numpy())  # F16
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def stored(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of ``folder/model.safetensors`` as stored."""
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def logits(path: Path) -> torch.Tensor:
    """``(B, L, V)`` float32 logits of the model at ``path`` on ``IDS``."""
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    with torch.inference_mode():
        return model(IDS)


def is_kv(name: str) -> bool:
    return ".k_proj." in name or ".v_proj." in name


def check_expanded(out: dict[str, torch.Tensor], source: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype]):
    """``out`` (6 KV heads) holds ``source``'s tensors (2 KV heads) in ``dtypes``: every untouched one equal to the
    source's cast, k/v projections and biases each KV head repeated 3 times."""
    assert out.keys() == source.keys()
    for name, src in source.items():
        got, want = out[name], src.to(dtypes[name])
        assert got.dtype == dtypes[name], name
        if is_kv(name):
            want = want.unflatten(0, (KV, D)).repeat_interleave(H // KV, 0).flatten(0, 1)
        assert torch.equal(got, want), name


@pytest.mark.parametrize(
    ("arch", "matrix", "quantized"),
    [("llama", Q.BF16, ("down_proj",)), ("qwen2", Q.BF16, ()), ("qwen2", Q.F16, ("down_proj",))],
    ids=["llama-bf16-q8_0", "qwen2-bf16", "qwen2-f16-q8_0"],
)
def test_expansion_keeps_each_tensor_dtype(tmp_path, arch, matrix, quantized):
    """``gqa convert --kv-heads 6`` (``--dtype source``): F32 norms and biases stay F32 bit for bit next to BF16/F16
    matrices, expanded k/v keep their source dtype, Q8_0 matrices become F32; the logits are the source's."""
    src = write_mixed_gguf(tmp_path / f"{arch}.gguf", arch, matrix, quantized)
    source = open_lazy(src)
    want = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[source.dtype]
    assert source.dtype == (torch.bfloat16 if matrix == Q.BF16 else torch.float16)
    assert cli(["convert", str(src), str(tmp_path / "out"), "--kv-heads", "6", "--device", "cpu"]) == 0
    out = stored(tmp_path / "out")
    check_expanded(out, source.read(source.shapes), source.dtypes)
    norms = [n for n in out if n.endswith("norm.weight")]
    biases = [n for n in out if n.endswith(".bias")]
    assert len(norms) == 2 * LAYERS + 1 and len(biases) == (3 * LAYERS if arch == "qwen2" else 0)
    assert all(out[n].dtype == torch.float32 for n in norms + biases)
    for name, t in out.items():
        if t.ndim == 2:
            assert t.dtype == (torch.float32 if any(q in name for q in quantized) else source.dtype), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_key_value_heads"] == 6 and config.get("dtype", config.get("torch_dtype")) == want
    torch.testing.assert_close(logits(tmp_path / "out"), logits(src), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("flag", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)])
def test_explicit_dtype_casts_every_tensor(tmp_path, flag, dtype):
    """``--dtype bf16`` / ``fp32`` casts every tensor, norms and biases included (fp32 from bf16: exact)."""
    src = write_mixed_gguf(tmp_path / "qwen2.gguf", "qwen2", Q.BF16)
    source = open_lazy(src)
    assert cli(["convert", str(src), str(tmp_path / "out"), "--kv-heads", "6", "--dtype", flag, "--device", "cpu"]) == 0
    out = stored(tmp_path / "out")
    check_expanded(out, source.read(source.shapes), dict.fromkeys(source.shapes, dtype))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == str(dtype).removeprefix("torch.")
    if dtype == torch.float32:
        torch.testing.assert_close(logits(tmp_path / "out"), logits(src), rtol=0, atol=1e-5)


def test_stream_convert_default_keeps_each_dtype(tmp_path):
    """``stream_convert(dtype=None)`` writes each tensor in ``write_dtypes(source)``: the source's own."""
    src = write_mixed_gguf(tmp_path / "qwen2.gguf", "qwen2", Q.BF16)
    source = open_lazy(src)
    (tmp_path / "out").mkdir()
    cfg, _ = stream_convert(source, tmp_path / "out", 6, "mean")
    write_config(tmp_path / "out", cfg, source.dtype)
    check_expanded(stored(tmp_path / "out"), source.read(source.shapes), source.dtypes)
    torch.testing.assert_close(logits(tmp_path / "out"), logits(src), rtol=0, atol=1e-5)
    from gqa.convert.streaming import write_dtypes

    assert write_dtypes(source) == source.dtypes
    assert write_dtypes(source, torch.float16) == dict.fromkeys(source.shapes, torch.float16)
