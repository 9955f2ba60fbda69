"""A llama.cpp GGUF file's header as gqa reads it, without torch: its metadata as a ``ModelConfig``, its tensors by HF
name with their torch shapes, and the dtype each is read in (by torch's name for it). ``gguf_file`` reads the
tensors themselves.

GGUF lists a tensor's dims fastest-first (``ne0`` = columns), the reverse of torch's shape
(``GGUFTensorInfo.shape``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..models.checked import derived_head_dim, positive_int
from ..models.config import ModelConfig
from ..models.hf_config import FULL, GEMMA_ACT, SLIDING
from .expected import check_tensors
from .gguf_reader import GGUFFile, GGUFTensorInfo

# llama.cpp's architecture name -> gqa's (HF's model_type); a Mistral GGUF is written as "llama", without its window
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "smollm3": "smollm3",
}
# the architectures whose q/k rows llama.cpp's converter permutes for its interleaved ("normal") RoPE (gqa's names)
PERMUTED_QK = ("llama", "smollm3")
# llama.cpp's fixed facts of these families, not in their files: every n-th layer global (Gemma), every 4th layer
# without RoPE (SmolLM3), the RoPE base of Gemma 3's sliding layers, the layer counts of the 27B models (whose scores
# scale by hidden / heads instead of head_dim)
_GEMMA_PATTERN = {"gemma2": 2, "gemma3": 6}
_SMOLLM3_NOPE_EVERY = 4
_GEMMA3_LOCAL_THETA = 10000.0
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

__all__ = [
    "SUPPORTED_QUANT_TYPES",
    "gguf_config",
    "gguf_tensors",
    "hf_name",
    "open_gguf",
    "stored_dtype_name",
]

# Every type read: floats, the block formats gqa keeps (gqa.models.quantized.FORMATS), and Q2_K/Q3_K (dequantized)
SUPPORTED_QUANT_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)
_FLOAT_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # GGUF float type -> torch name

_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {  # Llama's, Qwen's and SmolLM3's layers
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA_LAYER_NAMES = {  # Gemma's: norms on both sides of attention and the MLP (their weights stored plus one)
    **{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm.weight"},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_MISSING = object()


def hf_name(gguf_name: str, gemma: bool = False) -> str | None:
    """The HF name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``), or
    ``None`` for a name outside the family's tensors (``gemma``: Gemma's layer, where ``ffn_norm`` is the norm before
    the MLP and two more norms follow attention and the MLP)."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    names = _GEMMA_LAYER_NAMES if gemma else _LAYER_NAMES
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def open_gguf(path: Path) -> GGUFFile:
    """The checked header of the GGUF file ``path``; a missing, empty, non-GGUF, truncated or malformed file is a
    ``ValueError``."""
    return GGUFFile(path)


def _meta(reader: GGUFFile, key: str, path: Path, default: Any = _MISSING) -> Any:
    value = reader.metadata.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise ValueError(f"{path}: GGUF metadata lacks the required key {key!r}")
        return default
    return value


def _size(reader: GGUFFile, key: str, path: Path, default: Any = _MISSING) -> Any:
    """A count or a size from the metadata as an int >= 1: a zero, negative or fractional one is a ``ValueError``
    naming ``key`` (never a division by zero later); ``default`` where the key is absent (None stays None)."""
    value = _meta(reader, key, path, default)
    return value if value is None else positive_int(value, key)


