"""``split_kv_attention``: grouped decode attention as a Triton split-KV kernel (the ``triton`` backend).

Decode reads the whole KV cache for a handful of query rows, so its speed is the speed of reading K/V. The kernel
(``split_kv_kernels``) packs the ``G * L`` query rows of a KV head into one tile of at least 16 rows, so every K/V
tile is read once per group — not once per query head, as a per-head kernel would — and splits the keys across
programs so that a few sequences still fill the GPU; a second pass merges the splits by log-sum-exp.

It takes what decoding needs: bottom-right causal, bool and additive masks, per-row ``start``/``end`` slots (left
padding and each row's cursor in a static cache: read from device memory, so a captured CUDA graph stays valid as
the cache fills), a sliding window (its keys alone are read: the splits tile the window, wherever each row's cursor
is), soft-capping and sinks (Gemma 2, gpt-oss), ``L <= 16`` new tokens (speculative decoding), any group size,
``D <= 256``, float16, bfloat16 and float32 (its dots as three TF32 products on the tensor cores: float32
accuracy), and a quantized cache where it lies: K and/or V as uint8 rows of llama.cpp ``q8_0`` / ``q4_0`` blocks
(``k_format`` / ``v_format``, ``kv_formats``), each tile dequantized in registers. Inference only.
``TRITON_INTERPRET=1`` runs it on CPU tensors (tests).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

from ...attention.checks import (
    HALF_DTYPES,
    Window,
    check_mask,
    check_qkv,
    check_sinks,
    check_softcap,
    check_window,
    flat_view,
    kernel_refusal,
    shape_str,
)
from ...cache.quantize import rotate
from .kv_formats import FLOAT, block_kind, stand_in, values_per_row

DTYPES = (torch.float32, *HALF_DTYPES)
MAX_L = 16  # new tokens per call (G * L rows per KV head)
MAX_HEAD_DIM = 256
MIN_CHUNK = 512  # keys per split at least: below this the merge costs more than the parallelism gains
# (BLOCK_N keys per step, warps, pipeline stages) of the attend kernel; CONFIGS are what benchmarks/gpu_check.py
# sweeps (graph-replayed, so launch overhead is out of the numbers) to choose the default.
CONFIGS = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3), (64, 8, 4), (32, 4, 4))
DEFAULT_CONFIG = (128, 4, 3)  # within 0-8% of SDPA's rate on every shape swept on an H200 (docs/performance.md)
WIDE_CONFIG = (32, 8, 2)  # head dims over 128
PROGRAMS_PER_SM = 4  # splits are added until the grid has this many programs per multiprocessor
SHARED_MEMORY_HEADROOM = 32 * 1024  # shared memory besides the K/V pipeline (q tile, layout conversions)


def config_for(D: int, D_v: int, itemsize: int = 2, shared_memory: int = 227 * 1024) -> tuple[int, int, int]:
    """The attend kernel's ``(BLOCK_N, num_warps, num_stages)`` for head dims ``D``, ``D_v``, elements of
    ``itemsize`` bytes and a device giving a block ``shared_memory`` bytes: the first of the default (or, past
    D=128, the wide) configuration and smaller ones whose ``pipeline_bytes`` fit. The default in float32 at D=128
    asked 288 KiB of the H200's 227 KiB."""
    candidates = (WIDE_CONFIG,) if max(D, D_v) > 128 else (DEFAULT_CONFIG, (64, 4, 2))
    for config in (*candidates, (32, 4, 2), (16, 4, 1)):
        if pipeline_bytes(config, D, D_v, itemsize) + SHARED_MEMORY_HEADROOM <= shared_memory:
            return config
    return (16, 4, 1)


def pipeline_bytes(config: tuple[int, int, int], D: int, D_v: int, itemsize: int) -> int:
    """Shared memory of the K and V tiles a configuration buffers: ``max(stages - 1, 1) x BLOCK_N x (D + D_v)``
    elements (head dims rounded up to powers of 2), as Triton's pipeliner allocates them."""
    block_n, _, stages = config
    return max(stages - 1, 1) * block_n * (triton_next_pow2(max(D, 16)) + triton_next_pow2(max(D_v, 16))) * itemsize


