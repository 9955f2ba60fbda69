"""Blocks of llama.cpp's K formats (Q4_K, Q5_K, Q6_K) made from float weights, for tests: ``gguf`` dequantizes them
but has no quantizer. A plain round-to-nearest quantizer written from the block layouts (llama.cpp's
``ggml-common.h``), independent of gqa's kernels; the tests check what it writes through ``gguf.quants.dequantize``.
``quantize`` takes every type (the 32-value formats through ``gguf.quants.quantize``)."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def quantize(x: np.ndarray, kind: Q) -> np.ndarray:
    """``x (M, K)`` float as ``uint8 (M, K / block * block_bytes)`` blocks of ``kind``."""
    if kind not in K_TYPES:
        return gguf.quants.quantize(np.ascontiguousarray(x, dtype=np.float32), kind)
    M, K = x.shape
    if K % 256:
        raise ValueError(f"{kind.name} needs rows of whole 256-value super-blocks, got K = {K}")
    sb = x.astype(np.float32).reshape(M * K // 256, 256)
    out = _q6_k(sb) if kind == Q.Q6_K else _q45_k(sb, 31 if kind == Q.Q5_K else 15)
    return out.reshape(M, -1)


def _half(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``v`` as float16 bytes ``(n, 2)`` and the float32 value it stores."""
    h = v.astype(np.float16)
    return h.reshape(-1, 1).view(np.uint8), h.astype(np.float32)


def _q45_k(sb: np.ndarray, top: int) -> np.ndarray:
    """Q4_K (``top`` 15) or Q5_K (``top`` 31): per 32-value sub-block ``w = d * sc * q - dmin * m``."""
    n = sb.shape[0]
    sub = sb.reshape(n, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)  # the sub-block's minimum, subtracted as dmin * m >= 0
    scale = (sub.max(-1) - low) / top
    d_bytes, d = _half(scale.max(-1) / 63)
    dmin_bytes, dmin = _half(-low.min(-1) / 63)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(-low / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.rint((sub + (dmin[:, None] * m)[..., None]) / np.where(step > 0, step, 1))
    q = np.clip(q, 0, top).astype(np.uint8).reshape(n, 256)
    scales = np.empty((n, 12), np.uint8)  # llama.cpp's 12-byte packing of eight 6-bit scales and mins
    scales[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    scales[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    scales[:, 8:12] = (sc[:, 4:] & 0x0F) | (m[:, 4:] & 0x0F) << 4
    pairs = q.reshape(n, 4, 2, 32)  # (group of 64, low / high half, 32)
    nibbles = ((pairs[:, :, 0] & 0x0F) | (pairs[:, :, 1] & 0x0F) << 4).reshape(n, 128)
    parts = [d_bytes, dmin_bytes, scales]
    if top == 31:  # the fifth bits: bit j of byte l is value l of sub-block j
        bits = (q.reshape(n, 8, 32) >> 4) & 1
        parts.append((bits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8))
    return np.concatenate([*parts, nibbles], axis=1)


def _q6_k(sb: np.ndarray) -> np.ndarray:
    """Q6_K: per 16 values an int8 scale, ``w = d * sc * (q - 32)``."""
    n = sb.shape[0]
    sixteen = sb.reshape(n, 16, 16)
    scale = np.abs(sixteen).max(-1) / 32
    d_bytes, d = _half(scale.max(-1) / 127)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    step = (d[:, None] * sc.astype(np.float32))[..., None]
    q = np.clip(np.rint(sixteen / np.where(step > 0, step, 1)), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, 2, 4, 32)  # (half of 128, quarter p, 32)
    ql = np.concatenate(
        [(q[:, :, 0] & 0x0F) | (q[:, :, 2] & 0x0F) << 4, (q[:, :, 1] & 0x0F) | (q[:, :, 3] & 0x0F) << 4], axis=2
    ).reshape(n, 128)
    qh = ((q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)
