"""A quantized KV cache's rows: ``(..., D)`` values <-> ``(..., D / 32 * block_bytes)`` uint8 blocks of llama.cpp's
``q8_0`` / ``q4_0``, or ``(..., D)`` uint8 bytes of float8 e4m3 values (``kv_dtypes``), and the torch dtype of a float
cache.

``quantize`` is what every cache calls on the tokens it is given: the native kernel on CPU (``gqa::quantize_kv``), the
same arithmetic in torch elsewhere (``reference_quantize``: llama.cpp's ``quantize_row_*_ref``, float32, rounding
half away from zero, so the bytes equal gguf.quants' and the native kernel's). ``dequantize`` gives the stored values
back exactly (an fp16 scale times a small integer is exact in float32); attention kernels read the blocks themselves,
a chunk at a time, and only the PyTorch fallback (``attention.quantized_cache``) calls it, on a chunk of keys.

Quantized keys are stored rotated (``rotate``: ``k H``, H a Walsh-Hadamard matrix, as llama.cpp rotates quantized K):
RoPE'd keys carry a few channels of outsized values, which set every 32-value block's scale and leave the other values
few levels; rotated, each block's values are alike in size. Queries are rotated the same way (``q k^T = (q H)(k
H)^T``), by every attention kernel that reads quantized keys. SmolLM2-135M, 2,048 tokens, K and V in q4_0:
perplexity +21% unrotated, +7.6% rotated; q8_0 K: mean KL 0.0028 -> 0.0026. Values are not rotated (it did not help
them: +7.6% -> +8.6% with q4_0 V rotated too).
"""

from __future__ import annotations

import math

import torch

from .. import kernels
from ..options.dtypes import DTYPES as FLOAT_DTYPES  # the CLI's short names: fp32, bf16, fp16
from .kv_dtypes import KVDtype, check_head_dim, kv_dtype

__all__ = [
    "as_stored",
    "dequantize",
    "held_values",
    "kv_formats",
    "native_reads",
    "quantize",
    "reference_quantize",
    "resolve_kv_dtype",
    "rotate",
    "storage_dtype",
]

DTYPE_NAMES = {dtype: name for name, dtype in FLOAT_DTYPES.items()}
FP8_MAX = 448.0  # the largest finite float8 e4m3 (torch.float8_e4m3fn) value


def resolve_kv_dtype(kv: str | KVDtype | None, model_dtype: torch.dtype, flag: str = "kv_dtype") -> KVDtype:
    """The storage type a cache of a ``model_dtype`` model takes for ``kv``: a name (``"auto"`` / ``None``: the
    model's dtype), or a ``KVDtype``; ``ValueError`` naming ``flag`` for anything else."""
    if isinstance(kv, KVDtype):
        return kv
    if kv is None or kv == "auto":
        if model_dtype in DTYPE_NAMES:
            return kv_dtype(DTYPE_NAMES[model_dtype], flag)
        if not model_dtype.is_floating_point:
            raise ValueError(f"{flag} 'auto' takes the model's dtype, and {model_dtype} is no float dtype")
        return KVDtype(str(model_dtype).removeprefix("torch."), 1, model_dtype.itemsize)  # float64, for references
    return kv_dtype(kv, flag)


def kv_formats(kinds: tuple[KVDtype, KVDtype]) -> tuple[int, ...]:
    """The native kernels' codes of K's and V's storage (``KVDtype.code``), ``()`` where both are float."""
    return tuple(kind.code for kind in kinds) if any(kind.quantized for kind in kinds) else ()


def native_reads(kinds: tuple[KVDtype, KVDtype]) -> bool:
    """Whether the native CPU kernels read K and V stored as ``kinds``: floats and q8_0 / q4_0 blocks, not fp8."""
    return not any(kind.fp8 for kind in kinds)


def storage_dtype(kv: KVDtype) -> torch.dtype:
    """The torch dtype of the cache's buffers: the float type itself, or uint8 for blocks and fp8 bytes."""
    if kv.quantized:
        return torch.uint8
    return FLOAT_DTYPES[kv.name] if kv.name in FLOAT_DTYPES else getattr(torch, kv.name)


def row_size(kv: KVDtype, head_dim: int) -> int:
    """The last dim of a cache buffer for rows of ``head_dim`` values: ``head_dim``, or its blocks' bytes
    (``ValueError`` where 32-value blocks do not tile it)."""
    return kv.row_bytes(head_dim) if kv.quantized else head_dim


