"""The native kernels' Python surface: one typed wrapper per op, its fake kernel beside it.

``torch.ops.gqa.*`` is called here and nowhere else in the library. The ops exist once ``gqa.kernels.load()`` has
loaded the library (callers ask ``kernels.available()`` / ``kernels.vectorized()`` first); the fakes — the output
shapes that ``torch.compile`` and meta tensors need, the kernels being opaque to the compiler — are registered then
(``register_fakes``). ``simd_width`` has no tensor arguments: its one kernel serves every backend, nothing to fake.

Shapes follow the C++ sources (``csrc/*.cpp``), which check them: ``B`` rows, ``E`` hidden size, ``H_q``/``H_kv``
heads, ``D``/``D_v`` head sizes, ``C`` cache slots, ``V`` vocabulary. float32 or bfloat16 activations throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = [
    "DecodeWeights",
    "RowCache",
    "decode_attend",
    "decode_attention",
    "decode_layer",
    "decode_model",
    "decode_paged",
    "dequantize_rows",
    "lane_rows",
    "linear_rows",
    "linear_rows_n",
    "paged_attention",
    "qlinear_rows_n",
    "quantize_kv",
    "reduce_seconds",
    "register_fakes",
    "rms_norm",
    "silu_mul",
    "simd_width",
]

Tensor = torch.Tensor
OptionalTensors = Sequence[Tensor | None]


class RowCache(Protocol):
    """A layer's dense KV cache as the decode ops read it (``gqa.cache.kv.StaticKVCache`` is one): ``key``, ``value``
    ``(B, H_kv, C, D | D_v)``, ``start (B,)`` int64, each row's first visible slot (left padding), and ``cursor``, an
    int64 scalar tensor: the slot the next token goes to."""

    key: Tensor
    value: Tensor
    start: Tensor
    cursor: Tensor


@dataclass(frozen=True)
class DecodeWeights:
    """Everything the one-call decode step (``decode_model``, ``decode_paged``) reads besides the activations and
    the caches, built once per model (``decoding.native_step.decode_weights``). Per layer, in layer order: two norms,
    seven matrices ``q, k, v, o, gate, up, down`` (float ``(M, K)`` with format ``-1``, or block-quantized rows with
    their format's code) and three q/k/v biases (or ``None``). The options of families beyond Llama's layer, per
    layer: ``qk_norms`` (Qwen3's q and k norms ``(D,)``, two per layer, eps ``qk_eps``; ``None``: none),
    ``windows`` (keys a token sees to its left, ``-1``: all; empty: no windows) and ``rotates`` (``0`` for a layer
    without RoPE, ``1`` the call's cos/sin, ``2`` its ``local_rope`` tables; empty: all ``1``). Gemma's layer:
    ``post_norms`` (after attention, after the MLP: two per layer; ``norms2`` is then the norm before the MLP),
    ``offset_norms`` (every norm scales by ``1 + w``), ``gelu`` (a GELU-tanh gate), ``softcaps`` (per layer, ``0``:
    none)."""

    norms1: list[Tensor]  # [(E,)] per layer
    norms2: list[Tensor]
    eps: float
    weights: list[Tensor]  # 7 per layer
    formats: list[int]  # 7 per layer
    qkv_biases: list[Tensor | None]  # 3 per layer
    scale: float  # the attention's score scale, 1 / sqrt(D)
    final_norm: Tensor  # (E,)
    final_eps: float
    head: Tensor  # lm_head: (V, E) float, or blocks
    head_format: int
    qk_norms: list[Tensor] | None = None  # [(D,)] q_norm, k_norm per layer
    qk_eps: float = 1e-6
    windows: list[int] = field(default_factory=list)
    rotates: list[int] = field(default_factory=list)
    post_norms: list[Tensor] | None = None  # [(E,)] post-attention, post-MLP norm per layer (Gemma)
    offset_norms: bool = False
    gelu: bool = False
    softcaps: list[float] = field(default_factory=list)

    def options(self, local_rope: tuple[Tensor, Tensor] | None) -> tuple:
        """The per-layer options as the ops take them, after ``greedy`` (and ``logit_rows``), with the local RoPE
        tables ``(cos, sin)`` of this call where a layer rotates with them."""
        cos_local, sin_local = local_rope if local_rope is not None else (None, None)
        return (self.qk_norms, self.qk_eps, self.windows, self.rotates, self.post_norms, self.offset_norms, self.gelu,
                self.softcaps, cos_local, sin_local)  # fmt: skip


def reduce_seconds() -> float:
    """Seconds this process's ``decode_paged`` calls with a ``reduce_group`` have spent in their all-reduces."""
    return float(torch.ops.gqa.reduce_seconds())


def simd_width() -> int:
    """Float32 lanes the library was built to vectorize with: 16 (AVX-512), 8 (AVX2 + FMA), 1 (none)."""
    return int(torch.ops.gqa.simd_width())


def lane_rows() -> int:
    """The fewest input rows ``qlinear_rows_n`` puts in SIMD lanes (AVX-512 VNNI builds), where many rows run 2-4x
    faster than as GEMVs and than ``F.linear`` on the dequantized weight; 0: none built."""
    return int(torch.ops.gqa.lane_rows())


def linear_rows(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x (N, K) @ weight (M, K)^T + bias (M,)`` -> ``(N, M)`` for a few rows (decode): each weight row streamed
    once."""
    return torch.ops.gqa.linear_rows(x, weight, bias)


def linear_rows_n(x: Tensor, weights: Sequence[Tensor], biases: OptionalTensors) -> list[Tensor]:
    """``linear_rows`` of one input ``x (N, K)`` against several matrices (q/k/v, gate/up) in one parallel region."""
    return torch.ops.gqa.linear_rows_n(x, list(weights), list(biases))


def qlinear_rows_n(
    x: Tensor, blocks: Sequence[Tensor], formats: Sequence[int], biases: OptionalTensors
) -> list[Tensor]:
    """``x (N, K) @ dequant(W_i)^T + b_i`` -> ``[(N, M_i)]`` for block-quantized ``W_i`` (rows of blocks), with int8
    activations as llama.cpp computes it."""
    return torch.ops.gqa.qlinear_rows_n(x, list(blocks), list(formats), list(biases))


def dequantize_rows(blocks: Tensor, format: int, K: int, dtype: torch.dtype) -> Tensor:
    """Rows of blocks ``(M, K / 32 * block_bytes)`` -> ``(M, K)`` of ``dtype``, exactly ``d * q (+ m)``."""
    return torch.ops.gqa.dequantize_rows(blocks, format, K, dtype)


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    query_len: int,
    causal: bool,
    softcap: float = 0.0,
    sinks: Tensor | None = None,
    k_format: int = -1,
    v_format: int = -1,
) -> Tensor:
    """Grouped attention: ``q (B, H_kv, G * L, D)`` against ``k (B, H_kv, S, D)``, ``v (B, H_kv, S, D_v)`` (strided
    views allowed), ``mask (B, H_kv, G, L, S)`` bool or float (any strides) -> ``(B, H_kv, G * L, D_v)``. ``softcap``
    > 0 soft-caps the scaled scores before the mask; ``sinks`` (float32 ``(H_kv * G,)``, one per query head) join
    every row's softmax denominator. ``k_format`` / ``v_format`` >= 0: that one is a quantized cache's uint8 rows of
    blocks ``(B, H_kv, S, row_bytes)`` (``KVDtype.code``), read where it lies; quantized keys are stored rotated
    (``cache.quantize.rotate``) and the kernel rotates ``q`` to match."""
    return torch.ops.gqa.decode_attention(q, k, v, mask, scale, query_len, causal, softcap, sinks, k_format, v_format)


def quantize_kv(x: Tensor, format: int, rotate: bool = False) -> Tensor:
    """``x (..., D)`` float32 / bfloat16 / float16 -> the uint8 blocks ``(..., D / 32 * block_bytes)`` a quantized
    cache stores (``format`` 0: q8_0, 1: q4_0), llama.cpp's reference rounding, row by row; ``rotate``: each row
    Walsh-Hadamard rotated first (``cache.quantize.rotate``: how keys are stored)."""
    return torch.ops.gqa.quantize_kv(x, format, rotate)


def paged_attention(
    q: Tensor, key_pool: Tensor, value_pool: Tensor, block_table: Tensor, lengths: Tensor, scale: float
) -> Tensor:
    """One query per row ``q (B, H_q, D)`` over its first ``lengths[b]`` slots of the blocks ``block_table (B, M)``
    lists in pools ``(blocks, H_kv, block_size, D | D_v)`` -> ``(B, H_q, D_v)``."""
    return torch.ops.gqa.paged_attention(q, key_pool, value_pool, block_table, lengths, scale)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's RMSNorm of ``x (N, E)`` with ``weight (E,)``, rounding where it rounds."""
    return torch.ops.gqa.rms_norm(x, weight, eps)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's ``T(silu(gate)) * up`` elementwise; an element's value does not depend on the tensor around it."""
    return torch.ops.gqa.silu_mul(gate, up)


def decode_attend(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, cache: RowCache, scale: float) -> Tensor:
    """One decoded token's attention: RoPE on ``q (B, H_q * D)`` and ``k (B, H_kv * D)``, k and ``v (B, H_kv *
    D_v)`` written at slot ``cache.cursor`` of ``cache``, each row attending to its slots ``[start[b], cursor]``;
    ``cursor += 1``. -> ``(B, H_q * D_v)``."""
    return torch.ops.gqa.decode_attend(q, k, v, cos, sin, cache.key, cache.value, cache.start, cache.cursor, scale)


def decode_layer(
    x: Tensor,
    norm1: Tensor,
    norm2: Tensor,
    eps: float,
    weights: Sequence[Tensor],
    formats: Sequence[int],
    qkv_biases: OptionalTensors,
    cos: Tensor,
    sin: Tensor,
    cache: RowCache,
    scale: float,
) -> Tensor:
    """A whole Llama/Qwen2 decoder layer for one new token per row ``x (B, E)`` -> ``(B, E)``: the 7 ``weights`` of
    ``DecodeWeights``' per-layer order, the cache as in ``decode_attend``."""
    return torch.ops.gqa.decode_layer(x, norm1, norm2, eps, list(weights), list(formats), list(qkv_biases), cos, sin,
                                      cache.key, cache.value, cache.start, cache.cursor, scale)  # fmt: skip


def decode_model(
    x: Tensor,
    w: DecodeWeights,
    cos: Tensor,
    sin: Tensor,
    caches: Sequence[RowCache],
    greedy: Tensor | None = None,
    local_rope: tuple[Tensor, Tensor] | None = None,
    kv_formats: Sequence[int] = (),
    reduce_group: str | None = None,
) -> Tensor:
    """The whole decode step in one call: ``x (B, E)`` (the new tokens' embeddings) through every layer, the final
    norm and lm_head -> logits ``(B, V)``, a cache per layer as in ``decode_attend``; ``greedy (B,)`` int64, when
    given, gets each row's argmax; ``local_rope``: ``(cos, sin)`` like ``cos``, ``sin`` for the layers whose
    ``w.rotates`` is 2; ``kv_formats``: ``(K's, V's)`` block format codes of quantized caches (uint8 rows of blocks),
    ``()`` for float ones; ``reduce_group``: a tensor-parallel rank's step, as in ``decode_paged``."""
    return torch.ops.gqa.decode_model(
        x, w.norms1, w.norms2, w.eps, w.weights, w.formats, w.qkv_biases, cos, sin, [c.key for c in caches],
        [c.value for c in caches], [c.start for c in caches], [c.cursor for c in caches], w.scale, w.final_norm,
        w.final_eps, w.head, w.head_format, greedy, *w.options(local_rope), list(kv_formats), reduce_group,
    )  # fmt: skip


def decode_paged(
    x: Tensor,
    w: DecodeWeights,
    cos: Tensor,
    sin: Tensor,
    key_pools: Sequence[Tensor],
    value_pools: Sequence[Tensor],
    block_table: Tensor,
    positions: Tensor,
    greedy: Tensor | None = None,
    logit_rows: Tensor | None = None,
    local_rope: tuple[Tensor, Tensor] | None = None,
    kv_formats: Sequence[int] = (),
    reduce_group: str | None = None,
) -> Tensor:
    """``decode_model`` over paged caches: per layer pools ``(blocks, H_kv, block_size, D | D_v)``, ``block_table
    (B, M)`` shared by the layers, ``positions (B,)``: row b's new K/V go to its slot ``positions[b]`` and it attends
    to slots ``[0, positions[b]]`` (rows of one sequence at consecutive positions see each other: a prompt chunk).
    ``logit_rows (N,)``: only those rows get logits -> ``(N, V)`` (else ``(B, V)``); ``kv_formats`` as in
    ``decode_model``. ``reduce_group``: a tensor-parallel rank's step — the name of the torch.distributed group
    (``ProcessGroup.group_name``) whose all-reduce sums each layer's ``o_proj`` and ``down_proj`` partial products
    inside the call; ``w`` then holds the rank's shards (its ``lm_head`` rows: the logits are its slice)."""
    return torch.ops.gqa.decode_paged(
        x, w.norms1, w.norms2, w.eps, w.weights, w.formats, w.qkv_biases, cos, sin, list(key_pools),
        list(value_pools), block_table, positions, w.scale, w.final_norm, w.final_eps, w.head, w.head_format, greedy,
        logit_rows, *w.options(local_rope), list(kv_formats), reduce_group,
    )  # fmt: skip


# -- fake kernels: the output shapes, for torch.compile and meta tensors ---------------------------------------------


def register_fakes() -> None:
    """Register every op's fake kernel (``gqa.kernels`` does this once the library is loaded)."""
    register = torch.library.register_fake

    @register("gqa::linear_rows")
    def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @register("gqa::linear_rows_n")
    def _(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> list[Tensor]:
        return [x.new_empty(x.shape[0], w.shape[0]) for w in weights]

    @register("gqa::qlinear_rows_n")
    def _(x: Tensor, blocks: list[Tensor], formats: list[int], biases: list[Tensor | None]) -> list[Tensor]:
        return [x.new_empty(x.shape[0], b.shape[0]) for b in blocks]

    @register("gqa::dequantize_rows")
    def _(blocks: Tensor, format: int, K: int, dtype: torch.dtype) -> Tensor:
        return blocks.new_empty(blocks.shape[0], K, dtype=dtype)

    @register("gqa::decode_attention")
    def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, query_len: int, causal: bool,
          softcap: float = 0.0, sinks: Tensor | None = None, k_format: int = -1,
          v_format: int = -1) -> Tensor:  # fmt: skip
        dv = v.shape[3] if v_format < 0 else v.shape[3] // (34 if v_format == 0 else 18) * 32
        return q.new_empty(q.shape[0], q.shape[1], q.shape[2], dv)

    @register("gqa::quantize_kv")
    def _(x: Tensor, format: int, rotate: bool = False) -> Tensor:
        return x.new_empty(*x.shape[:-1], x.shape[-1] // 32 * (34 if format == 0 else 18), dtype=torch.uint8)

    @register("gqa::paged_attention")
    def _(q: Tensor, key_pool: Tensor, value_pool: Tensor, block_table: Tensor, lengths: Tensor, scale: float):
        return q.new_empty(q.shape[0], q.shape[1], value_pool.shape[3])

    @register("gqa::rms_norm")
    def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return torch.empty_like(x)

    @register("gqa::silu_mul")
    def _(gate: Tensor, up: Tensor) -> Tensor:
        return torch.empty_like(gate)

    @register("gqa::decode_attend")
    def _(q, k, v, cos, sin, key_cache, value_cache, start, cursor, scale) -> Tensor:
        heads = q.shape[1] // key_cache.shape[3]  # H_q
        return q.new_empty(q.shape[0], heads * value_cache.shape[3])

    @register("gqa::decode_layer")
    def _(x, norm1, norm2, eps, weights, formats, qkv_biases, cos, sin, key_cache, value_cache, start, cursor, scale):
        return torch.empty_like(x)

    @register("gqa::decode_model")
    def _(x, norms1, norms2, eps, weights, formats, qkv_biases, cos, sin, key_caches, value_caches, starts, cursors,
          scale, final_norm, final_eps, head, head_format, greedy=None, qk_norms=None, qk_eps=1e-6, windows=(),
          rotates=(), post_norms=None, offset_norms=False, gelu=False, softcaps=(), cos_local=None,
          sin_local=None, kv_formats=(), reduce_group=None) -> Tensor:  # fmt: skip
        return x.new_empty(x.shape[0], head.shape[0])

    @register("gqa::decode_paged")
    def _(x, norms1, norms2, eps, weights, formats, qkv_biases, cos, sin, key_pools, value_pools, block_table,
          positions, scale, final_norm, final_eps, head, head_format, greedy=None, logit_rows=None, qk_norms=None,
          qk_eps=1e-6, windows=(), rotates=(), post_norms=None, offset_norms=False, gelu=False, softcaps=(),
          cos_local=None, sin_local=None, kv_formats=(), reduce_group=None):  # fmt: skip
        rows = x.shape[0] if logit_rows is None else logit_rows.shape[0]
        return x.new_empty(rows, head.shape[0])
