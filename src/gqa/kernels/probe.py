"""What ``gqa info`` says of the native kernels, found without importing torch or loading the library: whether the
library ``gqa.kernels.load`` would load is built, and the SIMD width that library reports once loaded."""

from __future__ import annotations

from pathlib import Path

from . import _cpu_flags, available, build_on_first_use, disabled, library_path

__all__ = ["built_library", "simd_width"]


def built_library() -> Path | None:
    """The library of this source, torch version and CPU (``library_path``) if it is built and the kernels are not
    disabled, else ``None``: what ``gqa.kernels.available()`` says, without loading the library. Where ``load``
    builds them on first use (``GQA_BUILD_KERNELS=1``) and they are not built, this builds them too (through
    ``available``, which imports torch)."""
    if disabled():
        return None
    path = library_path()
    if not path.exists() and build_on_first_use():
        available()
    return path if path.exists() else None


def simd_width() -> int:
    """The float32 lanes ``gqa.kernels.simd_width()`` reports for a library built on this CPU: it is compiled
    ``-march=native``, so 16 where the CPU has AVX-512 (``avx512f``), 8 where it has AVX2 and FMA, else 1 (plain
    loops), read from the CPU flags that the library's build key hashes (``/proc/cpuinfo``)."""
    flags = set(_cpu_flags().split())
    return 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= flags else 1
