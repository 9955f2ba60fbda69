"""Reading K/V rows in the Triton kernels whatever their format (``kv_formats``; import needs triton): float rows as
they are, or uint8 rows of llama.cpp blocks dequantized in registers — never a dequantized copy of the cache.

A row of ``D`` values is ``D / 32`` blocks; value ``c`` lies in block ``c // 32`` at ``i = c % 32``. A block is its
fp16 scale ``d`` (two bytes, little-endian) then, for ``q8_0`` (34 bytes), 32 int8 ``q`` (``x = d * q``), for ``q4_0``
(18 bytes), 16 bytes holding value ``i`` in the low nibble of byte ``i`` and value ``16 + i`` in its high nibble
(``x = d * (q - 8)``). Each value's scale is gathered beside it (the tile's bytes are read from L1 again, not from
memory). An ``fp8_e4m3`` row is ``D`` bytes, each a float8 e4m3 value (``float8e4nv``: compute capability 8.9+).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_rows(rows, rows_ok, c, D, FORMAT: tl.constexpr):
    """Values ``c (BLOCK_D,)`` of the rows starting at pointers ``rows (BLOCK_N, 1)`` -> ``(BLOCK_N, BLOCK_D)``: the
    float rows' own dtype for ``FORMAT`` -1, else float32 from ``q8_0`` (0) or ``q4_0`` (1) blocks or ``fp8_e4m3``
    bytes (2); zeros where ``rows_ok (BLOCK_N,)`` is false or ``c >= D``."""
    ok = rows_ok[:, None] & (c[None, :] < D)
    if FORMAT == -1:
        x = tl.load(rows + c[None, :], mask=ok, other=0.0)
    elif FORMAT == 2:
        x = tl.load(rows + c[None, :], mask=ok, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        i = (c % 32)[None, :]
        if FORMAT == 0:
            block = rows + (c // 32 * 34)[None, :]
            q = tl.load(block + 2 + i, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        else:
            block = rows + (c // 32 * 18)[None, :]
            byte = tl.load(block + 2 + i % 16, mask=ok, other=0)
            q = tl.where(i < 16, byte & 15, byte >> 4).to(tl.float32) - 8.0
        lo = tl.load(block, mask=ok, other=0).to(tl.uint16)
        hi = tl.load(block + 1, mask=ok, other=0).to(tl.uint16)
        x = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32) * q
    return x
