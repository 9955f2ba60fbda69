"""How one attention layer's K/V heads become ``num_kv_heads`` heads: exact expansion, and a registry of reduction
methods (``mean``: the GQA paper's mean-pooling; ``first``: its keep-one baseline).

Layouts (HF): ``q_proj (H_q * D, hidden)``, ``k_proj``/``v_proj (H_kv * D, hidden)`` with head ``h`` in rows
``[h * D, (h + 1) * D)``, ``o_proj (hidden, H_q * D)`` with query head ``i`` in columns ``[i * D, (i + 1) * D)``.
Query head ``i`` reads KV head ``i // (H_q // H_kv)``, so reducing to ``N`` heads merges groups of
``H_kv // N`` adjacent KV heads, and expanding repeats each head ``N // H_kv`` times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..models.config import ModelConfig

__all__ = [
    "METHODS",
    "AttentionWeights",
    "Method",
    "check_kv_heads",
    "convert_layer",
    "layer_tensor_names",
    "layer_weights",
    "put_layer_weights",
    "register_method",
    "with_bias_column",
    "with_ones_column",
]

_PROJ = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}


def layer_tensor_names(i: int) -> dict[str, str]:
    """``AttentionWeights`` field -> HF tensor name in layer ``i`` (``model.layers.{i}.self_attn.q_proj.weight``)."""
    p = f"model.layers.{i}.self_attn."
    names = {f: f"{p}{proj}.weight" for f, proj in _PROJ.items()}
    return names | {f"{f}_bias": f"{p}{_PROJ[f]}.bias" for f in ("q", "k", "v")}


@dataclass
class AttentionWeights:
    """One layer's attention projections, HF layout (``D`` head dim, ``E`` hidden size).

    Attributes
    ----------
    q : (H_q * D, E)     k, v : (H_kv * D, E)     o : (E, H_q * D)
    q_bias : (H_q * D,) or None     k_bias, v_bias : (H_kv * D,) or None  (Qwen2 has them; Llama usually not)
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> AttentionWeights:
        """The same weights on ``device`` (these very tensors where they are there already)."""
        return AttentionWeights(**{f: None if (t := getattr(self, f)) is None else t.to(device)
                                   for f in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias")})  # fmt: skip


def layer_weights(state: dict[str, torch.Tensor], i: int) -> AttentionWeights:
    """Layer ``i``'s attention projections from tensors by HF name (absent biases: ``None``)."""
    return AttentionWeights(**{f: state.get(n) for f, n in layer_tensor_names(i).items()})


def put_layer_weights(state: dict[str, torch.Tensor], i: int, w: AttentionWeights) -> None:
    """Store ``w`` as layer ``i``'s attention tensors in ``state`` (by HF name; ``None`` fields left out)."""
    for f, n in layer_tensor_names(i).items():
        if getattr(w, f) is not None:
            state[n] = getattr(w, f)


class Method(Protocol):
    """A reduction method: ``H_kv`` KV heads -> ``num_kv_heads`` (a divisor of ``H_kv``, smaller than it).

    Parameters
    ----------
    w : AttentionWeights
        The layer's weights, float32, ``cfg.num_kv_heads`` KV heads. Do not modify them in place.
    cfg : ModelConfig
        The source model's config (``num_heads`` H_q, ``num_kv_heads`` H_kv, ``head_dim`` D, RoPE settings).
    num_kv_heads : int
        N, the new KV head count.
    activations : (T, E) tensor or None
        Calibration inputs of this layer's attention (the hidden states after ``input_layernorm`` on
        ``calibration_text``): from the source model, or, with the ``o_proj`` refit (``gqa.convert.refit``), from
        the model converted so far (earlier layers merged and refit). ``None`` when no calibration text was given.

    Returns
    -------
    AttentionWeights
        ``k``/``v (N * D, E)`` (and biases ``(N * D,)`` when the source has them); ``q``/``o`` may change too
        (e.g. to absorb a transform applied to the keys or values) but keep their shapes. Query head ``i`` will
        read new KV head ``i // (H_q // N)``.
    """

    def __call__(
        self, w: AttentionWeights, cfg: ModelConfig, num_kv_heads: int, activations: torch.Tensor | None
    ) -> AttentionWeights: ...


METHODS: dict[str, Method] = {}


def register_method(name: str) -> Callable[[Method], Method]:
    """Decorator adding a reduction method to ``METHODS`` under ``name`` (``convert(..., method=name)``)."""

    def add(fn: Method) -> Method:
        if name in METHODS:
            raise ValueError(f"a conversion method named {name!r} is already registered")
        METHODS[name] = fn
        return fn

    return add


def with_ones_column(t: torch.Tensor) -> torch.Tensor:
    """``(..., E) -> (..., E + 1)`` float64 with a last column of ones (biases as weights)."""
    return torch.cat([t.double(), t.new_ones(*t.shape[:-1], 1, dtype=torch.float64)], -1)


def with_bias_column(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``(rows, E) -> (rows, E + 1)`` float64: the bias (or zeros) as a last column."""
    b = weight.new_zeros(weight.shape[0]) if bias is None else bias
    return torch.cat([weight, b[:, None]], 1).double()


def _heads(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """``(n * D, ...)`` -> ``(n, D, ...)``: one slice per head."""
    return None if t is None else t.reshape(n, -1, *t.shape[1:])


def _pool(
    w: AttentionWeights, cfg: ModelConfig, n: int, pool: Callable[[torch.Tensor], torch.Tensor]
) -> AttentionWeights:
    """Apply ``pool`` over each group of ``H_kv // n`` adjacent heads of k, v and their biases; q, o unchanged."""
    m = cfg.num_kv_heads // n  # old heads per new head

    def merge(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        g = _heads(t, cfg.num_kv_heads)  # (H_kv, D, ...)
        g = g.reshape(n, m, *g.shape[1:])  # (N, m, D, ...): group j holds old heads j*m .. j*m + m - 1
        return pool(g).reshape(n * cfg.head_dim, *t.shape[1:]).contiguous()  # (N * D, ...)

    return replace(w, k=merge(w.k), v=merge(w.v), k_bias=merge(w.k_bias), v_bias=merge(w.v_bias))


@register_method("mean")
def mean_pool(
    w: AttentionWeights, cfg: ModelConfig, num_kv_heads: int, activations: torch.Tensor | None = None
) -> AttentionWeights:
    """The GQA paper (arXiv 2305.13245): each new K/V head (weights and bias) is the mean of its group's heads."""
    # summed in float64: the mean of identical heads is that head exactly (so expand-then-mean round-trips)
    return _pool(w, cfg, num_kv_heads, lambda g: g.double().mean(dim=1).to(g.dtype))


@register_method("first")
def keep_first(
    w: AttentionWeights, cfg: ModelConfig, num_kv_heads: int, activations: torch.Tensor | None = None
) -> AttentionWeights:
    """The paper's baseline: each new K/V head is the first head of its group; the others are dropped."""
    return _pool(w, cfg, num_kv_heads, lambda g: g[:, 0])


def expand(w: AttentionWeights, cfg: ModelConfig, num_kv_heads: int) -> AttentionWeights:
    """Exact: new head ``j`` is old head ``j // (N // H_kv)``, so every query head reads the same K/V as before."""
    r = num_kv_heads // cfg.num_kv_heads

    def rep(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        g = _heads(t, cfg.num_kv_heads).repeat_interleave(r, dim=0)  # (N, D, ...)
        return g.reshape(num_kv_heads * cfg.head_dim, *t.shape[1:]).contiguous()

    return replace(w, k=rep(w.k), v=rep(w.v), k_bias=rep(w.k_bias), v_bias=rep(w.v_bias))


def check_kv_heads(cfg: ModelConfig, num_kv_heads: int, method: str) -> None:
    """Raise ``ValueError`` unless ``cfg``'s KV heads can become ``num_kv_heads`` with ``method``."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; known methods: {', '.join(sorted(METHODS))}")
    n, h_q, h_kv = num_kv_heads, cfg.num_heads, cfg.num_kv_heads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"kv_heads must be a positive int, got {n!r}")
    if h_q % n:
        raise ValueError(f"kv_heads ({n}) must divide the number of query heads num_heads ({h_q})")
    if n > h_kv and n % h_kv:
        raise ValueError(
            f"kv_heads ({n}) must be a multiple of the model's num_kv_heads ({h_kv}) to expand exactly: each query "
            f"head must keep reading one copy of its own KV head"
        )
    if n < h_kv and h_kv % n:
        raise ValueError(f"kv_heads ({n}) must divide the model's num_kv_heads ({h_kv}) to merge groups of heads")


def _check_result(out: AttentionWeights, w: AttentionWeights, cfg: ModelConfig, n: int, method: str) -> None:
    kv = (n * cfg.head_dim, cfg.hidden_size)
    want = {"q": tuple(w.q.shape), "k": kv, "v": kv, "o": tuple(w.o.shape)}
    for name in ("q", "k", "v"):
        bias = getattr(w, f"{name}_bias")
        want[f"{name}_bias"] = None if bias is None else (want[name][0],)
    for name, shape in want.items():
        t = getattr(out, name)
        got = None if t is None else tuple(t.shape)
        if got != shape:
            raise ValueError(f"method {method!r} returned {name} of shape {got}, expected {shape}")


def local_rope(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer ``layer`` rotates with the local RoPE (Gemma 3's sliding layers), as ``GemmaBackbone`` builds."""
    return cfg.rope_local_theta is not None and cfg.layer_window(layer) is not None


def rope_config(cfg: ModelConfig, local: bool) -> ModelConfig:
    """``cfg`` with the RoPE a layer rotates by, for the merges that follow RoPE's planes: with ``local`` (Gemma 3's
    sliding layers) ``rope_local_theta``, unscaled; else ``cfg`` itself."""
    return replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling=None) if local else cfg


def convert_layer(
    w: AttentionWeights,
    cfg: ModelConfig,
    num_kv_heads: int,
    method: str = "mean",
    activations: torch.Tensor | None = None,
) -> AttentionWeights:
    """One layer's weights with ``num_kv_heads`` KV heads: copied (same count), expanded exactly (more heads, any
    method), or reduced by ``METHODS[method]`` (fewer). See ``Method`` for the arguments."""
    check_kv_heads(cfg, num_kv_heads, method)
    if num_kv_heads == cfg.num_kv_heads:
        return replace(w)
    if num_kv_heads > cfg.num_kv_heads:
        return expand(w, cfg, num_kv_heads)
    out = METHODS[method](w, cfg, num_kv_heads, activations)
    _check_result(out, w, cfg, num_kv_heads, method)
    return out
