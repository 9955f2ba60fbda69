"""Decoding on a GPU through CUDA graphs: one graph launch per token instead of ~15 kernel launches per layer.

A decoded token is a few small kernels per layer, each shorter than the time the CPU takes to launch it, so eager
PyTorch leaves the GPU idle most of the time. ``static_step`` is a decode step that never reads a value back to the
host and never changes a shape: every layer writes its new K/V at its cache's cursor (a device tensor) with
``index_copy_``, the split-KV kernel reads each row's ``[start, cursor]`` slots of the *whole* preallocated cache from
device memory, and RoPE looks its angles up from a table sized for the cache. Such a step can be captured once and
replayed: ``GraphedDecoder`` runs the first step eagerly (which also compiles the Triton kernels), captures the
second and replays the graph from then on. ``gqa.decoding.generate`` uses it for every model on CUDA.

What it captures is ``fused_step.fused_step`` (one GEMM for q/k/v and one for gate/up; every family: windows,
soft-caps, sinks, q/k norms, Gemma's layers) where the model's projections are plain float linears, else
``static_step`` (plain Llama layers); with ``compile=True`` (``generate(compile=True)``, ``gqa generate
--compile``) the fused step is compiled by Inductor first, which fuses the norms, RoPE, the cache writes and the
residual adds into a few kernels per layer, and the compiled step is what the graph holds.
"""

from __future__ import annotations

import math

import torch

from ..cache.kv import StaticKVCache
from ..cache.quantize import as_stored
from ..kernels.triton.split_kv import split_kv_attention
from ..models.linear import linears
from ..models.quantized import QuantizedLinear
from .fused_step import fused_applies, fused_step, step_ropes, step_weights


def graphs_apply(model: torch.nn.Module, caches: list | None) -> str | None:
    """``None`` if ``GraphedDecoder`` can decode ``model`` over ``caches`` (None: over static caches, not yet made),
    else why not."""
    if model.device.type != "cuda":
        return f"device {model.device.type} (CUDA only)"
    if any(isinstance(m, QuantizedLinear) for m in model.modules()):  # their CUDA path reads the blocks on the host
        return "quantized weights (QuantizedLinear: load the model on CUDA to have them dequantized)"
    if getattr(model, "shard", None) is not None:
        return "tensor parallelism"
    if caches is not None and not all(isinstance(c, StaticKVCache) for c in caches):
        return "caches that are not StaticKVCache"
    if model.training:
        return "training mode"
    why_not = fused_applies(model)
    if why_not is None:  # the fused step takes every family
        return None
    if not (model.runs_llama_layers() and all(layer.self_attn.plain for layer in model.model.layers)):
        return f"{why_not}, in a model whose layers are not plain Llama layers (static_step's)"
    return None


