"""The inputs of the quantized kernels as their int8 path sees them, from numpy alone (independent of gqa)."""

from __future__ import annotations

import numpy as np


def expected_input_products(x: np.ndarray) -> np.ndarray:
    """x's values as the int8 path sees them, from numpy in float32: per block of 32, d = amax / 127, q = x * (1 / d)
    rounded half to even, the value q * d; a block too small to scale is 0, one beyond 2^64 stays as it is (float)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        q = np.rint(blocks * inv)
        scaled = np.where(np.isfinite(inv), q * d, np.float32(0)).astype(np.float32)
    return np.where(amax > np.float32(2.0**64), blocks, scaled).reshape(x.shape)