def _rope_scaling(reader: GGUFFile, arch: str, path: Path) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from ``{arch}.rope.scaling.*`` (or the older ``{arch}.rope.scale_linear``)."""
    if "rope_freqs.weight" in {t.name for t in reader.tensors}:
        raise ValueError(
            f"{path}: per-dimension rope frequency factors (tensor rope_freqs.weight, Llama-3.1-style rope scaling) "
            "are not supported; convert the HF checkpoint instead"
        )
    kind = _meta(reader, f"{arch}.rope.scaling.type", path, None)
    if kind in (None, "none"):
        linear = _meta(reader, f"{arch}.rope.scale_linear", path, None)
        return {"rope_type": "linear", "factor": float(linear)} if linear not in (None, 1.0) else None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(_meta(reader, f"{arch}.rope.scaling.factor", path))}
    original = _meta(reader, f"{arch}.rope.scaling.original_context_length", path, None)
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _family_fields(reader: GGUFFile, arch: str, path: Path, layers: int, hidden: int, heads: int) -> dict[str, Any]:
    """``ModelConfig`` fields beyond Llama's of a ``gemma2``/``gemma3``/``smollm3`` file, as llama.cpp runs it."""
    if arch == "smollm3":
        return {"rope_layers": [(i + 1) % _SMOLLM3_NOPE_EVERY != 0 for i in range(layers)]}
    if arch not in _GEMMA_PATTERN:
        return {}
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = _meta(reader, key, path, _GEMMA_PATTERN[arch])
    if isinstance(pattern, int):  # every pattern-th layer global
        pattern = positive_int(pattern, key)
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    else:  # one flag per layer (newer files): true where the layer slides
        sliding = [bool(x) for x in pattern]
        if len(sliding) != layers:
            n = len(sliding)
            raise ValueError(f"{path}: {arch}.attention.sliding_window_pattern has {n} flags for {layers} layers")
    softcaps = [_meta(reader, f"{arch}.{k}_logit_softcapping", path, None) for k in ("attn", "final")]
    head_dim = _meta(reader, f"{arch}.attention.key_length", path, None) or hidden // heads
    fields: dict[str, Any] = {
        "hidden_act": GEMMA_ACT,
        "layer_types": [SLIDING if s else FULL for s in sliding],
        "sliding_window": _size(reader, f"{arch}.attention.sliding_window", path),
        # llama.cpp: the 27B models scale scores by (hidden / heads) ** -0.5, the others by head_dim's
        "query_pre_attn_scalar": float(hidden // heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim),
        "attn_softcap": None if softcaps[0] is None else float(softcaps[0]),
        "final_softcap": None if softcaps[1] is None else float(softcaps[1]),
    }
    if arch == "gemma3":
        fields["rope_local_theta"] = _GEMMA3_LOCAL_THETA
    return fields


def gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    """The ``ModelConfig`` described by a GGUF file's metadata (``tie_word_embeddings``: no ``output.weight``)."""
    arch = _meta(reader, "general.architecture", path)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    names = {t.name for t in reader.tensors}
    tokens = reader.metadata.get("tokenizer.ggml.tokens")
    eos = [_meta(reader, f"tokenizer.ggml.{k}_token_id", path, None) for k in ("eos", "eot", "eom")]
    try:
        vocab = _size(reader, f"{arch}.vocab_size", path, len(tokens) if isinstance(tokens, list) else _MISSING)
        hidden = _size(reader, f"{arch}.embedding_length", path)
        heads_key, kv_key = f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv"
        heads = _size(reader, heads_key, path)
        kv_heads = _size(reader, kv_key, path, heads)
        if heads % kv_heads:
            raise ValueError(f"{heads_key} ({heads}) must be divisible by {kv_key} ({kv_heads})")
        head_dim = (
            _size(reader, f"{arch}.attention.key_length", path, None)
            or _size(reader, f"{arch}.rope.dimension_count", path, None)
            or derived_head_dim(hidden, heads, f"{arch}.embedding_length", heads_key)
        )
        layers = _size(reader, f"{arch}.block_count", path)
        return ModelConfig(
            arch=GGUF_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_size(reader, f"{arch}.feed_forward_length", path),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", path)),
            rope_theta=float(_meta(reader, f"{arch}.rope.freq_base", path, 10000.0)),
            rope_scaling=_rope_scaling(reader, arch, path),
            max_position_embeddings=_size(reader, f"{arch}.context_length", path, 2048),
            tie_word_embeddings="output.weight" not in names,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
            output_bias="blk.0.attn_output.bias" in names,
            qk_norm=arch in ("qwen3", "gemma3"),
            bos_token_id=_meta(reader, "tokenizer.ggml.bos_token_id", path, None),
            eos_token_id=list(dict.fromkeys(i for i in eos if i is not None)),
            pad_token_id=_meta(reader, "tokenizer.ggml.padding_token_id", path, None),
            **_family_fields(reader, arch, path, layers, hidden, heads),
        )
    except (TypeError, ValueError) as e:
        msg = str(e) if str(e).startswith(str(path)) else f"{path}: bad GGUF metadata: {e}"
        raise ValueError(msg) from None


def gguf_tensors(
    path: Path | GGUFFile,
) -> tuple[GGUFFile, ModelConfig, dict[str, GGUFTensorInfo], dict[str, tuple[int, ...]]]:
    """Open (unless given opened) and check a GGUF file of a supported architecture without reading its weights: the
    header, the config, and by HF name the file's tensors and their torch shapes (``ValueError`` for a damaged file,
    an unsupported architecture or quantization type, or missing/unexpected/misshapen tensors)."""
    reader = path if isinstance(path, GGUFFile) else open_gguf(path)
    path = reader.path
    cfg = gguf_config(reader, path)
    by_name: dict[str, GGUFTensorInfo] = {}
    unknown = []
    for t in reader.tensors:
        name = hf_name(t.name, cfg.gemma)
        if name is None:
            unknown.append(t.name)
        elif t.type.name not in SUPPORTED_QUANT_TYPES:
            raise ValueError(
                f"{path}: tensor {t.name} has unsupported type {t.type.name}; "
                f"supported: {', '.join(sorted(SUPPORTED_QUANT_TYPES))}"
            )
        else:
            by_name[name] = t
    if unknown:
        raise ValueError(f"{path}: tensors outside the {cfg.arch} layout: {', '.join(unknown)}")
    shapes = {name: t.shape for name, t in by_name.items()}
    check_tensors(cfg, shapes, str(path))
    return reader, cfg, by_name, shapes


def stored_dtype_name(t: GGUFTensorInfo) -> str:
    """torch's name for the dtype a GGUF tensor is read in: its own for F32/F16/BF16, ``"float32"`` for quantized
    blocks."""
    return _FLOAT_NAMES.get(t.type.name, "float32")
