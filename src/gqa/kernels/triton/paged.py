"""``paged_attention``: grouped attention of one token per row over a paged KV pool, as a Triton kernel (the GPU
serving engine's attention, ``gqa.serve.triton_runner``).

Each row is one token with its own block table and length: a decoding sequence's next token, or one token of a
prompt chunk (which sees the chunk's earlier tokens: their K/V are written to the pool before the call). The ``G``
query heads that share a KV head read each K/V tile once, gathered through the table (``paged_kernels``); each row's
keys are split at fixed multiples of ``CHUNK`` and the splits merged by log-sum-exp, so a row's result does not depend
on the other rows of the batch. The pools hold the query's dtype, or a quantized cache's uint8 rows of llama.cpp
``q8_0`` / ``q4_0`` blocks (``k_format`` / ``v_format``, ``kv_formats``), read where they lie. CUDA, or CPU tensors
under ``TRITON_INTERPRET=1`` (tests). Inference only.
"""

from __future__ import annotations

import torch

from ...attention.checks import check_softcap, shape_str
from ...cache.quantize import rotate
from .kv_formats import FLOAT, block_kind, format_refusal, values_per_row
from .split_kv import (
    DTYPES,
    MAX_HEAD_DIM,
    _precision,
    interpreted,
    softcap_arg,
    triton_available,
    triton_next_pow2,
)

CHUNK = 512  # keys per split: fixed, so that a row's splits do not depend on the batch
BLOCK_N = 32  # keys per tile (each gathered through the table)


def _check(query, key_pool, value_pool, tables, lengths, max_length, k_kind, v_kind) -> str | None:
    if not triton_available():
        return "triton is not installed (pip install triton)"
    for name, t in (("query", query), ("key_pool", key_pool), ("value_pool", value_pool), ("tables", tables),
                    ("lengths", lengths)):  # fmt: skip
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a tensor, got {type(t).__name__}"
        if t.device != query.device:
            return f"{name} is on {t.device}, query on {query.device}"
    if query.device.type != "cuda" and not (query.device.type == "cpu" and interpreted()):
        return f"device {query.device.type} (CUDA, or CPU under TRITON_INTERPRET=1)"
    floats = [pool.dtype for pool, kind in ((key_pool, k_kind), (value_pool, v_kind)) if kind is None]
    if query.dtype not in DTYPES or any(dtype != query.dtype for dtype in floats):
        return f"dtypes query {query.dtype}, pools {key_pool.dtype}/{value_pool.dtype} (one of float32/16, bfloat16)"
    if query.dim() != 3 or key_pool.dim() != 4 or value_pool.dim() != 4:
        return (f"shapes query {shape_str(query)} (N, H_q, D), pools {shape_str(key_pool)}, {shape_str(value_pool)} "
                "(num_blocks, H_kv, block_size, D)")  # fmt: skip
    reason = format_refusal("key_pool", key_pool, k_kind) or format_refusal("value_pool", value_pool, v_kind)
    if reason is not None:
        return reason
    N, H_q, D = query.shape
    _, H_kv, block_size, _ = key_pool.shape
    if values_per_row(key_pool, k_kind) != D or value_pool.shape[:3] != key_pool.shape[:3] or H_q % H_kv:
        return f"query {shape_str(query)} does not match pools {shape_str(key_pool)}, {shape_str(value_pool)}"
    if max(D, values_per_row(value_pool, v_kind)) > MAX_HEAD_DIM:
        return f"head dim over {MAX_HEAD_DIM}"
    if any(t.stride(-1) != 1 for t in (query, key_pool, value_pool)):
        return "query and the pools need a contiguous last dim"
    if tables.dtype not in (torch.int32, torch.int64) or tables.dim() != 2 or tables.shape[0] != N:
        return f"tables must be int32/int64 (N={N}, max_blocks), got {tables.dtype} {shape_str(tables)}"
    if lengths.dtype not in (torch.int32, torch.int64) or lengths.shape != (N,):
        return f"lengths must be int32/int64 (N={N},), got {lengths.dtype} {shape_str(lengths)}"
    if tables.stride(1) != 1 or lengths.stride(0) != 1:
        return "tables need a contiguous last dim and lengths a contiguous one (rows may be strided)"
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        return f"max_length must be a positive int, got {max_length!r}"
    if max_length > tables.shape[1] * block_size:
        return f"max_length {max_length} exceeds the tables' {tables.shape[1]} blocks of {block_size}"
    return None


