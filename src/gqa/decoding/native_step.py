"""The decode step users get by default on CPU: one new token per row through every layer with the native kernels.

A decoded token is a few thousand multiply-adds per weight row and little else, so in eager PyTorch the ~100 small
ATen ops per layer (norms, RoPE, the cache write, masks, reshapes, residual adds) cost as much as streaming the
weights. Here the whole step — every layer, the final norm and ``lm_head`` — is one native call,
``gqa::decode_model`` (``kernels/csrc/decode_step.cpp``): per layer a GEMV over q/k/v with RoPE and the cache write,
grouped attention over each row's slots ``[start, cursor]``, ``o_proj``, a GEMV over gate/up with SwiGLU and
``down_proj``, float or block-quantized weights alike, run as phases of small chunks that the calling thread and a
pool of workers claim (``kernels/csrc/team.h``): a thread that loses its core to other work holds up one chunk, not
every op of the step. Models the one call cannot take run a ``gqa::decode_layer`` call per layer, and layers it
cannot take whole (tensor parallelism's all-reducing projections) run the same ops one call each from Python. Values
round to the model's dtype where the eager code rounds, so every path gives the eager path's results (tested against
HF transformers, and bit for bit against each other); ``decoding.steps.select_step`` picks this step on CPU and runs
it whenever it applies (``applies``), the eager forward otherwise. No compilation, so the first token is as fast as
the rest.
"""

from __future__ import annotations

import math
import weakref

import torch

from .. import kernels
from ..cache.kv import StaticKVCache
from ..cache.quantize import native_reads
from ..cache.window import SlotRows, WindowKVCache
from ..kernels import ops
from ..models.linear import Linear, linears
from ..models.quantized import QuantizedLinear

# Batch rows per step. The GEMVs stream each weight chunk once for all rows (4 at a time from cache), which beats the
# eager GEMMs up to this many rows (docs/performance.md, "One native call per decoded token"); beyond it they win.
MAX_ROWS = 64
DTYPES = (torch.float32, torch.bfloat16)


def applies(model: torch.nn.Module, input_ids: torch.Tensor, caches: list | None) -> bool:
    """Whether ``decode_step`` runs this call: one token per row (B <= MAX_ROWS) into static caches (or, where the
    one call runs the model, window caches too) on CPU, float32 or bfloat16, native kernels built, no autograd, eval
    mode, full half-rotation RoPE, not under ``torch.compile``, and room left in the caches (a full cache goes the
    eager way, which says so)."""
    if caches is None or input_ids.shape[1] != 1 or input_ids.shape[0] > MAX_ROWS or torch.compiler.is_compiling():
        return False
    if torch.is_grad_enabled() or model.training or model.dtype not in DTYPES or model.device.type != "cpu":
        return False
    rope = model.model.rope
    if rope.interleaved or rope.rotary_dim != rope.head_dim or not kernels.vectorized():
        return False
    first = caches[0]
    static = all(isinstance(c, StaticKVCache) for c in caches)  # window caches: only the one call reads them
    if not static and not (all(isinstance(c, (StaticKVCache, WindowKVCache)) for c in caches) and whole_model(model)):
        return False
    if first.quantized and not whole_model(model):  # the call per layer (decode_attend) reads float caches only
        return False
    if not native_reads(first.kinds):  # fp8: CUDA's
        return False
    return first.dtype == model.dtype and first.key.shape[0] == input_ids.shape[0] and first.seq_len < first.capacity


