"""The Triton kernels of the split-KV grouped decode (``gqa.kernels.triton.split_kv`` launches them; import needs
triton).

Pass 1, ``split_kv_attend``: one program per (batch row ``n``, KV head ``h``, KV split, block of query rows). The
``G * L`` query rows of a KV head (the whole group and every new token) are one tile of ``BLOCK_M >= 16`` rows, so
each K/V tile is read from memory once for the whole group and multiplied on the tensor cores. The program walks its
split of the keys, ``BLOCK_N`` at a time, with an online softmax in float32, and writes its normalised partial output
and log-sum-exp (or, with a single split, the output itself). Pass 2, ``merge_splits``: per query row, the splits'
outputs weighted by ``exp(lse_s - max lse)``.

Visibility of key ``j`` to query row ``(g, l)`` of batch row ``n``: ``start[n] <= j < end[n]`` (the whole ``[0, S)``
without them), ``j <= end[n] - L + l`` when causal (bottom-right), a sliding window
``end[n] - L + l - left <= j <= end[n] - L + l + right``, and the mask: bool (nonzero = attend) or additive. With a
left window the splits tile the window, from its first key (``end[n] - L - left``) on: keys before it are not read.
Soft-capping bends the scaled scores (``softcap * tanh(s / softcap)``) before the mask; a sink (a logit per query
head) joins each row's softmax as a key whose value is zero — in the merge, or at the end of the one split.
A row that sees no key gets zeros, as the other backends give. NaN in q/K/V propagates to the output.

K and V are float rows in the query's dtype or, as ``K_FORMAT`` / ``V_FORMAT`` say (``kv_formats``: -1 float, 0
``q8_0``, 1 ``q4_0``), uint8 rows of 32-value blocks with an fp16 scale, each tile dequantized in registers
(``kv_blocks.load_rows``) into the query's dtype before its dot; the strides are then in bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kv_blocks import load_rows


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One tile of keys into a running softmax: scores ``s (M, N)`` float32 (-inf where not seen), values
    ``v (N, DV)``, the running max ``m_i (M,)``, sum ``l_i (M,)`` and output ``acc (M, DV)`` -> their new values."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet: exp(-inf) = 0 below
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])  # (M, N)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def finish(m_i, l_i, acc):
    """The normalised output ``(M, DV)`` (zeros for a row that saw no key) and its log-sum-exp ``(M,)`` (-inf there)."""
    out = tl.where(l_i[:, None] == 0.0, 0.0, acc / l_i[:, None])
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_i))
    return out, lse


@triton.jit
def soft_cap(s, softcap):
    """``softcap * tanh(s / softcap)`` in float32 to its rounding for every cap, as the native kernel computes it
    (``gqa/kernels/csrc/attention.h``): with ``x = s / softcap``, near zero (``|x| < 0.625``) ``s + s * z * P(z)``,
    ``z = x^2`` (a large cap keeps ``s``'s digits, which ``(1 - e) / (1 + e)`` loses to cancellation there), beyond it
    ``tanh(|x|) = (1 - e) / (1 + e)``, ``e = exp(-2|x|)`` (no overflow for large scores). A cap of inf (beyond float32)
    leaves the scores as they are."""
    x = s / softcap
    z = x * x
    p = ((((-5.70657523e-3 * z + 2.06404906e-2) * z - 5.37401401e-2) * z + 1.33314475e-1) * z) - 3.33332807e-1
    near_zero = s + s * (z * p)
    e = tl.exp(-2.0 * tl.abs(x))
    t = softcap * ((1.0 - e) / (1.0 + e))
    return tl.where(tl.abs(x) < 0.625, near_zero, tl.where(x < 0, -t, t))


@triton.jit
def add_sink(sink, m_i, l_i, acc):
    """A key of logit ``sink (M,)`` and value zero into a running softmax (``online_softmax_step``'s state)."""
    m_new = tl.maximum(m_i, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    return m_new, l_i * alpha + tl.exp(sink - m_safe), acc * alpha[:, None]


@triton.jit
def split_kv_attend(
    Q, K, V, Mask, Start, End, Sinks, Out, PartOut, PartLse,  # pointers
    scale, S, L, D, DV, rows, chunk, H_KV, splits,  # sizes
    G, win_left, win_right, softcap,  # query heads per KV head; the window's sides; the soft-cap
    sq_n, sq_h, sq_g, sq_l,  # q (N, H_kv, G, L, D), last dim contiguous
    sk_n, sk_h, sk_s,  # k (N, H_kv, S, D | row bytes), last dim contiguous
    sv_n, sv_h, sv_s,  # v (N, H_kv, S, DV | row bytes), last dim contiguous
    sm_n, sm_h, sm_g, sm_l, sm_s,  # mask (N, H_kv, G, L, S), any strides (0 where broadcast)
    so_n, so_h, so_g, so_l,  # out (N, H_kv, G, L, DV), last dim contiguous
    MASK_KIND: tl.constexpr,  # 0: none, 1: bool (as uint8), 2: additive
    IS_CAUSAL: tl.constexpr,
    HAS_START: tl.constexpr,
    HAS_END: tl.constexpr,
    HAS_LEFT: tl.constexpr,  # a left window: the splits start at the window's first key
    HAS_RIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the output, not partials
    K_FORMAT: tl.constexpr,  # -1: float rows; 0 / 1: uint8 rows of q8_0 / q4_0 blocks (kv_blocks)
    V_FORMAT: tl.constexpr,
    PRECISION: tl.constexpr,  # of the dots for float32 inputs: "tf32x3" (GPU: float32 accuracy on tensor cores), "ieee"
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    nh = tl.program_id(0)
    split = tl.program_id(1)
    n = nh // H_KV
    h = nh % H_KV
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows r = g * L + l
    r_ok = r < rows
    g = r // L
    lq = r % L  # token of the row
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)

    q_ptr = Q + n.to(tl.int64) * sq_n + h * sq_h + g[:, None] * sq_g + lq[:, None] * sq_l + d[None, :]
    q = tl.load(q_ptr, mask=r_ok[:, None] & (d[None, :] < D), other=0.0)  # (BLOCK_M, BLOCK_D)

    lo = 0
    hi = S
    if HAS_START:
        lo = tl.load(Start + n).to(tl.int32)
    if HAS_END:
        hi = tl.minimum(tl.load(End + n).to(tl.int32), S)
    base = 0
    if HAS_LEFT:
        base = tl.maximum(hi - L - win_left, 0)  # the first key any row's window reaches
    k_lo = tl.maximum(base + split * chunk, lo)
    k_hi = tl.minimum(base + split * chunk + chunk, hi)
    last_seen = hi - L + lq  # causal: row l sees keys j <= last_seen; its window is around it

    k_base = K + n.to(tl.int64) * sk_n + h * sk_h
    v_base = V + n.to(tl.int64) * sv_n + h * sv_h
    m_base = Mask + n.to(tl.int64) * sm_n + h * sm_h + g[:, None] * sm_g + lq[:, None] * sm_l

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for first in range(k_lo, k_hi, BLOCK_N):
        j = first + tl.arange(0, BLOCK_N)  # key slots
        j_ok = j < k_hi
        k = load_rows(k_base + j[:, None] * sk_s, j_ok, d, D, K_FORMAT).to(q.dtype)  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (BLOCK_M, BLOCK_N) float32
        if HAS_SOFTCAP:
            s = soft_cap(s, softcap)
        seen = r_ok[:, None] & j_ok[None, :]
        if IS_CAUSAL:
            seen = seen & (j[None, :] <= last_seen[:, None])
        if HAS_LEFT:
            seen = seen & (j[None, :] >= last_seen[:, None] - win_left)
        if HAS_RIGHT:
            seen = seen & (j[None, :] <= last_seen[:, None] + win_right)
        if MASK_KIND == 1:
            allowed = tl.load(m_base + j[None, :] * sm_s, mask=seen, other=0)
            seen = seen & (allowed != 0)
        if MASK_KIND == 2:
            s = s + tl.load(m_base + j[None, :] * sm_s, mask=seen, other=0.0).to(tl.float32)
        s = tl.where(seen, s, float("-inf"))
        v = load_rows(v_base + j[:, None] * sv_s, j_ok, dv, DV, V_FORMAT).to(q.dtype)  # (BLOCK_N, BLOCK_DV)
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PRECISION)

    if DIRECT and HAS_SINKS:  # the one split: the sink joins here (else in merge_splits)
        sink = tl.load(Sinks + h * G + g, mask=r_ok, other=float("-inf")).to(tl.float32)
        m_i, l_i, acc = add_sink(sink, m_i, l_i, acc)
    out, lse = finish(m_i, l_i, acc)  # (BLOCK_M, BLOCK_DV), (BLOCK_M,); NaN stays NaN
    dv_ok = r_ok[:, None] & (dv[None, :] < DV)
    if DIRECT:
        o_ptr = Out + n.to(tl.int64) * so_n + h * so_h + g[:, None] * so_g + lq[:, None] * so_l + dv[None, :]
        tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=dv_ok)
    else:
        part = (nh.to(tl.int64) * splits + split) * rows + r  # (BLOCK_M,) row index into the partials
        tl.store(PartOut + part[:, None] * DV + dv[None, :], out, mask=dv_ok)
        tl.store(PartLse + part, lse, mask=r_ok)


@triton.jit
def merge_splits(
    PartOut, PartLse, Sinks, Out,
    L, DV, rows, H_KV, splits, G,
    so_n, so_h, so_g, so_l,
    HAS_SINKS: tl.constexpr,  # Sinks (H_kv * G,) float32: row r's head is h * G + r // L
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):  # fmt: skip
    nh = tl.program_id(0)
    r = tl.program_id(1)
    n = nh // H_KV
    h = nh % H_KV
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    s_ok = s < splits
    part = (nh.to(tl.int64) * splits + s) * rows + r  # (BLOCK_S,)
    lse = tl.load(PartLse + part, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + h * G + r // L).to(tl.float32)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(lse - top)  # (BLOCK_S,): 0 for splits that saw nothing
    o = tl.load(PartOut + part[:, None] * DV + dv[None, :], mask=s_ok[:, None] & (dv[None, :] < DV), other=0.0)
    total = tl.sum(w, 0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    out = tl.sum(w[:, None] * o, 0)
    out = tl.where(total == 0.0, 0.0, out / total)
    o_ptr = Out + n.to(tl.int64) * so_n + h * so_h + (r // L) * so_g + (r % L) * so_l + dv
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=dv < DV)
