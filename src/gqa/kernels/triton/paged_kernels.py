"""The Triton kernel of paged grouped decode (``gqa.kernels.triton.paged`` launches it; import needs triton).

One program per (row ``n``, KV head ``h``, split of ``CHUNK`` keys). A row is one token: the serving engine's batch
mixes decode rows and prompt-chunk rows, each with its own block table and length (its position + 1). The ``G``
query heads of KV head ``h`` are one tile of ``BLOCK_G >= 16`` rows, so each K/V tile is read once per group; the
keys of a tile are gathered through the block table, one page lookup per key, so any block size works. Splits
start at fixed multiples of ``CHUNK`` whatever else is in the batch, so a row's result depends on that row alone;
with a left window the first split is the chunk holding the window's first key, and no key before it is read.
Soft-capping bends the scaled scores; sinks join in the merge. The pools hold float rows in the query's dtype or, as
``K_FORMAT`` / ``V_FORMAT`` say (-1 float, 0 ``q8_0``, 1 ``q4_0``), uint8 rows of llama.cpp's 32-value blocks with an
fp16 scale, dequantized a tile at a time in registers (``kv_blocks.load_rows``; the strides are then in bytes).
The running softmax and the partial outputs' merge are ``split_kv_kernels``' (``online_softmax_step``, ``finish``,
``merge_splits``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kv_blocks import load_rows
from .split_kv_kernels import finish, online_softmax_step, soft_cap


@triton.jit
def paged_attend(
    Q, K, V, Tables, Lengths, PartOut, PartLse,  # pointers
    scale, G, D, DV, block_size, H_KV, splits,  # sizes
    win_left, softcap,  # the window's left side (keys before the row's own); the soft-cap
    sq_n, sq_h,  # q (N, H_q, D), last dim contiguous; head h*G + g
    sk_b, sk_h, sk_s,  # key pool (num_blocks, H_kv, block_size, D | row bytes), last dim contiguous
    sv_b, sv_h, sv_s,  # value pool (num_blocks, H_kv, block_size, DV | row bytes)
    st_n,  # tables (N, max_blocks) int32
    CHUNK: tl.constexpr,  # keys per split (a multiple of BLOCK_N)
    HAS_LEFT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    K_FORMAT: tl.constexpr,  # -1: float rows; 0 / 1: uint8 rows of q8_0 / q4_0 blocks (kv_blocks)
    V_FORMAT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    nh = tl.program_id(0)
    split = tl.program_id(1)
    n = nh // H_KV
    h = nh % H_KV
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ptr = Q + n.to(tl.int64) * sq_n + (h * G + g[:, None]) * sq_h + d[None, :]
    q = tl.load(q_ptr, mask=g_ok[:, None] & (d[None, :] < D), other=0.0)  # (BLOCK_G, BLOCK_D)

    length = tl.load(Lengths + n).to(tl.int32)
    k_lo = split * CHUNK
    if HAS_LEFT:
        w_first = tl.maximum(length - 1 - win_left, 0)  # the window's first key
        k_lo = (w_first // CHUNK + split) * CHUNK
    k_hi = tl.minimum(k_lo + CHUNK, length)
    if HAS_LEFT:
        k_lo = tl.maximum(k_lo, w_first)
    table = Tables + n.to(tl.int64) * st_n
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for first in range(k_lo, k_hi, BLOCK_N):
        j = first + tl.arange(0, BLOCK_N)  # positions in the row's sequence
        j_ok = j < k_hi
        page = tl.load(table + j // block_size, mask=j_ok, other=0).to(tl.int64)
        slot = j % block_size
        k_rows = K + page[:, None] * sk_b + h * sk_h + slot[:, None] * sk_s
        k = load_rows(k_rows, j_ok, d, D, K_FORMAT).to(q.dtype)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_G, BLOCK_N) float32
        if HAS_SOFTCAP:
            s = soft_cap(s, softcap)
        s = tl.where(g_ok[:, None] & j_ok[None, :], s, float("-inf"))
        v_rows = V + page[:, None] * sv_b + h * sv_h + slot[:, None] * sv_s
        v = load_rows(v_rows, j_ok, dv, DV, V_FORMAT).to(q.dtype)  # (BLOCK_N, BLOCK_DV)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PRECISION)

    out, lse = finish(m_i, l_i, acc)
    part = (nh.to(tl.int64) * splits + split) * G + g  # (BLOCK_G,) the partials' rows, merge_splits' layout
    tl.store(PartOut + part[:, None] * DV + dv[None, :], out, mask=g_ok[:, None] & (dv[None, :] < DV))
    tl.store(PartLse + part, lse, mask=g_ok)