def paged_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    *,
    max_length: int,
    max_context: int | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_format: int = FLOAT,
    v_format: int = FLOAT,
) -> torch.Tensor:
    """Row ``n`` attends to positions ``[0, lengths[n])`` of its sequence, position ``j`` held in block
    ``tables[n, j // block_size]`` at slot ``j % block_size``.

    Parameters
    ----------
    query : ``(N, H_q, D)``, one token per row.
    key_pool, value_pool : ``(num_blocks, H_kv, block_size, D | D_v)`` in the query's dtype, or as ``k_format`` /
        ``v_format`` say uint8 ``(num_blocks, H_kv, block_size, D / 32 * block_bytes)`` rows of blocks.
    tables : ``(N, max_blocks)`` int32/int64 block ids (entries past a row's length are not read).
    lengths : ``(N,)`` int32/int64, each >= 1 and ``<= max_length``.
    max_length : the largest of ``lengths`` (given, so that sizing the launch reads nothing back from the GPU).
    max_context : the longest length any call will see (the model's context): fixes the merge's width, so that a row
        is merged the same way whatever the batch; default ``max_length``.
    scale : multiplies the scores; default ``D ** -0.5``.
    window : keys before the row's own that it sees (a sliding window's left side: positions
        ``lengths[n] - 1 - window`` on); the keys before them are not read.
    softcap : ``softcap * tanh(scores / softcap)`` on the scaled scores.
    sinks : ``(H_q,)`` logits, each a key of value zero in its head's softmax.
    k_format, v_format : what the pools store (``KVDtype.code``): -1 float rows, 0 llama.cpp ``q8_0`` blocks (a
        2-byte fp16 scale ``d``, 32 int8 ``q``: ``x = d * q``), 1 ``q4_0`` blocks (``d``, then value ``j`` in the low
        nibble of byte ``j``, ``16 + j`` in its high nibble: ``x = d * (q - 8)``); dequantized a tile at a time in
        registers, never copied.

    Returns
    -------
    ``(N, H_q, D_v)`` in the query's dtype.
    """
    k_kind, v_kind = block_kind("k_format", k_format), block_kind("v_format", v_format)
    reason = _check(query, key_pool, value_pool, tables, lengths, max_length, k_kind, v_kind)
    reason = reason or _check_options(query, window, sinks)
    if reason is not None:
        raise ValueError(f"paged_attention cannot run this call: {reason}")
    softcap = check_softcap(softcap)
    from . import paged_kernels
    from .split_kv_kernels import merge_splits

    N, H_q, D = query.shape
    _, H_kv, block_size, _ = key_pool.shape
    DV = values_per_row(value_pool, v_kind)
    if k_format != FLOAT:  # quantized keys are stored rotated: the queries are rotated to match
        query = rotate(query).to(query.dtype)
    G = H_q // H_kv
    splits = -(-max_length // CHUNK)
    widest = -(-max(max_context or max_length, max_length) // CHUNK)
    if window is not None:  # the chunks a window of window + 1 keys can touch, wherever it starts
        reach = -(-(window + 1) // CHUNK) + 1
        splits, widest = min(splits, reach), min(widest, reach)
    sink_logits = None if sinks is None else sinks.detach().to(torch.float32).contiguous()
    block_g, block_d, block_dv = (max(16, triton_next_pow2(n)) for n in (G, D, DV))
    part_out = torch.empty(N * H_kv, splits, G, DV, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(N * H_kv, splits, G, dtype=torch.float32, device=query.device)
    out = torch.empty(N, H_q, DV, dtype=query.dtype, device=query.device)
    if N == 0:
        return out
    paged_kernels.paged_attend[(N * H_kv, splits)](
        query, key_pool, value_pool, tables, lengths, part_out, part_lse,
        float(D**-0.5 if scale is None else scale), G, D, DV, block_size, H_kv, splits, window or 0,
        softcap_arg(softcap),
        query.stride(0), query.stride(1),
        key_pool.stride(0), key_pool.stride(1), key_pool.stride(2),
        value_pool.stride(0), value_pool.stride(1), value_pool.stride(2),
        tables.stride(0),
        CHUNK=CHUNK, HAS_LEFT=window is not None, HAS_SOFTCAP=softcap is not None, K_FORMAT=k_format,
        V_FORMAT=v_format, PRECISION=_precision(query),
        BLOCK_G=block_g, BLOCK_N=BLOCK_N, BLOCK_D=block_d,
        BLOCK_DV=block_dv, num_warps=4, num_stages=2,
    )  # fmt: skip
    o = out.view(N, H_kv, G, 1, DV)
    merge_splits[(N * H_kv, G)](
        part_out, part_lse, part_lse if sink_logits is None else sink_logits, o, 1, DV, G, H_kv, splits, G,
        o.stride(0), o.stride(1), o.stride(2), 0, HAS_SINKS=sink_logits is not None,
        BLOCK_S=triton_next_pow2(widest), BLOCK_DV=block_dv, num_warps=4,
    )  # fmt: skip
    return out


def _check_options(query: torch.Tensor, window: object, sinks: object) -> str | None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        return f"window must be an int >= 0 (keys before the row's own) or None, got {window!r}"
    if sinks is not None:
        H_q = query.shape[1] if query.dim() == 3 else None
        if not isinstance(sinks, torch.Tensor):
            return f"sinks must be a tensor of shape (H_q,) = ({H_q},), got {type(sinks).__name__}"
        if not sinks.is_floating_point() or sinks.shape != (H_q,):
            got = f"{sinks.dtype} {shape_str(sinks)}"
            return f"sinks must be a floating-point tensor of shape (H_q,) = ({H_q},), got {got}"
        if sinks.device != query.device:
            return f"sinks is on {sinks.device}, query on {query.device}"
    return None