def static_step(model: torch.nn.Module, tokens: torch.Tensor, caches: list[StaticKVCache]) -> torch.Tensor:
    """Logits ``(B, 1, vocab)`` of ``tokens (B, 1)``, appending each layer's K/V to its cache — the eager model's
    decode step with no host synchronisation and fixed shapes (module docstring). The caches must have room."""
    backbone = model.model
    first = caches[0]
    positions = (first.cursor - first.start).clamp_min(0)[:, None]  # (B, 1): RoPE positions, padding excluded
    rope = backbone.rope
    cos, sin = rope.cos_cached[positions], rope.sin_cached[positions]  # (B, 1, rotary_dim) each
    x = backbone.embed_tokens(tokens)  # (B, 1, E)
    for layer, cache in zip(backbone.layers, caches, strict=True):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = linears(h, (attn.q_proj, attn.k_proj, attn.v_proj))
        q = rope.rotate(attn._heads(q, attn.num_heads), cos, sin)  # (B, H_q, 1, D)
        k = rope.rotate(attn._heads(k, attn.num_kv_heads), cos, sin)  # (B, H_kv, 1, D)
        v = attn._heads(v, attn.num_kv_heads)  # (B, H_kv, 1, D)
        k_kind, v_kind = cache.kinds
        slot = cache.cursor.view(1)
        cache.key.index_copy_(2, slot, as_stored(k, k_kind, key=True))  # a quantized cache: the row's blocks
        cache.value.index_copy_(2, slot, as_stored(v, v_kind))
        cache.cursor.add_(1)
        # (B, H_q, 1, D): each row's slots [start, cursor) of the whole cache
        a = split_kv_attention(q, cache.key, cache.value, scale=1.0 / math.sqrt(attn.head_dim), start=cache.start,
                               end=cache.cursor, k_format=k_kind.code, v_format=v_kind.code)  # fmt: skip
        x = x + attn.o_proj(a.transpose(1, 2).flatten(-2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.lm_head(backbone.norm(x))  # (B, 1, vocab)


class GraphedDecoder:
    """``step(tokens (B, 1), caches) -> logits (B, 1, vocab)`` for ``gqa.decoding.generate``: ``static_step`` run
    eagerly once, then captured into a CUDA graph and replayed for every later token over the same caches. Warm-up
    and capture run on one side stream of the model's device (made current around every call: Triton launches on
    the current device), and the RoPE tables the graph reads by address are kept alive here (a table grown later by
    another caller is a new tensor)."""

    def __init__(self, model: torch.nn.Module, caches: list[StaticKVCache], *, compile: bool = False) -> None:
        reason = graphs_apply(model, caches)
        if reason is not None:
            raise ValueError(f"CUDA graph decoding does not apply: {reason}")
        self.model, self.caches = model, caches
        self.step, self.name = _step_for(model, compile)
        self.tokens = torch.zeros(caches[0].key.shape[0], 1, dtype=torch.long, device=model.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.steps = 0
        ropes = [*step_ropes(model), *([model.model.rope] if getattr(model.model, "rope", None) is not None else [])]
        for rope in ropes:  # every position the caches can reach, in every table, before capture
            if rope.cos_cached.shape[0] < caches[0].capacity:
                rope.cos_sin(torch.tensor([caches[0].capacity - 1], device=model.device))
        self.tables = [(rope.cos_cached, rope.sin_cached) for rope in ropes]
        with torch.cuda.device(model.device):
            self.side = torch.cuda.Stream()

    def __call__(self, tokens: torch.Tensor, caches: list[StaticKVCache]) -> torch.Tensor:
        if caches is not self.caches:
            raise ValueError("this GraphedDecoder was captured over other caches")
        if self.caches[0].seq_len >= self.caches[0].capacity:
            raise ValueError(f"StaticKVCache overflow: all {self.caches[0].capacity} slots are written")
        with torch.cuda.device(self.tokens.device):
            self.tokens.copy_(tokens)
            self.steps += 1
            if self.graph is None and self.steps == 1:  # eager: compiles the Triton kernels, creates library handles
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    logits = self.step(self.tokens, self.caches)
                torch.cuda.current_stream().wait_stream(self.side)
                return logits
            if self.graph is None:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, stream=self.side, capture_error_mode="thread_local"):
                    self.logits = self.step(self.tokens, self.caches)
            self.graph.replay()
            return self.logits.clone()


def _step_for(model: torch.nn.Module, compile: bool):
    """``(step(tokens, caches) -> logits, name)``: the fused step where it applies (compiled if asked), else
    ``static_step``."""
    if fused_applies(model) is not None:
        return (lambda tokens, caches: static_step(model, tokens, caches)), "static"
    weights = step_weights(model)
    if not compile:
        return (lambda tokens, caches: fused_step(model, weights, tokens, caches)), "fused"
    _allow_recompiles()
    compiled = torch.compile(fused_step, dynamic=False)
    return (lambda tokens, caches: compiled(model, weights, tokens, caches)), "fused+compile"


def _allow_recompiles(limit: int = 64) -> None:
    """One compilation per model and batch size of ``fused_step``: more than dynamo's default of 8."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if getattr(config, name, limit) < limit:
            setattr(config, name, limit)
