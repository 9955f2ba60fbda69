"""What gqa reads from and writes to an HF ``config.json``, per architecture: transformers' class names and defaults,
the options this model refuses, and the fields of the families with more than Llama's (Gemma 2/3, SmolLM3)."""

from __future__ import annotations

from typing import Any

from .checked import or_none, positive_float, positive_int

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
# transformers' RoPE bases when a config.json names none (each config class's ``default_theta``); Gemma 3's sliding
# layers have their own
DEFAULT_ROPE_THETA = {"smollm3": 2000000.0, "gemma3_text": 1000000.0}
GEMMA3_LOCAL_THETA = 10000.0
# the scalings whose pre-training context transformers takes from max_position_embeddings when the config has none
LONG_CONTEXT_ROPE = ("llama3", "yarn", "longrope")


def hf_size(cfg: dict[str, Any], key: str, nullable: bool = False) -> Any:
    """``cfg[key]``, a count or a size, as an int >= 1: a zero, negative or fractional one is a ``ValueError`` naming
    ``key`` (never a division by zero later); ``nullable``: None where the key is absent or null."""
    return None if nullable and cfg.get(key) is None else positive_int(cfg[key], key)


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
    key = next((k for k in ("sliding_window_pattern", "_sliding_window_pattern") if cfg.get(k) is not None), None)
    pattern = positive_int(cfg[key], key) if key else GEMMA_PATTERN[arch]
    layer_types = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    return {
        "hidden_act": GEMMA_ACT,
        "layer_types": list(layer_types),
        "sliding_window": or_none(positive_int, cfg["sliding_window"], "sliding_window"),
        "query_pre_attn_scalar": positive_float(cfg["query_pre_attn_scalar"], "query_pre_attn_scalar"),
        "attn_softcap": or_none(positive_float, cfg["attn_logit_softcapping"], "attn_logit_softcapping"),
        "final_softcap": or_none(positive_float, cfg["final_logit_softcapping"], "final_logit_softcapping"),
    }


def int_if_whole(value: float | None) -> float | int | None:
    return int(value) if value is not None and float(value).is_integer() else value


def rope_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling`` (transformers 4's form: ``rope_type`` and its parameters, no base; None when
    unscaled) and, for Gemma 3, ``rope_local_theta`` of an HF ``config.json`` as either transformers writes it.

    transformers 5 writes ``rope_parameters``: one dict (``rope_theta``, ``rope_type``, the scaling's parameters), or
    for Gemma 3 one per layer type (``full_attention``, ``sliding_attention``). transformers 4 wrote ``rope_theta``,
    ``rope_scaling`` (``rope_type`` or the older ``type``) and Gemma 3's ``rope_local_base_freq``. Where both are
    given, transformers 5's precedence holds: ``rope_scaling`` over ``rope_parameters``' type, ``rope_parameters``'
    base over ``rope_theta``.
    """
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a JSON object, got {params!r}")
    nested = FULL in params or SLIDING in params
    full = dict((params.get(FULL) if nested else params) or {}) | dict(cfg.get("rope_scaling") or {})
    full.setdefault("rope_theta", cfg.get("rope_theta") or DEFAULT_ROPE_THETA.get(arch, 10000.0))
    fields = {"rope_theta": float(full["rope_theta"]), "rope_scaling": _rope_scaling(full, cfg)}
    if arch == "gemma3_text":  # the sliding layers: their own base, never scaled
        local = dict(params.get(SLIDING) or {}) if nested else {}
        local.setdefault("rope_theta", cfg.get("rope_local_base_freq") or GEMMA3_LOCAL_THETA)
        if _rope_scaling(local, cfg) is not None:
            raise ValueError(f"unsupported RoPE scaling {local!r} of the sliding layers in config.json")
        fields["rope_local_theta"] = float(local["rope_theta"])
    elif nested:
        raise ValueError(f"unsupported rope_parameters per layer type ({', '.join(params)}) in a {arch} config.json")
    return fields


def _rope_scaling(params: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 4's ``rope_scaling`` of one RoPE's parameters (base included), or None for an unscaled RoPE."""
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:  # none of these families rotates part of a head
        raise ValueError(f"unsupported partial_rotary_factor {params['partial_rotary_factor']!r} in config.json")
    if scaling["rope_type"] == "default":
        return None
    if scaling["rope_type"] in LONG_CONTEXT_ROPE:
        scaling.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return scaling


def family_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``ModelConfig`` fields beyond Llama's of an HF ``config.json`` (``cfg`` with the defaults filled in)."""
    if arch in GEMMA_ARCHITECTURES:
        return _gemma_fields(arch, cfg, num_layers)
    if arch == "smollm3":  # HF's no_rope_layers: 1 where the layer *uses* RoPE
        every = positive_int(cfg["no_rope_layer_interval"], "no_rope_layer_interval")
        uses = cfg.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(num_layers)]
        return {"rope_layers": None if all(uses) else [bool(u) for u in uses]}
    return {}
