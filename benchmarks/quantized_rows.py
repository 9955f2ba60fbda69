"""The quantized kernel (``gqa::qlinear_rows_n``) at 1 to 256 input rows, beside ``F.linear`` on the same weight
dequantized to float32 and kept (the fastest float alternative: no dequantization per call), on SmolLM2's and a 1B
Llama's matrix shapes.

    python benchmarks/quantized_rows.py [--threads 2] [--rows 1 4 8 16 64 256] [--repeats 3]

Weights are random blocks of each format (the K formats from ``tests/helpers/k_quants``, the others from gguf's
quantizer); medians of ``--repeats`` rounds, each the median of several calls. Prints GMAC/s (N x M x K products per
second) and the kernel's time over ``F.linear``'s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers

from gqa import kernels
from gqa.kernels import ops
from gqa.models.quantized import FORMATS
from tests.helpers.k_quants import quantize as quantize_blocks

# (name, format, out M, in K): SmolLM2's MLP up and down (Q4_1 file), its Q8_0 lm_head; a 1B Llama's Q4_K/Q6_K rows
SHAPES = (
    ("SmolLM2 up", "q4_1", 1536, 576),
    ("SmolLM2 down", "q4_1", 576, 1536),
    ("SmolLM2 lm_head", "q8_0", 49152, 576),
    ("1B up", "q4_k", 8192, 2048),
    ("1B down", "q6_k", 2048, 8192),
)


def median_s(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=3)
    ns = parser.parse_args()
    if not kernels.load():
        raise SystemExit("the native kernels are not built: run `make` (or python -m gqa.kernels)")
    torch.set_num_threads(ns.threads)
    lanes = getattr(kernels, "lane_rows", lambda: 0)()  # (absent before the lane kernels: to time older commits)
    print(f"lane kernels: {f'from {lanes} rows' if lanes else 'none'}")
    print("| matrix | format | rows | kernel ms | kernel GMAC/s | F.linear (float32, kept) ms | kernel / F.linear |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, fmt, M, K in SHAPES:
        w = np.random.default_rng(0).standard_normal((M, K)).astype(np.float32) * 0.02
        blocks = torch.from_numpy(quantize_blocks(w, gguf.GGMLQuantizationType[fmt.upper()]).reshape(M, -1).copy())
        code = FORMATS[fmt].code
        dense = ops.dequantize_rows(blocks, code, K, torch.float32)
        for n in ns.rows:
            x = torch.randn(n, K)
            calls = max(3, min(50, int(5e8 / (M * K * n))))

            def kernel(x=x, blocks=blocks, code=code) -> object:
                return ops.qlinear_rows_n(x, [blocks], [code], [None])

            def linear(x=x, dense=dense) -> object:
                return F.linear(x, dense)

            pairs = [(median_s(kernel, calls), median_s(linear, calls)) for _ in range(ns.repeats)]
            q, f = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
            print(f"| {name} | {fmt} | {n} | {q * 1e3:.3f} | {M * K * n / q / 1e9:.1f} | {f * 1e3:.3f} | {q / f:.2f} |")


if __name__ == "__main__":
    main()
