"""The machine's ceilings, measured in the same run as the attention calls they bound.

* **read bandwidth**: ``x.sum()`` over a float32 buffer far larger than the caches (all threads on CPU, the whole GPU
  on CUDA): bytes read over the median time. On CUDA a device-to-device copy is measured too (bytes read + written).
* **matmul rate**: an ``n x n @ n x n`` product per dtype on random data, ``2 n^3`` FLOPs over the median time.

A decode call's fraction of the limit is its achieved GB/s over the read bandwidth; a prefill call's is its achieved
(causal, useful) GFLOP/s over the matmul rate of its dtype.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .cases import dtype_name


@dataclass
class Limits:
    """Measured ceilings; ``gemm_gflops`` is keyed by dtype name (``"float32"``, ``"bfloat16"``)."""

    read_gbps: float
    read_buffer_bytes: int
    gemm_gflops: dict[str, float]
    gemm_n: int
    copy_gbps: float | None = None  # CUDA: device-to-device copy, read + write bytes
    samples: dict[str, list[float]] = field(default_factory=dict)  # ms per repetition, by measurement

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def best(a: Limits, b: Limits) -> Limits:
        """The higher of two measurements of each ceiling (the run measures at its start and its end)."""
        gemm = {k: max(a.gemm_gflops.get(k, 0.0), b.gemm_gflops.get(k, 0.0)) for k in {*a.gemm_gflops, *b.gemm_gflops}}
        copy = max((c for c in (a.copy_gbps, b.copy_gbps) if c is not None), default=None)
        samples = {f"start/{k}": v for k, v in a.samples.items()} | {f"end/{k}": v for k, v in b.samples.items()}
        return Limits(max(a.read_gbps, b.read_gbps), a.read_buffer_bytes, gemm, a.gemm_n, copy, samples)


def time_ms(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> list[float]:
    """Wall time of ``fn()`` in ms, ``repeats`` times after ``warmup`` calls; CUDA events on a GPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def measure_limits(
    device: torch.device, dtypes: Sequence[torch.dtype], *, read_bytes: int, gemm_n: int, repeats: int = 5
) -> Limits:
    """Read bandwidth over a ``read_bytes`` float32 buffer and the ``gemm_n``-cubed matmul rate of each dtype."""
    samples: dict[str, list[float]] = {}
    read_gbps, copy_gbps = _bandwidth(device, read_bytes, repeats, samples)
    gemm = {}
    for dtype in dict.fromkeys(dtypes):
        a = torch.randn(gemm_n, gemm_n, device=device).to(dtype)
        b = torch.randn(gemm_n, gemm_n, device=device).to(dtype)
        name = dtype_name(dtype)
        samples[f"gemm_{name}"] = time_ms(lambda a=a, b=b: torch.matmul(a, b), device, repeats)
        gemm[name] = 2 * gemm_n**3 / statistics.median(samples[f"gemm_{name}"]) / 1e6
        del a, b
    return Limits(read_gbps, read_bytes, gemm, gemm_n, copy_gbps, samples)


def _bandwidth(device: torch.device, read_bytes: int, repeats: int, samples: dict[str, list[float]]) -> tuple:
    """(read GB/s of ``x.sum()``, CUDA copy GB/s counting read + write bytes, or None on CPU)."""
    x = torch.empty(read_bytes // 4, dtype=torch.float32, device=device).normal_()
    samples["read_sum"] = time_ms(x.sum, device, repeats)
    read_gbps = x.numel() * 4 / statistics.median(samples["read_sum"]) / 1e6
    copy_gbps = None
    if device.type == "cuda":
        y = torch.empty_like(x)
        samples["copy"] = time_ms(lambda: y.copy_(x), device, repeats)
        copy_gbps = 2 * x.numel() * 4 / statistics.median(samples["copy"]) / 1e6
    return read_gbps, copy_gbps