def decode_step(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    caches: list[StaticKVCache | WindowKVCache],
    greedy: torch.Tensor | None = None,
    weights: ops.DecodeWeights | None = None,
) -> torch.Tensor:
    """Logits ``(B, 1, vocab)`` of ``input_ids (B, 1)``, appending each layer's K/V to its cache (``applies`` must
    hold). ``greedy``, an int64 ``(B,)`` tensor, gets each row's argmax (``logits.float().argmax(-1)``), found by the
    native call while it writes the logits. ``weights``: ``decode_weights(model, model.dtype)`` gathered by the caller
    for a whole generation (checking every module for a replacement costs ~0.45 ms a step); ``None``: gathered here."""
    B = input_ids.shape[0]
    backbone = model.model
    (cos, sin), local_rope = rope_rows(model, caches[0].positions(1))
    x = backbone.embed(input_ids).view(B, -1)  # (B, E)
    whole = weights if weights is not None else decode_weights(model, x.dtype)
    if whole is not None:  # every layer, the final norm and lm_head in one native call
        rows = [c.native_rows() if isinstance(c, WindowKVCache) else c for c in caches]  # window caches: their slots
        group = reduce_group(model)
        logits = ops.decode_model(x, whole, cos, sin, rows, greedy if group is None else None, local_rope=local_rope,
                                  kv_formats=caches[0].kv_formats, reduce_group=group)  # fmt: skip
        for r in rows:
            if isinstance(r, SlotRows):
                r.advance()
        if group is not None:  # a tensor-parallel rank: its slice of the vocabulary's logits, joined
            logits = model.lm_head.join(logits)
            if greedy is not None:
                greedy.copy_(logits.float().argmax(-1))
        return final_softcap(model, logits, greedy).view(B, 1, -1)
    if not model.runs_llama_layers():
        raise RuntimeError(f"the native step computes {model.config.arch}'s layers in one call only (whole_model)")
    for layer, cache in zip(backbone.layers, caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        scale = 1.0 / math.sqrt(attn.head_dim)
        fused = _layer_weights(layer, x.dtype)
        if fused is not None:  # the whole layer in one native call
            x = ops.decode_layer(
                x, layer.input_layernorm.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.eps,
                *fused, cos, sin, cache, scale,
            )  # fmt: skip
            continue
        h = ops.rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
        q, k, v = linears(h, (attn.q_proj, attn.k_proj, attn.v_proj))  # (B, H_q*D), (B, H_kv*D), (B, H_kv*D)
        if attn.q_norm is not None:  # Qwen3: each head's q and k normalised before RoPE (decode_attend applies it)
            D = attn.head_dim
            q = ops.rms_norm(q.reshape(-1, D), attn.q_norm.weight, attn.q_norm.eps).view(B, -1)
            k = ops.rms_norm(k.reshape(-1, D), attn.k_norm.weight, attn.k_norm.eps).view(B, -1)
        a = ops.decode_attend(q, k, v, cos, sin, cache, scale)
        x = x + attn.o_proj(a)
        h = ops.rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        gate, up = linears(h, (mlp.gate_proj, mlp.up_proj))  # (B, F) each
        x = x + mlp.down_proj(ops.silu_mul(gate, up))
    x = ops.rms_norm(x, backbone.norm.weight, backbone.norm.eps)
    logits = model.lm_head(x)
    if greedy is not None:
        greedy.copy_(logits.float().argmax(-1))
    return logits.view(B, 1, -1)


def rope_rows(
    model: torch.nn.Module, positions: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]:
    """``(cos, sin)`` ``(B, D)`` float32 of ``positions (B, 1)``, and those of the local RoPE (Gemma 3's sliding
    layers) or ``None``, as the native calls take them."""
    rotations = model.model.rotations(positions)  # (cos, sin) (B, 1, D), or Gemma's (global, local) pair of them
    glob, local = rotations if model.config.gemma else (rotations, None)
    B = positions.shape[0]
    rows = tuple(t.view(B, -1).contiguous() for t in glob)
    return rows, None if local is None or local is glob else tuple(t.view(B, -1).contiguous() for t in local)


def final_softcap(model: torch.nn.Module, logits: torch.Tensor, greedy: torch.Tensor | None) -> torch.Tensor:
    """Gemma 2's final-logit soft-capping on the native call's ``logits``, as the eager forward applies it (and the
    greedy picks taken again on the capped logits); other models' logits as they are."""
    cap = model.config.final_softcap
    if cap is None:
        return logits
    logits = torch.tanh(logits / cap) * cap
    if greedy is not None:
        greedy.copy_(logits.float().argmax(-1))
    return logits


_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (modules, dtype, DecodeWeights | None)


def decode_weights(model: torch.nn.Module, dtype: torch.dtype) -> ops.DecodeWeights | None:
    """What the one-call step reads of ``model`` in ``dtype`` (``None`` where a layer or lm_head is something it
    cannot take: ``_decode_weights``), rebuilt only when one of the modules it reads was replaced or the dtype
    changed (walking every layer's modules through ``nn.Module.__getattr__`` costs ~1.4 ms, a tenth of a quantized
    step). A tensor-parallel rank's model gives its shards: ``o_proj``/``down_proj`` read as plain matrices (the call
    all-reduces their products over ``reduce_group(model)``), ``lm_head`` its vocabulary rows."""
    modules = _step_modules(model)
    cached = _WEIGHTS.get(model)
    same = cached is not None and cached[1] == dtype and len(cached[0]) == len(modules)
    if same and all(a is b for a, b in zip(cached[0], modules, strict=True)):  # identity: a tensor's == is per element
        return cached[2]
    weights = _decode_weights(model, dtype, sharded=reduce_group(model) is not None)
    _WEIGHTS[model] = (modules, dtype, weights)
    return weights


def reduce_group(model: torch.nn.Module) -> str | None:
    """The name of the process group a tensor-parallel rank's model (``shard_model``'s) all-reduces over, else
    ``None``."""
    group = getattr(model, "tp_group", False)
    if group is False:
        return None
    import torch.distributed as dist

    return (group or dist.group.WORLD).group_name


def _step_modules(model: torch.nn.Module) -> tuple:
    """Every module ``_decode_weights`` reads and each one's parameters and buffers, by direct ``_modules`` lookups: a
    tuple compared by identity, so a replaced module, weight or block buffer is seen."""
    head = model._modules["lm_head"]
    modules = [head, *head._modules.values(), model._modules["model"]._modules["norm"]]  # a rank's head: its part
    for layer in model._modules["model"]._modules["layers"]._modules.values():
        m = layer._modules
        attn, mlp = m["self_attn"]._modules, m["mlp"]._modules
        modules += tuple(attn[name] for name in ("q_norm", "k_norm") if attn.get(name) is not None)
        modules += tuple(m[name] for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm") if name in m)
        modules += (m["input_layernorm"], m["post_attention_layernorm"], attn["q_proj"], attn["k_proj"])
        modules += (attn["v_proj"], attn["o_proj"], mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"])
    out = []
    for module in modules:
        out += (module, *module._parameters.values(), *module._buffers.values())
    return tuple(out)


def _decode_weights(model: torch.nn.Module, dtype: torch.dtype, sharded: bool = False) -> ops.DecodeWeights | None:
    """``DecodeWeights`` of ``model``, or ``None`` when a layer cannot be fused (``_layer_weights``), the layers'
    norms differ in eps, lm_head is neither a float ``Linear`` in ``dtype`` nor a ``QuantizedLinear`` without
    bias, or the attention has what the one call does not compute (``_layer_options``). ``sharded``: a
    tensor-parallel rank's (``decode_weights``)."""
    backbone = model.model
    layers = backbone.layers
    options = _layer_options(model, dtype)
    if options is None:
        return None
    eps = layers[0].input_layernorm.eps
    head = model.lm_head.part if sharded else model.lm_head
    if type(head) is QuantizedLinear and head.bias is None:
        head_weight, head_format = head.blocks, head.format.code
    elif type(head) is Linear and head.bias is None and head.weight.dtype == dtype and head.weight.is_contiguous():
        head_weight, head_format = head.weight, -1
    else:
        return None
    gemma = model.config.gemma
    norms1, norms2, post_norms, weights, formats, biases = [], [], [], [], [], []
    for layer in layers:
        fused = _layer_weights(layer, dtype, qk_norm=True, sharded=sharded)
        if fused is None or layer.input_layernorm.eps != eps:
            return None
        norms1.append(layer.input_layernorm.weight)
        if gemma:  # the norm before the MLP, and the two after attention and the MLP
            if layer.pre_feedforward_layernorm.eps != eps or layer.post_feedforward_layernorm.eps != eps:
                return None
            norms2.append(layer.pre_feedforward_layernorm.weight)
            post_norms += [layer.post_attention_layernorm.weight, layer.post_feedforward_layernorm.weight]
        else:
            norms2.append(layer.post_attention_layernorm.weight)
        weights += fused[0]
        formats += fused[1]
        biases += fused[2]
    if any(n.dtype != dtype or not n.is_contiguous() for n in norms1 + norms2 + post_norms):
        return None
    if gemma:
        options |= {"post_norms": post_norms, "offset_norms": True, "gelu": True}
    attn = layers[0].self_attn
    scale = attn.scale if attn.scale is not None else 1.0 / math.sqrt(attn.head_dim)
    return ops.DecodeWeights(norms1, norms2, eps, weights, formats, biases, scale, backbone.norm.weight,
                             backbone.norm.eps, head_weight, head_format, **options)  # fmt: skip


def _layer_options(model: torch.nn.Module, dtype: torch.dtype) -> dict | None:
    """``DecodeWeights``' per-layer options of ``model``: q/k norms (every layer's or none, one eps), windows (a left
    side only: a decoded token is the last query, so a right side hides nothing), which layers rotate and with which
    tables, and soft-caps; ``None`` for attention the one call does not compute (sinks, a score scale that differs
    between layers or, outside Gemma, from ``1/sqrt(D)``)."""
    cfg = model.config
    attns = [layer.self_attn for layer in model.model.layers]
    if any(a.sinks is not None or a.scale != attns[0].scale for a in attns):
        return None
    if not cfg.gemma and any(a.softcap is not None or a.scale is not None for a in attns):
        return None
    if any(a.window is not None and a.window[0] is None for a in attns):
        return None
    options: dict = {}
    normed = [a.q_norm is not None for a in attns]
    if any(normed):
        eps = {n.eps for a in attns for n in (a.q_norm, a.k_norm) if n is not None}
        norms = [n.weight for a in attns for n in (a.q_norm, a.k_norm) if n is not None]
        if not all(normed) or len(eps) != 1 or any(w.dtype != dtype or not w.is_contiguous() for w in norms):
            return None
        options |= {"qk_norms": norms, "qk_eps": eps.pop()}
    if any(a.window is not None for a in attns):
        options["windows"] = [-1 if a.window is None else int(a.window[0]) for a in attns]
    if cfg.gemma:  # the sliding layers of Gemma 3 rotate with the local tables
        options["rotates"] = [2 if layer.local_rope else 1 for layer in model.model.layers]
        options["softcaps"] = [float(a.softcap or 0.0) for a in attns]
    elif any(a.rope is None for a in attns):
        options["rotates"] = [int(a.rope is not None) for a in attns]
    return options


def whole_model(model: torch.nn.Module) -> bool:
    """Whether ``decode_step`` runs ``model`` in one native call (``decode_weights``): then its windows, q/k norms and
    NoPE layers are computed there; otherwise layer by layer, which knows q/k norms but neither windows nor NoPE."""
    return decode_weights(model, model.dtype) is not None


def _layer_weights(
    layer: torch.nn.Module, dtype: torch.dtype, qk_norm: bool = False, sharded: bool = False
) -> tuple[list, list[int], list] | None:
    """``(weights, formats, qkv_biases)`` for ``ops.decode_layer`` — q, k, v, o, gate, up, down as float matrices
    (format -1) or quantized blocks (their format's code) — or ``None`` when a part is something else (e.g. the
    all-reducing projections of tensor parallelism, output biases, norms with different eps): then the layer runs
    op by op. ``qk_norm``: the caller computes q/k norms (the one call does, ``gqa::decode_layer`` does not).
    ``sharded``: a tensor-parallel rank's layer, whose all-reducing ``o_proj``/``down_proj`` are read as their
    matrices (the caller sums their products over the ranks)."""
    attn, mlp = layer.self_attn, layer.mlp
    if layer.input_layernorm.eps != layer.post_attention_layernorm.eps or (attn.q_norm is not None and not qk_norm):
        return None  # q/k norm: op by op (gqa::decode_layer knows no q/k norm)
    weights, formats = [], []
    for module in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        reducing = sharded and module in (attn.o_proj, mlp.down_proj)  # ReducingLinear / ReducingQuantizedLinear
        blocks = type(module) is QuantizedLinear or (reducing and isinstance(module, QuantizedLinear))
        plain = type(module) is Linear or (reducing and isinstance(module, Linear))
        if blocks:
            weights.append(module.blocks)
            formats.append(module.format.code)
        elif plain and module.weight.dtype == dtype and module.weight.is_contiguous():
            weights.append(module.weight)
            formats.append(-1)
        else:
            return None
    biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    if attn.o_proj.bias is not None or any(m.bias is not None for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
        return None
    if any(b is not None and b.dtype != dtype for b in biases):
        return None
    return weights, formats, biases
