"""The KV cache's storage types, by llama.cpp's names (``-ctk`` / ``-ctv``), and their bytes — torch-free, so
``gqa info`` can say what each costs without importing torch.

A float type stores each value as it is. The block types store each head's ``D`` values of a token in blocks of 32
along the head dimension, each with one fp16 scale, as llama.cpp's ``q8_0`` (32 int8 values: 34 bytes, 8.5 bits a
value) and ``q4_0`` (32 4-bit values: 18 bytes, 4.5 bits) blocks do: a token's K or V row is quantized on its own
when it is written, so a row never changes once stored, and the block is the unit the int8 dot-product kernels of
the quantized weights already multiply. ``fp8_e4m3`` (vLLM's ``--kv-cache-dtype fp8``; ``fp8`` names it too) stores
each value as one float8 e4m3 byte (``torch.float8_e4m3fn``: 3 mantissa bits, finite up to +-448, beyond which
values saturate), with no scale: read by the CUDA kernels only (Triton's ``float8e4nv``, compute capability 8.9+).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KV_DTYPES", "KVDtype", "check_head_dim", "kv_bytes_per_token", "kv_dtype"]


@dataclass(frozen=True)
class KVDtype:
    """One storage type of the KV cache: ``block`` values (along the head dimension) take ``block_bytes`` bytes."""

    name: str
    block: int
    block_bytes: int
    code: int = -1  # a stored format's code in the kernels (q8_0 / q4_0: the quantized weights' numbering), -1: float

    @property
    def quantized(self) -> bool:
        """Whether the cache stores another format than the activations': uint8 rows of blocks or of fp8 bytes."""
        return self.code >= 0

    @property
    def fp8(self) -> bool:
        """Whether the values are float8 bytes (CUDA kernels only)."""
        return self.name.startswith("fp8")

    @property
    def bits_per_value(self) -> float:
        return 8 * self.block_bytes / self.block

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one head's ``head_dim`` values of one token (K or V); ``ValueError`` where the blocks do not
        tile ``head_dim``."""
        check_head_dim(self, head_dim)
        return head_dim // self.block * self.block_bytes


KV_DTYPES: dict[str, KVDtype] = {
    "fp32": KVDtype("fp32", 1, 4),
    "bf16": KVDtype("bf16", 1, 2),
    "fp16": KVDtype("fp16", 1, 2),
    "q8_0": KVDtype("q8_0", 32, 34, 0),  # 32 int8 values + an fp16 scale
    "q4_0": KVDtype("q4_0", 32, 18, 1),  # 32 4-bit values (offset 8) + an fp16 scale
    "fp8_e4m3": KVDtype("fp8_e4m3", 1, 1, 2),  # one float8 e4m3 byte a value, no scale
}
ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's --kv-cache-dtype fp8 is e4m3


def kv_dtype(name: str, flag: str = "kv_cache_dtype") -> KVDtype:
    """The storage type called ``name``; ``ValueError`` naming ``flag`` and the choices for any other."""
    if not isinstance(name, str) or ALIASES.get(name, name) not in KV_DTYPES:
        raise ValueError(f"{flag} must be one of {', '.join([*KV_DTYPES, *ALIASES])}, got {name!r}")
    return KV_DTYPES[ALIASES.get(name, name)]


def check_head_dim(kv: KVDtype, head_dim: int) -> None:
    """``ValueError`` unless ``head_dim`` is a positive multiple of ``kv``'s block."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % kv.block:
        raise ValueError(f"a {kv.name} KV cache needs a head dim that is a multiple of {kv.block}, got {head_dim!r}")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv: KVDtype) -> int:
    """Bytes one token adds to a KV cache: K and V, every layer's ``num_kv_heads`` rows of ``head_dim`` values."""
    for name, n in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return 2 * num_layers * num_kv_heads * kv.row_bytes(head_dim)
