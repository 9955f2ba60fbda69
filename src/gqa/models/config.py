"""``ModelConfig``: the hyper-parameters of a Llama-family decoder (Llama, SmolLM, Qwen2/3, Mistral, Gemma 2/3), read
from an HF ``config.json`` or from GGUF metadata, and written back as an HF ``config.json``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from .checked import derived_head_dim, or_none, positive_float, positive_int
from .hf_config import (
    FULL,
    GEMMA_ACT,
    GEMMA_ARCHITECTURES,
    HF_CLASSES,
    HF_DEFAULTS,
    ONE_ATTENTION_BIAS,
    SLIDING,
    check_supported,
    family_fields,
    hf_size,
    int_if_whole,
    rope_fields,
)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "smollm3")
SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
         "max_position_embeddings")  # fmt: skip


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
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    sliding_window: int | None = None  # each token sees itself and the sliding_window - 1 before it (Mistral, Gemma)
    layer_types: list[str] | None = None  # per layer SLIDING or FULL; None: every layer windowed iff sliding_window
    rope_layers: list[bool] | None = None  # per layer whether it rotates q and k (SmolLM3: not every 4th); None: all
    hidden_act: str = "silu"  # the MLP's gate activation: "silu", or GEMMA_ACT (Gemma)
    rope_local_theta: float | None = None  # Gemma 3: the RoPE base of sliding layers (unscaled); None: rope_theta
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 power instead of head_dim's
    attn_softcap: float | None = None  # Gemma 2: attention-logit soft-capping
    final_softcap: float | None = None  # Gemma 2: final-logit soft-capping
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in SIZES:
            setattr(self, name, positive_int(getattr(self, name), name))
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap"):  # divisors when given
            setattr(self, name, or_none(positive_float, getattr(self, name), name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.layer_types is not None:
            self.layer_types = list(self.layer_types)
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {SLIDING, FULL}:
                raise ValueError(
                    f"layer_types must list {SLIDING!r} or {FULL!r} for each of the {self.num_layers} layers, "
                    f"got {self.layer_types!r}"
                )
        if self.rope_layers is not None:
            self.rope_layers = [bool(r) for r in self.rope_layers]
            if len(self.rope_layers) != self.num_layers:
                n = len(self.rope_layers)
                raise ValueError(f"rope_layers must have one entry per layer ({self.num_layers}), got {n}")
        if self.gemma != (self.hidden_act == GEMMA_ACT):
            raise ValueError(f"hidden_act {self.hidden_act!r} does not go with architecture {self.arch!r}")

    @property
    def gemma(self) -> bool:
        """Gemma's layer (norms scaling by ``1 + weight`` before and after attention and MLP, GELU-tanh MLP,
        embeddings scaled by ``sqrt(hidden_size)``)."""
        return self.arch in GEMMA_ARCHITECTURES

    def layer_rotates(self, layer: int) -> bool:
        """Whether layer ``layer`` applies RoPE to q and k (a NoPE layer does not)."""
        return self.rope_layers is None or self.rope_layers[layer]

    def layer_window(self, layer: int) -> tuple[int, None] | None:
        """Layer ``layer``'s attention window as ``grouped_attention`` takes it (``sliding_window`` keys including
        the token), or None for a global layer."""
        if self.sliding_window is None or (self.layer_types is not None and self.layer_types[layer] == FULL):
            return None
        return (self.sliding_window - 1, None)

    @property
    def attention_scale(self) -> float | None:
        """The scores' scale when it is not ``1 / sqrt(head_dim)`` (Gemma's ``query_pre_attn_scalar``), else None."""
        q = self.query_pre_attn_scalar
        return None if q is None or q == self.head_dim else float(q) ** -0.5

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From the dict of an HF ``config.json`` (``model_type`` llama, qwen2, qwen3, mistral, gemma2, gemma3_text or
        smollm3) as transformers 5 or 4 writes it (the RoPE's keys differ: ``rope_fields``).

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
        check_supported(cfg)
        try:
            size = partial(hf_size, cfg)
            hidden, heads = size("hidden_size"), size("num_attention_heads")
            kv_heads = size("num_key_value_heads", nullable=True) or heads
            if heads % kv_heads:
                raise ValueError(f"num_attention_heads ({heads}) must be divisible by num_key_value_heads ({kv_heads})")
            fields = dict(
                arch=arch,
                vocab_size=size("vocab_size"),
                hidden_size=hidden,
                intermediate_size=size("intermediate_size"),
                num_layers=size("num_hidden_layers"),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=size("head_dim", nullable=True)
                or derived_head_dim(hidden, heads, "hidden_size", "num_attention_heads"),
                rms_norm_eps=float(cfg["rms_norm_eps"]),
                max_position_embeddings=size("max_position_embeddings"),
                tie_word_embeddings=bool(cfg["tie_word_embeddings"]),
                # Qwen2's q/k/v projections always have biases (its attention has no such option)
                attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
                # transformers' Llama, Qwen3 and Gemma attention: one attention_bias for q/k/v and o_proj
                output_bias=arch in ONE_ATTENTION_BIAS and bool(cfg.get("attention_bias", False)),
                qk_norm=arch in ("qwen3", "gemma3_text"),
                sliding_window=size("sliding_window", nullable=True) if arch == "mistral" else None,
                bos_token_id=cfg["bos_token_id"],
                eos_token_id=cfg["eos_token_id"] if cfg["eos_token_id"] is not None else [],
                pad_token_id=cfg["pad_token_id"],
            )
            return cls(**fields | rope_fields(arch, cfg) | family_fields(arch, cfg, fields["num_layers"]))
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
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.arch in ONE_ATTENTION_BIAS:
            if self.attention_bias != self.output_bias:
                raise ValueError(
                    f"an HF {self.arch} config has one attention_bias for q/k/v and o_proj; this model has q/k/v "
                    f"biases {self.attention_bias} and an o_proj bias {self.output_bias}"
                )
            cfg |= {"attention_bias": self.attention_bias}
            if self.arch in ("llama", "qwen3"):
                cfg |= {"mlp_bias": False} if self.arch == "llama" else {"use_sliding_window": False}
        elif self.output_bias or (self.arch == "mistral" and self.attention_bias):
            raise ValueError(f"an HF {self.arch} config cannot hold these attention biases")
        if self.arch == "mistral":
            cfg |= {"sliding_window": self.sliding_window}
        if self.arch == "smollm3":
            uses = [int(self.layer_rotates(i)) for i in range(self.num_layers)]
            cfg |= {"no_rope_layers": uses, "use_sliding_window": False, "mlp_bias": False}
        elif self.rope_layers is not None:
            raise ValueError(f"an HF {self.arch} config cannot hold layers without RoPE")
        if self.gemma:
            cfg |= {
                "hidden_activation": self.hidden_act,
                "sliding_window": self.sliding_window,
                "layer_types": self.layer_types,
                "query_pre_attn_scalar": int_if_whole(self.query_pre_attn_scalar),  # transformers wants an int
                "attn_logit_softcapping": self.attn_softcap,
                "final_logit_softcapping": self.final_softcap,
            }
            if self.arch == "gemma3_text":  # the format every transformers version reads (5.x converts it)
                cfg |= {"rope_local_base_freq": self.rope_local_theta}
        return cfg

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
