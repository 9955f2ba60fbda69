"""``GroupedQueryAttention``: projections, RoPE, KV cache and ``grouped_attention`` in one module.

Parameter names follow HF transformers (``q_proj, k_proj, v_proj, o_proj``) so Llama/Qwen2 attention weights load 1:1.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache.kv import _KVCache
from ..models.linear import Linear, linears
from .checks import check_dropout, check_heads, check_scale, check_softcap, check_window, shape_str
from .functional import grouped_attention
from .masks import merge_masks
from .quantized_cache import quantized_cache_attention
from .rope import RoPE


class GroupedQueryAttention(nn.Module):
    """Multi-head attention with ``num_kv_heads`` key/value heads shared by groups of ``num_heads // num_kv_heads``
    query heads.

    Parameters
    ----------
    embed_dim : int
        Feature size ``E`` of the query input and of the output.
    num_heads : int
        Query heads ``H_q``.
    num_kv_heads : int, optional
        Key/value heads ``H_kv``; ``None`` means ``num_heads`` (MHA), 1 is MQA. Must divide ``num_heads``.
    head_dim : int, optional
        ``D``; default ``embed_dim // num_heads``.
    qkv_bias, out_bias : bool
        Biases on the q/k/v projections (Qwen2: True) and on the output projection.
    dropout : float
        Dropout on the attention weights, in training mode only.
    rope : RoPE, optional
        Rotary embedding applied to queries and keys in self-attention; None for a layer without positions (NoPE).
    window, softcap : optional
        A sliding window and logit soft-capping, as ``grouped_attention`` takes them (Mistral, Gemma 2/3, gpt-oss).
    sinks : bool
        A learned sink logit per query head, ``self.sinks (H_q,)`` (gpt-oss), initialised to zero.
    qk_norm : bool
        Per-head RMSNorm of queries and keys before RoPE, ``self.q_norm`` / ``self.k_norm`` with a ``(D,)`` weight each
        (Qwen3, Gemma 3); ``norm_eps`` its epsilon; ``unit_offset_norm`` scales by ``1 + weight`` (Gemma's norms,
        weights initialised to zero) instead of ``weight``.
    scale : float, optional
        The scores' scale; default ``1 / sqrt(D)`` (Gemma: ``query_pre_attn_scalar ** -0.5``).
    kdim, vdim : int, optional
        Feature sizes of the key and value inputs for cross-attention; default ``embed_dim``.

    Shapes: ``x (*B, L, E)``; ``kv_input (*B, S, kdim)`` (or a ``(key_input, value_input)`` pair when
    ``kdim != vdim``); output ``(*B, L, E)``; weights ``(*B, H_q, L, S)``.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        qkv_bias: bool = False,
        out_bias: bool = False,
        dropout: float = 0.0,
        rope: RoPE | None = None,
        window: int | tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
        sinks: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        unit_offset_norm: bool = False,
        scale: float | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_heads(num_heads, num_kv_heads)
        for name, n in (("embed_dim", embed_dim), ("head_dim", head_dim), ("kdim", kdim), ("vdim", vdim)):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"{name} must be a positive int, got {n!r}")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(
                    f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}) unless head_dim is given"
                )
            head_dim = embed_dim // num_heads
        check_dropout(dropout, "dropout")
        if rope is not None and not isinstance(rope, RoPE):
            raise TypeError(f"rope must be a gqa.RoPE or None, got {type(rope).__name__}")
        if rope is not None and rope.head_dim != head_dim:
            raise ValueError(f"rope was built for head_dim {rope.head_dim} but this module has head_dim {head_dim}")

        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = (
            embed_dim,
            num_heads,
            num_kv_heads,
            head_dim,
        )
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.dropout = float(dropout)
        factory = {"device": device, "dtype": dtype}
        self.q_proj = Linear(embed_dim, num_heads * head_dim, bias=qkv_bias, **factory)
        self.k_proj = Linear(self.kdim, num_kv_heads * head_dim, bias=qkv_bias, **factory)
        self.v_proj = Linear(self.vdim, num_kv_heads * head_dim, bias=qkv_bias, **factory)
        self.o_proj = Linear(num_heads * head_dim, embed_dim, bias=out_bias, **factory)
        self.rope = rope
        check_scale(scale)
        self.window, self.softcap = check_window(window), check_softcap(softcap)
        self.scale = None if scale is None else float(scale)
        self.sinks = nn.Parameter(torch.zeros(num_heads, **factory)) if sinks else None
        norm = {"unit_offset": unit_offset_norm, **factory}
        self.q_norm = HeadRMSNorm(head_dim, norm_eps, **norm) if qk_norm else None
        self.k_norm = HeadRMSNorm(head_dim, norm_eps, **norm) if qk_norm else None

    @property
    def plain(self) -> bool:
        """Whether this is plain attention: no window, soft-capping, sinks, q/k norm or scale other than
        ``1/sqrt(D)`` (what the fused decode steps and kernels compute; they leave the rest to this module)."""
        return (
            self.window is None
            and self.softcap is None
            and self.sinks is None
            and self.q_norm is None
            and self.scale is None
        )

    def extra_repr(self) -> str:
        options = (("window", self.window), ("softcap", self.softcap), ("scale", self.scale))
        extra = "".join(f", {name}={value}" for name, value in options if value is not None)
        return f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}{extra}"

    def _heads(self, t: torch.Tensor, n: int) -> torch.Tensor:
        return t.unflatten(-1, (n, self.head_dim)).transpose(-2, -3)  # (*B, L, n*D) -> (*B, n, L, D)

    def _kv_inputs(
        self, x: torch.Tensor, kv_input: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_input is None:
            if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
                raise ValueError(f"kv_input is required: this module has kdim {self.kdim}, vdim {self.vdim}")
            return x, x
        key_in, value_in = kv_input if isinstance(kv_input, (tuple, list)) else (kv_input, kv_input)
        for name, t, feat in (("key input", key_in, self.kdim), ("value input", value_in, self.vdim)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"kv_input must be a tensor or a (key, value) pair of tensors, got {type(t).__name__}")
            if t.dim() != x.dim() or t.shape[:-2] != x.shape[:-2] or t.shape[-1] != feat:
                raise ValueError(
                    f"{name} must have shape (*B, S, {feat}) with the batch dims of x {shape_str(x)}, "
                    f"got {shape_str(t)}"
                )
        if key_in.shape[-2] != value_in.shape[-2]:
            raise ValueError(f"key input {shape_str(key_in)} and value input {shape_str(value_in)} differ in S")
        return key_in, value_in

    def forward(
        self,
        x: torch.Tensor,
        kv_input: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        position_ids: torch.Tensor | None = None,
        rope_cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: _KVCache | None = None,
        need_weights: bool = False,
        backend: str = "auto",
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``x (*B, L, E)`` to itself, or to ``kv_input`` (cross-attention).

        ``attn_mask`` broadcasts to ``(*B, H_q, L, S)`` (bool: True = attend; float: added). ``is_causal`` is aligned
        bottom-right, so it stays right when a cache makes ``S > L``. ``position_ids`` ``(L,)`` or ``(B, L)`` feed
        RoPE; by default ``0..L-1``, or the cache's per-row positions. ``rope_cos_sin`` (from ``RoPE.cos_sin``) skips
        that lookup when a model shares one RoPE table across layers. With ``cache`` (self-attention, ``x (B, L, E)``)
        the new K/V are appended and attention runs over everything cached; the cache's left padding is masked.
        Returns ``out (*B, L, E)``, or ``(out, weights (*B, H_q, L, S))`` with ``need_weights=True``.
        """
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-1] != self.embed_dim:
            got = shape_str(x) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (*B, L, {self.embed_dim}), got {got}")
        if cache is not None:
            if kv_input is not None:
                raise ValueError("cache is for self-attention; compute cross-attention K/V once and pass kv_input")
            if not isinstance(cache, _KVCache):
                raise TypeError(
                    f"cache must be a StaticKVCache, DynamicKVCache or WindowKVCache, got {type(cache).__name__}"
                )
            if x.dim() != 3:
                raise ValueError(f"with a cache, x must have shape (B, L, {self.embed_dim}), got {shape_str(x)}")
            if cache.start.shape[0] != x.shape[0]:  # (before its positions are taken for RoPE)
                raise ValueError(f"cache holds {cache.start.shape[0]} rows, x {shape_str(x)} has {x.shape[0]}")
        key_in, value_in = self._kv_inputs(x, kv_input)
        weight = getattr(self.q_proj, "weight", None)
        if torch.is_autocast_enabled(x.device.type):  # autocast casts the projections' inputs itself
            weight = None
        for name, t in (("x", x), ("kv_input", key_in), ("kv_input", value_in)):
            if isinstance(weight, torch.Tensor) and weight.is_floating_point() and t.dtype != weight.dtype:
                raise ValueError(f"{name} is {t.dtype}, the module's weights {weight.dtype}: convert one "
                                 f"(module.to({t.dtype}) or {name}.to({weight.dtype}))")  # fmt: skip
        L = x.shape[-2]

        if key_in is x and value_in is x:  # self-attention: one pass over the three projections
            q, k, v = linears(x, (self.q_proj, self.k_proj, self.v_proj))
        else:
            q, k, v = self.q_proj(x), self.k_proj(key_in), self.v_proj(value_in)
        q = self._heads(q, self.num_heads)  # (*B, H_q, L, D)
        k = self._heads(k, self.num_kv_heads)  # (*B, H_kv, S, D)
        v = self._heads(v, self.num_kv_heads)  # (*B, H_kv, S, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None and kv_input is None:
            if rope_cos_sin is None:
                if position_ids is None:
                    position_ids = cache.positions(L) if cache is not None else torch.arange(L, device=x.device)
                q, k = self.rope(q, k, position_ids)
            else:
                q, k = self.rope.rotate(q, *rope_cos_sin), self.rope.rotate(k, *rope_cos_sin)
        if cache is not None:
            keys = getattr(cache, "window", None)  # a WindowKVCache keeps only the keys its queries see
            if keys is not None and (self.window is None or self.window[0] is None or self.window[0] + 1 > keys):
                raise ValueError(f"a WindowKVCache of {keys} keys needs a module with a window of at most "
                                 f"{keys - 1} keys to the left, this one has {self.window}")  # fmt: skip
            k, v = cache.update(k, v)  # (B, H_kv, S, D) with S = everything cached
            cache_mask, is_causal = cache.visibility(L, k.shape[-2], is_causal)
            attn_mask = merge_masks(attn_mask, cache_mask)
            if cache.quantized:  # the blocks, read where they lie
                if need_weights or (self.training and self.dropout > 0):
                    raise ValueError("a quantized KV cache is for inference: no need_weights, no dropout")
                out = quantized_cache_attention(q, k, v, cache.kinds, attn_mask, is_causal, self.scale,
                                                window=self.window, softcap=self.softcap, sinks=self.sinks)  # fmt: skip
                return self.o_proj(out.transpose(-2, -3).flatten(-2))

        dropout_p = self.dropout if self.training else 0.0
        result = grouped_attention(
            q, k, v, attn_mask, dropout_p, is_causal, self.scale, window=self.window, softcap=self.softcap,
            sinks=self.sinks, return_weights=need_weights, backend=backend,
        )  # fmt: skip
        out, weights = result if need_weights else (result, None)
        out = self.o_proj(out.transpose(-2, -3).flatten(-2))  # (*B, H_q, L, D) -> (*B, L, E)
        return (out, weights) if need_weights else out


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's ``D`` features (Qwen3's and Gemma 3's q/k norm), in float32 as HF transformers does:
    ``weight * x / rms(x)`` cast back before the weight (Qwen3), or with ``unit_offset`` ``x / rms(x) * (1 + weight)``
    cast back after it (Gemma, whose weights are stored as offsets from 1)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, unit_offset: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype) if unit_offset else
                                   torch.ones(dim, device=device, dtype=dtype))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)
