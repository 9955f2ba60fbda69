"""The GPU decode step with as few kernels as the math allows: one GEMM for q/k/v, one for gate/up, the norms, RoPE,
the cache write and the residual adds fused by ``torch.compile`` (Inductor) where it is asked for.

A decoded token on a GPU is launch-bound, not bandwidth-bound: SmolLM2's 30 layers as eager PyTorch are ~35 kernels
each, ~1000 per token, each a few microseconds even when replayed from a CUDA graph. ``StepWeights`` concatenates
each layer's q/k/v and gate/up matrices once per model (the three and the two projections read one input: one GEMM
each); ``fused_step`` is the step over them, which never reads a value back to the host and never changes a shape
(``cuda_graphs.static_step``'s contract), so it can be compiled — its elementwise chains become one kernel each —
and captured in a CUDA graph (``cuda_graphs.GraphedDecoder``). The split-KV attention kernel is an opaque custom op
to the compiler (``kernels.triton.split_kv.decode_op``).

Every family gqa loads runs through it: a layer's q/k norms (Qwen3, Gemma 3), no RoPE (SmolLM3's NoPE layers), its own
RoPE table (Gemma 3's sliding layers), a sliding window (the kernel reads only the window's keys of the static cache),
attention soft-capping and sinks (in the kernel), Gemma's sandwich norms, GELU gate and scaled embeddings, and the
final soft-cap — each layer's options are read from its modules once, into ``LayerWeights``. A quantized cache
(``q8_0`` / ``q4_0`` K and/or V) gets each new row's blocks (``cache.quantize.as_stored``: torch ops, no host
synchronisation) and the kernel reads the blocks where they lie.

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

from ..attention.rope import RoPE
from ..cache.kv import StaticKVCache
from ..cache.quantize import as_stored
from ..kernels.triton.split_kv import decode_op
from ..models.layers import ACTIVATIONS

Norm = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as the step runs it: q/k/v as one ``(H_q*D + 2*H_kv*D, E)`` matrix, gate/up as one
    ``(2F, E)``, the layer's norms (its own modules) and its attention's options."""

    norm1: Norm  # before attention
    qkv: torch.Tensor  # (H_q*D + 2*H_kv*D, E)
    qkv_bias: torch.Tensor | None  # (H_q*D + 2*H_kv*D,)
    o: torch.Tensor  # (E, H_q*D)
    o_bias: torch.Tensor | None  # (E,)
    norm2: Norm  # before the MLP
    gate_up: torch.Tensor  # (2F, E)
    down: torch.Tensor  # (E, F)
    act: Callable[[torch.Tensor], torch.Tensor]  # the gate's activation
    post_attn_norm: Norm | None = None  # Gemma's sandwich: on the attention's and the MLP's outputs
    post_mlp_norm: Norm | None = None
    q_norm: Norm | None = None  # per head, before RoPE (Qwen3, Gemma 3)
    k_norm: Norm | None = None
    rope: RoPE | None = None  # None: a layer without RoPE
    window: int | None = None  # keys to the left a token sees (a sliding window)
    softcap: float | None = None
    sinks: torch.Tensor | None = None  # (H_q,)
    scale: float = 1.0


