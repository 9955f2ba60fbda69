"""What every family's layers share: the RoPE table of a model and a layer's attention as its config describes it."""

from __future__ import annotations

from ..attention.module import GroupedQueryAttention
from ..attention.rope import RoPE
from .config import ModelConfig


def model_rope(cfg: ModelConfig) -> RoPE:
    """The ``RoPE`` every layer of a ``cfg`` model shares (tables up to ``min(context, 8192)`` positions, grown on
    demand)."""
    return RoPE(
        cfg.head_dim,
        theta=cfg.rope_theta,
        scaling=cfg.rope_scaling,
        max_position=min(cfg.max_position_embeddings, 8192),
    )


def layer_attention(cfg: ModelConfig, layer: int, rope: RoPE | None) -> GroupedQueryAttention:
    """Layer ``layer``'s attention as ``cfg`` describes it (heads, biases, window, soft-cap, q/k norm, scale)."""
    return GroupedQueryAttention(
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        qkv_bias=cfg.attention_bias,
        out_bias=cfg.output_bias,
        rope=rope if cfg.layer_rotates(layer) else None,
        window=cfg.layer_window(layer),
        softcap=cfg.attn_softcap,
        qk_norm=cfg.qk_norm,
        norm_eps=cfg.rms_norm_eps,
        unit_offset_norm=cfg.gemma,
        scale=cfg.attention_scale,
    )
