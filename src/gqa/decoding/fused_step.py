"""The GPU decode step with as few kernels as the math allows: one GEMM for q/k/v, one for gate/up, the norms, RoPE,
the cache write and the residual adds fused by ``torch.compile`` (Inductor) where it is asked for.

A decoded token on a GPU is launch-bound, not bandwidth-bound: SmolLM2's 30 layers as eager PyTorch are ~35 kernels
each, ~1000 per token, each a few microseconds even when replayed from a CUDA graph. ``StepWeights`` concatenates
each layer's q/k/v and gate/up matrices once per model (the three and the two projections read one input: one GEMM
each); ``fused_step`` is the step over them, which never reads a value back to the host and never changes a shape
(``cuda_graphs.static_step``'s contract), so it can be compiled — its elementwise chains become one kernel each —
and captured in a CUDA graph (``cuda_graphs.GraphedDecoder``). The split-KV attention kernel is an opaque custom op
to the compiler (``kernels.triton.split_kv.decode_op``).

The concatenated matrices are copies (the model's own weights stay as they are, so saving or training the model
is unaffected): extra device memory of the q/k/v and gate/up weights, ~85% of a Llama-shaped model's. They are
rebuilt when any weight changed since (``StepWeights.current``: a new storage, or an in-place change outside
``torch.inference_mode``, which does not count versions).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.kv import StaticKVCache
from ..kernels.triton.split_kv import decode_op


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights, q/k/v as one ``(H_q*D + 2*H_kv*D, E)`` matrix, gate/up as one ``(2F, E)``."""

    norm1: torch.Tensor  # (E,)
    qkv: torch.Tensor  # (H_q*D + 2*H_kv*D, E)
    qkv_bias: torch.Tensor | None  # (H_q*D + 2*H_kv*D,)
    o: torch.Tensor  # (E, H_q*D)
    o_bias: torch.Tensor | None  # (E,)
    norm2: torch.Tensor  # (E,)
    gate_up: torch.Tensor  # (2F, E)
    down: torch.Tensor  # (E, F)


@dataclass(frozen=True)
class StepWeights:
    layers: tuple[LayerWeights, ...]
    eps: float
    H_q: int
    H_kv: int
    D: int
    versions: tuple[int, ...]  # every source weight's storage and version counter when the copies were made

    def current(self, model: nn.Module) -> bool:
        return self.versions == _versions(model)


def _versions(model: nn.Module) -> tuple[int, ...]:
    """Each parameter's storage and version counter (inference tensors have none: their storage alone)."""
    return tuple(x for p in model.parameters() for x in (p.data_ptr(), -1 if p.is_inference() else p._version))


def fused_applies(model: nn.Module) -> str | None:
    """``None`` if ``StepWeights`` can be built for ``model``, else why not (quantized or hooked projections)."""
    if not model.runs_llama_layers():
        return f"{model.config.arch}'s own layers (the eager forward takes them)"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not attn.plain:
            return "attention with a window, soft-capping, sinks or q/k norm (the eager forward takes it)"
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        for proj in projections:
            if not isinstance(proj, nn.Linear) or proj._forward_hooks or proj._forward_pre_hooks:
                return f"projection {type(proj).__name__} (plain float nn.Linear only)"
    return None


_weights: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cat_bias(projections: tuple[nn.Linear, ...]) -> torch.Tensor | None:
    if all(p.bias is None for p in projections):
        return None
    return torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in projections])


@torch.no_grad()
def step_weights(model: nn.Module) -> StepWeights:
    """The fused weights of ``model`` (module docstring), made once and kept while the model lives and its weights
    do not change."""
    cached = _weights.get(model)
    if cached is not None and cached.current(model):
        return cached
    reason = fused_applies(model)
    if reason is not None:
        raise ValueError(f"the fused decode step does not apply: {reason}")
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
        layers.append(
            LayerWeights(
                norm1=layer.input_layernorm.weight,
                qkv=torch.cat([p.weight for p in qkv]),
                qkv_bias=_cat_bias(qkv),
                o=attn.o_proj.weight,
                o_bias=attn.o_proj.bias,
                norm2=layer.post_attention_layernorm.weight,
                gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                down=mlp.down_proj.weight,
            )
        )
    first = model.model.layers[0].self_attn
    weights = StepWeights(tuple(layers), model.model.norm.eps, first.num_heads, first.num_kv_heads, first.head_dim,
                          _versions(model))  # fmt: skip
    _weights[model] = weights
    return weights


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``models.llama.RMSNorm``'s arithmetic: in float32, cast back, then scaled."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def fused_layers(
    model: nn.Module, w: StepWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
) -> torch.Tensor:
    """Every decoder layer over ``x (B, 1, E)``, one token per row, RoPE at ``cos, sin (B, 1, rotary_dim)``;
    ``attend(layer, q (B, H_q, 1, D), k, v (B, H_kv, 1, D)) -> (B, H_q, 1, D)`` stores the new K/V and attends
    (a static cache here, the paged pool in ``serve.triton_runner``). -> the last hidden states ``(B, 1, E)``."""
    rope = model.model.rope
    H_q, H_kv, D = w.H_q, w.H_kv, w.D
    for i, lw in enumerate(w.layers):
        h = _rms_norm(x, lw.norm1, w.eps)
        q, k, v = F.linear(h, lw.qkv, lw.qkv_bias).split([H_q * D, H_kv * D, H_kv * D], dim=-1)  # (B, 1, n*D)
        q = rope.rotate(q.unflatten(-1, (H_q, D)).transpose(1, 2), cos, sin)  # (B, H_q, 1, D)
        k = rope.rotate(k.unflatten(-1, (H_kv, D)).transpose(1, 2), cos, sin)  # (B, H_kv, 1, D)
        v = v.unflatten(-1, (H_kv, D)).transpose(1, 2)  # (B, H_kv, 1, D)
        a = attend(i, q, k, v)  # (B, H_q, 1, D)
        x = x + F.linear(a.transpose(1, 2).flatten(-2), lw.o, lw.o_bias)
        gate, up = F.linear(_rms_norm(x, lw.norm2, w.eps), lw.gate_up).chunk(2, dim=-1)  # (B, 1, F) each
        x = x + F.linear(F.silu(gate) * up, lw.down)
    return x


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The final norm and the LM head: ``(..., E)`` -> ``(..., vocab)``."""
    norm = model.model.norm
    return model.lm_head(_rms_norm(x, norm.weight, norm.eps))


def fused_step(model: nn.Module, w: StepWeights, tokens: torch.Tensor, caches: list[StaticKVCache]) -> torch.Tensor:
    """Logits ``(B, 1, vocab)`` of ``tokens (B, 1)``, each layer's K/V appended at its cache's cursor: the eager
    model's decode step (``models.llama``) with fused projections, no host synchronisation and fixed shapes."""
    rope = model.model.rope
    first = caches[0]
    positions = (first.cursor - first.start).clamp_min(0)[:, None]  # (B, 1): RoPE positions, padding excluded
    cos, sin = rope.cos_cached[positions], rope.sin_cached[positions]  # (B, 1, rotary_dim) each
    scale = w.D**-0.5

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = caches[i]
        slot = cache.cursor.view(1)
        cache.key.index_copy_(2, slot, k)
        cache.value.index_copy_(2, slot, v)
        cache.cursor.add_(1)
        return decode_op(q, cache.key, cache.value, cache.start, cache.cursor, scale)  # (B, H_q, 1, D)

    x = fused_layers(model, w, model.model.embed_tokens(tokens), cos, sin, attend)  # (B, 1, E)
    return logits_of(model, x)  # (B, 1, vocab)