@functools.cache
def _shared_memory_of(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", 163 * 1024)


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package is installed (checked without importing it: the import takes seconds)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def supports(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    v_format: int = FLOAT,
    attn_mask: torch.Tensor | None = None,
) -> str | None:
    """``None`` if the kernel can run this call, else the reason it cannot (``v_format``: what ``value`` stores,
    ``kv_formats``)."""
    if not triton_available():
        return "triton is not installed (pip install triton)"
    if query.device.type != "cuda" and not (query.device.type == "cpu" and interpreted()):
        return f"device {query.device.type} (CUDA, or CPU under TRITON_INTERPRET=1)"
    if query.dtype not in DTYPES:
        return f"dtype {query.dtype} (float32, float16 and bfloat16 only)"
    if query.shape[-2] > MAX_L:
        return f"L = {query.shape[-2]} new tokens (at most {MAX_L}: a decode kernel)"
    head_dim = max(query.shape[-1], values_per_row(value, block_kind("v_format", v_format)))
    if head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} (at most {MAX_HEAD_DIM})"
    return kernel_refusal(query, key, value, dropout_p=dropout_p, return_weights=return_weights, attn_mask=attn_mask)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter: few programs, but still several splits in tests
    return _sm_count_of(_index(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def plan_splits(programs: int, S: int, sm_count: int) -> tuple[int, int]:
    """``(splits, chunk)``: how many programs share each KV head's ``S`` keys, and how many keys each takes.

    Splits are added until ``programs * splits`` reaches ``PROGRAMS_PER_SM`` per multiprocessor, keeping at least
    ``MIN_CHUNK`` keys per split; ``chunk`` is a multiple of 128 so the key tiles stay aligned."""
    want = -(-PROGRAMS_PER_SM * sm_count // max(programs, 1))
    splits = max(1, min(want, -(-S // MIN_CHUNK)))
    chunk = -(-S // splits)
    chunk = -(-chunk // 128) * 128
    return -(-S // chunk), chunk


def _blocks(rows: int, D: int, D_v: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_D, BLOCK_DV)``: query rows per tile (16 to 64) and the head dims rounded up to powers of 2."""
    block_m = min(max(16, triton_next_pow2(rows)), 64)
    return block_m, max(16, triton_next_pow2(D)), max(16, triton_next_pow2(D_v))


def _precision(q: torch.Tensor) -> str:
    """``tl.dot``'s input precision: for float32 on a GPU three TF32 products (float32 accuracy on the tensor cores);
    in the interpreter plain float32; half inputs ignore it ("tf32" is Triton's default)."""
    if q.device.type != "cuda":
        return "ieee"
    return "tf32x3" if q.dtype == torch.float32 else "tf32"


def softcap_arg(softcap: float | None) -> float:
    """The kernels' float32 ``softcap`` argument (1.0 when unused): a cap beyond float32's range as inf (the scores
    stay as they are), one below its smallest normal as that (every score capped as the cap itself would)."""
    if softcap is None:
        return 1.0
    return math.inf if softcap > torch.finfo(torch.float32).max else max(softcap, torch.finfo(torch.float32).tiny)


def triton_next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _row_index(t: torch.Tensor | None, N: int, name: str, device: torch.device) -> torch.Tensor | None:
    """A per-row slot bound as an int32/int64 ``(N,)`` tensor on ``device`` (a 0-dim tensor or int is broadcast)."""
    if t is None:
        return None
    t = torch.as_tensor(t, device=device)
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")
    if t.dim() == 0:
        return t.reshape(1).expand(N).contiguous()
    if t.shape != (N,):
        raise ValueError(f"{name} must have shape ({N},) = (batch rows,) or be a scalar, got {shape_str(t)}")
    return t.contiguous()


def split_kv_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    attn_mask: torch.Tensor | None = None,
    start: torch.Tensor | None = None,
    end: torch.Tensor | None = None,
    window: int | Window | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    k_format: int = FLOAT,
    v_format: int = FLOAT,
) -> torch.Tensor:
    """Grouped attention of a few new tokens over a KV cache, float or quantized.

    Parameters
    ----------
    query : ``(*B, H_q, L, D)``, ``L <= 16``; any strides.
    key, value : ``(*B, H_kv, S, D)``, ``(*B, H_kv, S, D_v)``; last dim contiguous (cache views are fine). As
        ``k_format`` / ``v_format`` say, uint8 ``(*B, H_kv, S, D / 32 * block_bytes)`` rows of blocks instead.
    scale : multiplies the scores; default ``D ** -0.5``.
    is_causal : bottom-right: row ``l`` sees keys ``j <= end - L + l`` (``end = S`` by default).
    attn_mask : broadcastable to ``(*B, H_q, L, S)``; bool (True = attend) or additive float.
    start, end : ``(N,)`` integer tensors (``N = prod(*B)``) or scalars: row ``n`` sees only keys
        ``start[n] <= j < end[n]`` (left padding; a static cache's cursor). Read on the device, never synced.
    window : ``(left, right)`` or ``left``, as ``grouped_attention``'s, aligned bottom-right at ``end``: row ``l``
        sees keys ``end - L + l - left <= j <= end - L + l + right``; only the window's keys are read.
    softcap : ``softcap * tanh(scores / softcap)`` on the scaled scores, before the mask.
    sinks : ``(H_q,)`` logits, each a key of value zero in its head's softmax.
    num_splits : KV splits per head (default: enough programs to fill the GPU, ``plan_splits``).
    k_format, v_format : what ``key`` / ``value`` store (``KVDtype.code``): -1 float rows in the query's dtype, 0
        llama.cpp ``q8_0`` blocks (a 2-byte fp16 scale, 32 int8), 1 ``q4_0`` blocks (the scale, 16 bytes of nibbles:
        value ``j`` low, ``16 + j`` high, ``x = d * (q - 8)``); read where they lie, dequantized in registers.

    Returns
    -------
    ``(*B, H_q, L, D_v)`` in the query's dtype. A row that sees no key is zeros.
    """
    k_kind, v_kind = block_kind("k_format", k_format), block_kind("v_format", v_format)
    k_values, v_values = key, value
    if isinstance(query, torch.Tensor):  # the shape checks see the values the blocks hold
        k_values, v_values = stand_in("key", key, k_kind, query), stand_in("value", value, v_kind, query)
    shape = check_qkv(query, k_values, v_values)
    check_mask(attn_mask, shape, query)
    window = check_window(window)
    softcap = check_softcap(softcap)
    check_sinks(sinks, shape, query)
    reason = supports(query, key, value, v_format=v_format, attn_mask=attn_mask)
    if reason is not None:
        raise ValueError(f"the triton split-KV kernel cannot run this call: {reason}")
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    return launch(query, key, value, shape, float(shape.D**-0.5 if scale is None else scale), bool(is_causal),
                  attn_mask, start, end, num_splits, window=window, softcap=softcap, sinks=sinks,
                  k_format=k_format, v_format=v_format)  # fmt: skip


def launch(
    query, key, value, shape, scale: float, is_causal: bool, attn_mask, start, end, num_splits, config=None, *,
    window: Window | None = None, softcap: float | None = None, sinks: torch.Tensor | None = None,
    k_format: int = FLOAT, v_format: int = FLOAT,
) -> torch.Tensor:  # fmt: skip
    """``split_kv_attention`` on validated inputs (the backend and CUDA graphs call this: no checks twice);
    ``config``: ``(BLOCK_N, num_warps, num_stages)`` instead of ``config_for``'s; ``shape`` the values' sizes (of a
    quantized ``key`` / ``value``, what its blocks hold)."""
    from . import split_kv_kernels as kernels  # imports triton (seconds): only once a kernel runs

    H_kv, G, L, S, D, D_v = shape.H_kv, shape.G, shape.L, shape.S, shape.D, shape.D_v
    N = math.prod(shape.batch)
    rows = G * L
    if k_format != FLOAT:  # quantized keys are stored rotated: the queries are rotated to match
        query = rotate(query).to(query.dtype)
    q = query.reshape(N, H_kv, G, L, D)  # a view for the layouts attention modules make
    if q.stride(-1) != 1:
        q = q.contiguous()  # G * L rows per head: small
    k, v = flat_view(key, 3), flat_view(value, 3)  # (N, H_kv, S, D | row bytes), (N, H_kv, S, D_v | row bytes)
    out = torch.empty(*shape.batch, shape.H_q, L, D_v, dtype=query.dtype, device=query.device)
    o = out.view(N, H_kv, G, L, D_v)
    mask_kind, mask = 0, q
    if attn_mask is not None:
        mask_kind = 1 if attn_mask.dtype == torch.bool else 2
        mask = attn_mask.view(torch.uint8) if mask_kind == 1 else attn_mask
        mask = mask.expand(shape.scores).reshape(N, H_kv, G, L, S)  # stride-0 where broadcast: no copy usually
    start_n = _row_index(start, N, "start", q.device)
    end_n = _row_index(end, N, "end", q.device)

    left, right = (None, None) if window is None else window
    span = S if left is None else min(S, left + L)  # the keys any row's window reaches, from its first on
    sink_logits = None if sinks is None else sinks.detach().to(torch.float32).contiguous()  # (H_q,)

    block_m, block_d, block_dv = _blocks(rows, D, D_v)
    row_blocks = -(-rows // block_m)
    if num_splits is None:
        splits, chunk = plan_splits(N * H_kv * row_blocks, span, _sm_count(q.device))
    else:
        chunk = -(-span // num_splits)
        splits = -(-span // chunk)
    direct = splits == 1
    part_out = part_lse = out
    if not direct:
        part_out = torch.empty(N * H_kv, splits, rows, D_v, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(N * H_kv, splits, rows, dtype=torch.float32, device=q.device)
    if config is None:
        memory = _shared_memory_of(_index(q.device)) if q.device.type == "cuda" else 227 * 1024
        config = config_for(D, D_v, query.element_size(), memory)
    block_n, warps, stages = config
    kernels.split_kv_attend[(N * H_kv, splits, row_blocks)](
        q, k, v, mask, q if start_n is None else start_n, q if end_n is None else end_n,
        q if sink_logits is None else sink_logits, o, part_out, part_lse,
        scale, S, L, D, D_v, rows, chunk, H_kv, splits,
        shape.G, left or 0, right or 0, softcap_arg(softcap),
        q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *(mask.stride() if mask_kind else (0,) * 5),
        o.stride(0), o.stride(1), o.stride(2), o.stride(3),
        MASK_KIND=mask_kind, IS_CAUSAL=is_causal, HAS_START=start_n is not None, HAS_END=end_n is not None,
        HAS_LEFT=left is not None, HAS_RIGHT=right is not None, HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sink_logits is not None, DIRECT=direct, K_FORMAT=k_format, V_FORMAT=v_format, PRECISION=_precision(q),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if not direct:
        kernels.merge_splits[(N * H_kv, rows)](
            part_out, part_lse, part_lse if sink_logits is None else sink_logits, o, L, D_v, rows, H_kv, splits,
            shape.G, o.stride(0), o.stride(1), o.stride(2), o.stride(3), HAS_SINKS=sink_logits is not None,
            BLOCK_S=triton_next_pow2(splits), BLOCK_DV=block_dv, num_warps=4,
        )  # fmt: skip
    return out


@torch.library.custom_op("gqa_triton::split_kv_decode", mutates_args=())
def decode_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    scale: float,
    window: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_format: int = FLOAT,
    v_format: int = FLOAT,
) -> torch.Tensor:
    """``split_kv_attention(query, key, value, scale=scale, start=start, end=end, window=..., softcap=...,
    sinks=sinks, k_format=k_format, v_format=v_format)`` as a custom op, so that ``torch.compile`` keeps the Triton
    kernel as one opaque call (``decoding.fused_step``): query ``(B, H_q, L, D)``, key/value a whole static cache
    ``(B, H_kv, C, D | D_v)`` (uint8 ``(B, H_kv, C, row bytes)`` of q8_0 / q4_0 blocks for formats 0 / 1),
    ``start``/``end`` ``(B,)`` or 0-dim slot bounds, ``window`` the keys a query sees to its left (-1: all),
    ``softcap`` 0 for none, ``sinks`` ``(H_q,)`` or None. -> ``(B, H_q, L, D_v)``. Checked as ``split_kv_attention``
    checks."""
    return split_kv_attention(query, key, value, scale=scale, start=start, end=end,
                              window=None if window < 0 else window, softcap=softcap or None, sinks=sinks,
                              k_format=k_format, v_format=v_format)  # fmt: skip


@decode_op.register_fake
def _decode_op_fake(query, key, value, start, end, scale, window=-1, softcap=0.0, sinks=None, k_format=FLOAT,
                    v_format=FLOAT):  # fmt: skip
    return query.new_empty(*query.shape[:-1], values_per_row(value, block_kind("v_format", v_format)))
