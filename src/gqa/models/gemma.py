"""Gemma 2 and Gemma 3 (text) layers on ``gqa.GroupedQueryAttention``: the backbone ``CausalLM`` runs for them.

What differs from Llama's layer (``models.llama``), with HF transformers' parameter names:

* every RMSNorm scales by ``1 + weight`` (weights stored as offsets from 1), in float32, cast back after the weight;
* a "sandwich": ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
  ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))``; the MLP gates with GELU (tanh form);
* embeddings scaled by ``sqrt(hidden_size)`` (rounded to the activations' dtype, as HF does);
* scores scaled by ``query_pre_attn_scalar ** -0.5``; sliding-window layers interleaved with global ones
  (``ModelConfig.layer_types``); Gemma 2 soft-caps attention logits (50) and final logits (30); Gemma 3 normalises
  q and k per head and rotates its sliding layers with their own RoPE base (``rope_local_theta``, unscaled).
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.module import HeadRMSNorm
from ..attention.rope import RoPE
from ..cache.kv import StaticKVCache
from .config import ModelConfig
from .layers import MLP, layer_attention, model_rope

Rotations = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (global, local) cos/sin


def gemma_norm(dim: int, eps: float) -> HeadRMSNorm:
    """Gemma's RMSNorm over the last ``dim`` features: ``x / rms(x) * (1 + weight)``, weight initialised to 0."""
    return HeadRMSNorm(dim, eps, unit_offset=True)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RoPE, layer: int, local_rope: bool) -> None:
        super().__init__()
        self.local_rope = local_rope  # rotate with the sliding layers' RoPE
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = gemma_norm(H, eps)
        self.self_attn = layer_attention(cfg, layer, rope)
        self.post_attention_layernorm = gemma_norm(H, eps)
        self.pre_feedforward_layernorm = gemma_norm(H, eps)
        self.mlp = MLP(H, cfg.intermediate_size, act=cfg.hidden_act)
        self.post_feedforward_layernorm = gemma_norm(H, eps)

    def forward(
        self, x: torch.Tensor, attn_mask: torch.Tensor | None, rotations: Rotations, cache: StaticKVCache | None
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.self_attn(h, attn_mask=attn_mask, is_causal=True, rope_cos_sin=rotations[self.local_rope], cache=cache)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaBackbone(nn.Module):
    """Gemma's embeddings, layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rope = model_rope(cfg)
        # Gemma 3's sliding layers rotate with their own base, unscaled
        self.local_rope = None if cfg.rope_local_theta is None else model_rope(cfg, local=True)
        layers = []
        for i in range(cfg.num_layers):
            local = self.local_rope is not None and cfg.layer_window(i) is not None
            layers.append(GemmaDecoderLayer(cfg, self.local_rope if local else self.rope, i, local))
        self.layers = nn.ModuleList(layers)
        self.norm = gemma_norm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids (B, L)`` -> ``embeddings * sqrt(hidden_size)`` ``(B, L, E)``, the factor in their dtype."""
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.hidden_size**0.5, dtype=x.dtype)

    def rotations(self, position_ids: torch.Tensor) -> Rotations:
        """``(global, local)`` ``(cos, sin)`` for ``position_ids``: one lookup per table per forward."""
        glob = self.rope.cos_sin(position_ids)
        return glob, glob if self.local_rope is None else self.local_rope.cos_sin(position_ids)