@dataclass(frozen=True)
class StepWeights:
    layers: tuple[LayerWeights, ...]
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
    """``None`` if ``StepWeights`` can be built for ``model``, else why not (quantized or hooked projections, a window
    with a right side)."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.window is not None and (attn.window[0] is None or attn.window[1] is not None):
            return f"a window {attn.window} with an unbounded left or a bounded right side"
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


def _layer_weights(layer: nn.Module) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = (attn.q_proj, attn.k_proj, attn.v_proj)
    sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma's layer (models.gemma)
    return LayerWeights(
        norm1=layer.input_layernorm,
        qkv=torch.cat([p.weight for p in qkv]),
        qkv_bias=_cat_bias(qkv),
        o=attn.o_proj.weight,
        o_bias=attn.o_proj.bias,
        norm2=layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        down=mlp.down_proj.weight,
        act=ACTIVATIONS[mlp.act],
        post_attn_norm=layer.post_attention_layernorm if sandwich else None,
        post_mlp_norm=layer.post_feedforward_layernorm if sandwich else None,
        q_norm=attn.q_norm,
        k_norm=attn.k_norm,
        rope=attn.rope,
        window=None if attn.window is None else attn.window[0],
        softcap=attn.softcap,
        sinks=None if attn.sinks is None else attn.sinks.detach(),
        scale=attn.head_dim**-0.5 if attn.scale is None else attn.scale,
    )


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
    first = model.model.layers[0].self_attn
    weights = StepWeights(tuple(_layer_weights(layer) for layer in model.model.layers), first.num_heads,
                          first.num_kv_heads, first.head_dim, _versions(model))  # fmt: skip
    _weights[model] = weights
    return weights


def step_ropes(model: nn.Module) -> list[RoPE]:
    """The distinct RoPE tables the layers rotate by (one; two for Gemma 3; none for a model without RoPE)."""
    ropes: dict[int, RoPE] = {}
    for layer in model.model.layers:
        if layer.self_attn.rope is not None:
            ropes.setdefault(id(layer.self_attn.rope), layer.self_attn.rope)
    return list(ropes.values())


Attend = Callable[[int, LayerWeights, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Rotation = Callable[[RoPE], tuple[torch.Tensor, torch.Tensor]]


def fused_layers(model: nn.Module, w: StepWeights, x: torch.Tensor, rotation: Rotation, attend: Attend) -> torch.Tensor:
    """Every decoder layer over ``x (B, 1, E)``, one token per row; ``rotation(rope) -> (cos, sin)``
    ``(B, 1, rotary_dim)`` each at the rows' positions (asked once per table); ``attend(layer, lw, q (B, H_q, 1, D),
    k, v (B, H_kv, 1, D)) -> (B, H_q, 1, D)`` stores the new K/V and attends with the layer's options ``lw`` (a
    static cache here, the paged pool in ``serve.triton_runner``). -> the last hidden states ``(B, 1, E)``."""
    H_q, H_kv, D = w.H_q, w.H_kv, w.D
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, lw in enumerate(w.layers):
        h = lw.norm1(x)
        q, k, v = F.linear(h, lw.qkv, lw.qkv_bias).split([H_q * D, H_kv * D, H_kv * D], dim=-1)  # (B, 1, n*D)
        q = q.unflatten(-1, (H_q, D)).transpose(1, 2)  # (B, H_q, 1, D)
        k = k.unflatten(-1, (H_kv, D)).transpose(1, 2)  # (B, H_kv, 1, D)
        v = v.unflatten(-1, (H_kv, D)).transpose(1, 2)  # (B, H_kv, 1, D)
        if lw.q_norm is not None:
            q, k = lw.q_norm(q), lw.k_norm(k)
        if lw.rope is not None:
            if id(lw.rope) not in tables:
                tables[id(lw.rope)] = rotation(lw.rope)
            cos, sin = tables[id(lw.rope)]
            q, k = lw.rope.rotate(q, cos, sin), lw.rope.rotate(k, cos, sin)
        a = F.linear(attend(i, lw, q, k, v).transpose(1, 2).flatten(-2), lw.o, lw.o_bias)  # (B, 1, E)
        x = x + (a if lw.post_attn_norm is None else lw.post_attn_norm(a))
        gate, up = F.linear(lw.norm2(x), lw.gate_up).chunk(2, dim=-1)  # (B, 1, F) each
        m = F.linear(lw.act(gate) * up, lw.down)
        x = x + (m if lw.post_mlp_norm is None else lw.post_mlp_norm(m))
    return x


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The final norm, the LM head and the final soft-cap (Gemma 2): ``(..., E)`` -> ``(..., vocab)``."""
    logits = model.lm_head(model.model.norm(x))
    cap = model.config.final_softcap
    return logits if cap is None else torch.tanh(logits / cap) * cap


def fused_step(model: nn.Module, w: StepWeights, tokens: torch.Tensor, caches: list[StaticKVCache]) -> torch.Tensor:
    """Logits ``(B, 1, vocab)`` of ``tokens (B, 1)``, each layer's K/V appended at its cache's cursor: the eager
    model's decode step (``models.llama``) with fused projections, no host synchronisation and fixed shapes. The RoPE
    tables must already hold every position the caches reach (``GraphedDecoder`` grows them)."""
    first = caches[0]
    positions = (first.cursor - first.start).clamp_min(0)[:, None]  # (B, 1): RoPE positions, padding excluded

    def rotation(rope: RoPE) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.cos_cached[positions], rope.sin_cached[positions]  # (B, 1, rotary_dim) each

    def attend(i: int, lw: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = caches[i]
        k_kind, v_kind = cache.kinds
        slot = cache.cursor.view(1)
        cache.key.index_copy_(2, slot, as_stored(k, k_kind, key=True))
        cache.value.index_copy_(2, slot, as_stored(v, v_kind))
        cache.cursor.add_(1)
        return decode_op(q, cache.key, cache.value, cache.start, cache.cursor, lw.scale,
                         -1 if lw.window is None else lw.window, lw.softcap or 0.0, lw.sinks, k_kind.code,
                         v_kind.code)  # fmt: skip

    x = fused_layers(model, w, model.model.embed(tokens), rotation, attend)  # (B, 1, E)
    return logits_of(model, x)  # (B, 1, vocab)
