"""``ModelConfig``: the hyper-parameters of a Llama-family decoder (Llama, SmolLM, Qwen2), read from an HF
``config.json`` or from GGUF metadata, and written back as an HF ``config.json``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "mistral": "MistralForCausalLM"}  # fmt: skip


# transformers' defaults (LlamaConfig, Qwen2Config, Qwen3Config, MistralConfig) for the keys ``from_hf`` reads and a
# config.json may leave out.
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
}


def _check_supported(cfg: dict[str, Any]) -> None:
    """Raise ``ValueError`` for config options that would make the HF model a different network than this one."""
    if cfg.get("hidden_act") != "silu":
        raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r} in config.json; supported: 'silu'")
    if cfg.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=true in config.json (biases on the MLP projections)")
    if cfg.get("use_sliding_window"):
        raise ValueError("unsupported use_sliding_window=true in config.json (sliding-window attention)")


@dataclass
class ModelConfig:
    """Sizes and options of a decoder-only Llama-family model.

    ``num_kv_heads`` is the number of key/value heads: ``num_heads`` for MHA, 1 for MQA, a divisor between for GQA.
    """

    arch: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: True)
    output_bias: bool = False  # bias on o_proj (an HF Llama with attention_bias=true has both; Qwen2 never)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # Mistral: each token sees itself and the sliding_window - 1 before it
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")

    @property
    def window(self) -> tuple[int, None] | None:
        """The attention window as ``grouped_attention`` takes it: ``sliding_window`` keys including the token."""
        return None if self.sliding_window is None else (self.sliding_window - 1, None)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From the dict of an HF ``config.json`` (``model_type`` llama, qwen2, qwen3 or mistral).

        A key that is absent takes transformers' default for that architecture (``HF_DEFAULTS``; e.g.
        ``tie_word_embeddings`` False, ``max_position_embeddings`` 2048 for Llama and 32768 for Qwen2); the sizes
        of the network have no default. Options this model does not implement (a non-SiLU MLP, MLP biases, Qwen2's
        sliding window) raise ``ValueError`` rather than load as a different network.
        """
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {arch!r} in config.json; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        cfg = HF_DEFAULTS[arch] | cfg
        _check_supported(cfg)
        try:
            hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
            rope = cfg.get("rope_parameters") or {}
            scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            return cls(
                arch=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg["num_key_value_heads"] or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg["rms_norm_eps"]),
                rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_scaling=dict(scaling) if scaling else None,
                max_position_embeddings=int(cfg["max_position_embeddings"]),
                tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
                # Qwen2's q/k/v projections always have biases (its attention has no such option)
                attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
                # transformers' LlamaAttention and Qwen3Attention: one attention_bias for q/k/v and o_proj
                output_bias=arch in ("llama", "qwen3") and bool(cfg.get("attention_bias", False)),
                qk_norm=arch == "qwen3",
                sliding_window=int(cfg["sliding_window"]) if arch == "mistral" and cfg["sliding_window"] else None,
                bos_token_id=cfg["bos_token_id"],
                eos_token_id=cfg["eos_token_id"] if cfg["eos_token_id"] is not None else [],
                pad_token_id=cfg["pad_token_id"],
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks the required key {e.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict for this model (loads in transformers and in ``gqa.load_model``)."""
        cfg: dict[str, Any] = {
            "architectures": [HF_CLASSES[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.arch in ("llama", "qwen3"):
            if self.attention_bias != self.output_bias:
                raise ValueError(
                    f"an HF {self.arch} config has one attention_bias for q/k/v and o_proj; this model has q/k/v "
                    f"biases {self.attention_bias} and an o_proj bias {self.output_bias}"
                )
            cfg |= {"attention_bias": self.attention_bias}
            cfg |= {"mlp_bias": False} if self.arch == "llama" else {"use_sliding_window": False}
        elif self.output_bias or (self.arch == "mistral" and self.attention_bias):
            raise ValueError(f"an HF {self.arch} config cannot hold these attention biases")
        if self.arch == "mistral":
            cfg |= {"sliding_window": self.sliding_window}
        return cfg

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
