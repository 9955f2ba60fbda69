"""What every family's layers share: the RoPE table of a model, a layer's attention as its config describes it, and
the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.module import GroupedQueryAttention
from ..attention.rope import RoPE
from .config import ModelConfig
from .linear import Linear, linears

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}  # HF's names


class MLP(nn.Module):
    """A gated MLP: ``down(act(gate(x)) * up(x))``, SwiGLU with ``act="silu"`` (Llama), GELU-tanh with
    ``"gelu_pytorch_tanh"`` (Gemma)."""

    def __init__(self, dim: int, hidden: int, act: str = "silu") -> None:
        super().__init__()
        self.act = act
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linears(x, (self.gate_proj, self.up_proj))
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return self.down_proj(ACTIVATIONS[self.act](gate) * up)
        # without autograd the product goes in place into the activation's own output: a prompt's (L, hidden)
        # temporaries at once are three, not four (gate and up stay as the projections gave them: a hook may hold them)
        return self.down_proj(ACTIVATIONS[self.act](gate).mul_(up))


def model_rope(cfg: ModelConfig, *, local: bool = False) -> RoPE:
    """The ``RoPE`` the layers of a ``cfg`` model share (tables up to ``min(context, 8192)`` positions, grown on
    demand); ``local``: Gemma 3's sliding layers' (base ``rope_local_theta``, unscaled)."""
    return RoPE(
        cfg.head_dim,
        theta=cfg.rope_local_theta if local else cfg.rope_theta,
        scaling=None if local else cfg.rope_scaling,
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
