"""A quantized KV cache's rows: ``(..., D)`` values <-> ``(..., D / 32 * block_bytes)`` uint8 blocks of llama.cpp's
``q8_0`` / ``q4_0`` (``kv_dtypes``), and the torch dtype of a float cache.

``quantize`` is what every cache calls on the tokens it is given: the native kernel on CPU (``gqa::quantize_kv``), the
same arithmetic in torch elsewhere (``reference_quantize``: llama.cpp's ``quantize_row_*_ref``, float32, rounding
half away from zero, so the bytes equal gguf.quants' and the native kernel's). ``dequantize`` gives the stored values
back exactly (an fp16 scale times a small integer is exact in float32); attention kernels read the blocks themselves,
a chunk at a time, and only the PyTorch fallback (``attention.quantized_cache``) calls it, on a chunk of keys.
"""

from __future__ import annotations

import torch

from .. import kernels
from .kv_dtypes import KVDtype, check_head_dim, kv_dtype

__all__ = ["as_stored", "dequantize", "quantize", "reference_quantize", "resolve_kv_dtype", "storage_dtype"]

FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in FLOAT_DTYPES.items()}


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
    if isinstance(kv, str) and kv.startswith("fp8"):
        raise ValueError(f"{flag} {kv!r}: an fp8 KV cache is not built yet (CPU kernels read q8_0 and q4_0 blocks)")
    return kv_dtype(kv, flag)


def storage_dtype(kv: KVDtype) -> torch.dtype:
    """The torch dtype of the cache's buffers: the float type itself, or uint8 for blocks."""
    if kv.quantized:
        return torch.uint8
    return FLOAT_DTYPES[kv.name] if kv.name in FLOAT_DTYPES else getattr(torch, kv.name)


def row_size(kv: KVDtype, head_dim: int) -> int:
    """The last dim of a cache buffer for rows of ``head_dim`` values: ``head_dim``, or its blocks' bytes
    (``ValueError`` where 32-value blocks do not tile it)."""
    return kv.row_bytes(head_dim) if kv.quantized else head_dim


def quantize(x: torch.Tensor, kv: KVDtype) -> torch.Tensor:
    """``x (..., D)`` as the blocks of ``kv`` ``(..., D / 32 * block_bytes)`` uint8, each row on its own."""
    check_head_dim(kv, x.shape[-1])
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and kernels.available():
        from ..kernels import ops

        return ops.quantize_kv(x.detach(), kv.code)
    return reference_quantize(x, kv)


def as_stored(x: torch.Tensor, kv: KVDtype) -> torch.Tensor:
    """``x (..., D)`` as a cache of ``kv`` stores it: ``quantize``'s blocks, or ``x`` itself for a float type."""
    return quantize(x, kv) if kv.quantized else x


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's ``roundf``: to the nearest integer, halves away from zero (``torch.round`` rounds them to even)."""
    a = v.abs()
    t = a.trunc()
    return torch.copysign(t + (a - t >= 0.5).to(v.dtype), v)


def reference_quantize(x: torch.Tensor, kv: KVDtype) -> torch.Tensor:
    """``quantize`` in torch ops: llama.cpp's reference quantizers, float32. A block holding a NaN or an infinity
    gets a NaN scale (it reads back as NaN, as a float cache would hold it)."""
    check_head_dim(kv, x.shape[-1])
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
    nb = blocks.shape[-1] // kv.block_bytes
    b = blocks.reshape(*blocks.shape[:-1], nb, kv.block_bytes)
    d = b[..., :2].contiguous().view(torch.float16).float()  # (..., nb, 1)
    if kv.name == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
    else:
        packed = b[..., 2:]
        q = torch.cat([packed & 0x0F, packed >> 4], -1).float() - 8.0
    return (d * q).reshape(*blocks.shape[:-1], nb * 32).to(dtype)
