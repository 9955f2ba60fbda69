"""What gqa reads from and writes to an HF ``config.json``, per architecture: transformers' class names and defaults,
the options this model refuses, and the fields of the families with more than Llama's (Gemma 2/3, SmolLM3)."""

from __future__ import annotations

from typing import Any

GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM",
              "gemma3_text": "Gemma3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}  # fmt: skip
SLIDING, FULL = "sliding_attention", "full_attention"  # HF's layer_types
GEMMA_ACT = "gelu_pytorch_tanh"
# the HF configs whose one attention_bias covers o_proj too
ONE_ATTENTION_BIAS = ("llama", "qwen3", "smollm3", *GEMMA_ARCHITECTURES)


# transformers' defaults (LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig, Gemma2Config, Gemma3TextConfig) for
# the keys ``from_hf`` reads and a config.json may leave out.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "num_key_value_heads": None,  # None: as many as the query heads
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
    },
    "qwen2": {
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    },
    "qwen3": {
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    },
    "mistral": {
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096 * 32,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": None,
    },
    "smollm3": {
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "rope_theta": 2000000.0,
        "use_sliding_window": False,
        "no_rope_layer_interval": 4,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "pad_token_id": 128004,
    },
    "gemma2": {
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_activation": GEMMA_ACT,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    },
    "gemma3_text": {
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_activation": GEMMA_ACT,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
    },
}
GEMMA_PATTERN = {"gemma2": 2, "gemma3_text": 6}  # every n-th layer global, the rest sliding (no layer_types given)


def check_supported(cfg: dict[str, Any]) -> None:
    """Raise ``ValueError`` for config options that would make the HF model a different network than this one."""
    if cfg["model_type"] in GEMMA_ARCHITECTURES:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act")
        if act != GEMMA_ACT:
            raise ValueError(f"unsupported hidden_activation {act!r} in config.json; supported: {GEMMA_ACT!r}")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("unsupported use_bidirectional_attention=true in config.json (an encoder)")
    elif cfg.get("hidden_act") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r} in config.json; supported: 'silu'")
    if cfg.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=true in config.json (biases on the MLP projections)")
    if cfg.get("use_sliding_window"):
        raise ValueError("unsupported use_sliding_window=true in config.json (sliding-window attention)")


def _gemma_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``ModelConfig`` fields of a Gemma 2 / Gemma 3 text ``config.json`` (``cfg`` with the defaults filled in)."""
    pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or GEMMA_PATTERN[arch])
    layer_types = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    fields: dict[str, Any] = {
        "hidden_act": GEMMA_ACT,
        "layer_types": list(layer_types),
        "sliding_window": int(cfg["sliding_window"]) if cfg["sliding_window"] else None,
        "query_pre_attn_scalar": float(cfg["query_pre_attn_scalar"]),
        "attn_softcap": _optional_float(cfg["attn_logit_softcapping"]),
        "final_softcap": _optional_float(cfg["final_logit_softcapping"]),
    }
    if arch == "gemma3_text":  # RoPE per layer type: scaled global base, unscaled local one
        rope = cfg.get("rope_parameters") or {}
        if FULL in rope or SLIDING in rope:  # transformers >= 5 writes them per layer type
            full, local = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
        else:
            full = {"rope_theta": cfg.get("rope_theta", 1e6), **(cfg.get("rope_scaling") or {})}
            local = {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported RoPE scaling {local!r} of the sliding layers in config.json")
        full_type = full.get("rope_type", full.get("type", "default"))
        fields |= {
            "rope_theta": float(full.get("rope_theta", 1e6)),
            "rope_scaling": None if full_type == "default" else full,
            "rope_local_theta": float(local.get("rope_theta", 1e4)),
        }
    return fields


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def int_if_whole(value: float | None) -> float | int | None:
    return int(value) if value is not None and float(value).is_integer() else value


def family_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``ModelConfig`` fields beyond Llama's of an HF ``config.json`` (``cfg`` with the defaults filled in)."""
    if arch in GEMMA_ARCHITECTURES:
        return _gemma_fields(arch, cfg, num_layers)
    if arch == "smollm3":  # HF's no_rope_layers: 1 where the layer *uses* RoPE
        every = int(cfg["no_rope_layer_interval"])
        uses = cfg.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(num_layers)]
        return {"rope_layers": None if all(uses) else [bool(u) for u in uses]}
    return {}
