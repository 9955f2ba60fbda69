"""What the machine multiplies fast (the ``"auto"`` dtype of ``gqa.load_model`` and the CLI, and healing's precision),
and how much memory it has free."""

from __future__ import annotations

import functools

import torch


def fast_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` multiplies bfloat16 natively: a CUDA GPU that supports it, or a CPU with AVX512-BF16 or AMX
    tiles (PyTorch emulates bf16 elsewhere, slower than float32)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    cpu = torch.cpu
    return any(getattr(cpu, name, lambda: False)() for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


@functools.cache
def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (Intel Sapphire Rapids on): oneDNN's bfloat16 GEMM runs on them, and only there
    does it beat gqa's quantized kernels on long prompts (AVX512-BF16 alone, e.g. AMD Zen 4, it does not)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def auto_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bfloat16 where ``device`` multiplies it natively (``fast_bf16``), else float32."""
    return torch.bfloat16 if fast_bf16(device) else torch.float32


def available_memory() -> int | None:
    """Bytes of RAM available to new allocations now (``MemAvailable`` of ``/proc/meminfo``), or ``None`` where that
    is unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