def rotation_size(D: int) -> int:
    """The Walsh-Hadamard blocks' size for rows of ``D`` values: the largest power of two <= 256 dividing ``D``."""
    r = 1
    while r < 256 and D % (2 * r) == 0:
        r *= 2
    return r


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x (..., D) H`` in float32: H the orthonormal Walsh-Hadamard matrix of ``rotation_size(D)``, block-diagonal
    over ``D``; its own inverse. The butterflies and the scale of the native kernels' ``rotate_kv_row``, in the same
    order, so both give the same bits."""
    D = x.shape[-1]
    r = rotation_size(D)
    y = x.float().reshape(*x.shape[:-1], D // r, r)
    h = 1
    while h < r:
        pairs = y.reshape(*y.shape[:-1], r // (2 * h), 2, h)
        a, b = pairs.select(-2, 0), pairs.select(-2, 1)
        y = torch.stack([a + b, a - b], -2).reshape(y.shape)
        h *= 2
    return (y * torch.tensor(1.0 / math.sqrt(r), dtype=torch.float32)).reshape(x.shape)


def quantize(x: torch.Tensor, kv: KVDtype, *, rotated: bool = False) -> torch.Tensor:
    """``x (..., D)`` as the blocks of ``kv`` ``(..., D / 32 * block_bytes)`` uint8, each row on its own;
    ``rotated``: ``rotate(x)``'s blocks (how keys are stored)."""
    check_head_dim(kv, x.shape[-1])
    native = x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and not kv.fp8
    if native and kernels.available():
        from ..kernels import ops

        return ops.quantize_kv(x.detach(), kv.code, rotated)
    return reference_quantize(rotate(x) if rotated else x, kv)


def as_stored(x: torch.Tensor, kv: KVDtype, *, key: bool = False) -> torch.Tensor:
    """``x (..., D)`` as a cache of ``kv`` stores it: ``quantize``'s blocks (rotated for ``key``s), or ``x`` itself
    for a float type."""
    return quantize(x, kv, rotated=key) if kv.quantized else x


def held_values(stored: torch.Tensor, kv: KVDtype, *, key: bool = False) -> torch.Tensor:
    """The values a cache's ``stored (..., D | row bytes)`` rows hold, in the model's space: float rows as they are,
    blocks dequantized to float32 (and rotated back for ``key``s)."""
    if not kv.quantized:
        return stored
    values = dequantize(stored, kv)
    return rotate(values) if key else values


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: to the nearest integer, halves away from zero (``torch.round`` rounds them to even)."""
    a = v.abs()
    t = a.trunc()
    return torch.copysign(t + (a - t >= 0.5).to(v.dtype), v)


def reference_quantize(x: torch.Tensor, kv: KVDtype) -> torch.Tensor:
    """``quantize`` in torch ops: llama.cpp's reference quantizers, float32. A block holding a NaN or an infinity
    gets a NaN scale (it reads back as NaN, as a float cache would hold it). fp8: each value rounded to the nearest
    e4m3 (ties to even), saturated at +-448 (as vLLM's cache writes do); NaN stays NaN."""
    check_head_dim(kv, x.shape[-1])
    if kv.fp8:
        return x.detach().float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    shape = x.shape
    blocks = x.detach().float().reshape(*shape[:-1], shape[-1] // 32, 32)  # (..., nb, 32)
    finite = torch.isfinite(blocks).all(-1, keepdim=True)
    blocks = torch.where(finite, blocks, torch.zeros((), device=x.device))
    if kv.name == "q8_0":
        d = blocks.abs().amax(-1, keepdim=True) / 127.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = _round_half_away(blocks * inv).to(torch.int8).view(torch.uint8)  # (..., nb, 32)
    else:  # q4_0: the value of largest magnitude (the first of equals), sign kept, is -8 d
        i = blocks.abs().argmax(-1, keepdim=True)
        d = blocks.gather(-1, i) / -8.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        u = (blocks * inv + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        q = u[..., :16] | (u[..., 16:] << 4)  # (..., nb, 16)
        q = torch.where(finite, q, torch.full_like(q, 0x88))
    d = torch.where(finite, d, torch.full_like(d, float("nan")))
    scale = d.to(torch.float16).view(torch.uint8)  # (..., nb, 2), little-endian as the blocks store it
    return torch.cat([scale, q], -1).reshape(*shape[:-1], -1)


def dequantize(blocks: torch.Tensor, kv: KVDtype, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values ``(..., D)`` of ``blocks (..., D / 32 * block_bytes)`` uint8 (any strides), in ``dtype``."""
    if kv.fp8:
        return blocks.contiguous().view(torch.float8_e4m3fn).to(dtype)
    nb = blocks.shape[-1] // kv.block_bytes
    b = blocks.reshape(*blocks.shape[:-1], nb, kv.block_bytes)
    d = b[..., :2].contiguous().view(torch.float16).float()  # (..., nb, 1)
    if kv.name == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
    else:
        packed = b[..., 2:]
        q = torch.cat([packed & 0x0F, packed >> 4], -1).float() - 8.0
    return (d * q).reshape(*blocks.shape[:-1], nb * 32).to(dtype)
