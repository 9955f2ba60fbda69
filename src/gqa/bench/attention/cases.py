"""Benchmark cases: the grid of shapes, the inputs of one case, and what a call must at least move or compute.

Two workloads, for every dtype and number of KV heads ``H_kv``:

* **decode**: one new token against a KV cache, ``q (B, H_q, 1, D)``, ``k, v (B, H_kv, S, D)``, no mask (the new
  token sees every key);
* **prefill**: a causal prompt, ``q (B, H_q, L, D)``, ``k, v (B, H_kv, L, D)``, ``L == S``, with the causal pattern
  given three ways: ``is_causal=True`` (``mask="causal"``), a bool ``(L, S)`` mask (``"bool"``, True = attend) and an
  additive float ``(L, S)`` mask of 0 / -inf in the input dtype (``"additive"``). With ``L == S`` torch's top-left
  ``is_causal`` and gqa's bottom-right one are the same mask, so every implementation computes the same function.

Counting (the numbers behind "GB/s" and "GFLOP/s"):

* bytes of a decode call: K and V once (``2 B H_kv S D`` elements) plus q read and the output written once
  (``2 B H_q L D``): the fewest bytes any implementation must move. Achieved GB/s is that over the median time.
* FLOPs of a causal prefill: ``4 D`` per visible (query, key) pair (``2 D`` for ``q k^T``, ``2 D`` for ``p v``), and
  only the visible pairs count: ``B H_q (L (S - L) + L (L + 1) / 2)``. An implementation that computes the full
  ``L x S`` square does up to twice that work; it is not credited for it. The softmax is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...attention.masks import causal_mask
from ...cache.kv import kv_cache_bytes
from .workloads import KINDS, MASKS  # noqa: F401 - defined there, without torch (gqa bench attention --help)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DTYPE_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Case:
    """One benchmark case: ``q (B, H_q, L, D)``, ``k, v (B, H_kv, S, D)``; ``mask`` is ``"none"`` for decode."""

    kind: str  # "decode" or "prefill"
    dtype: torch.dtype
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    mask: str = "none"  # "none" | "causal" | "bool" | "additive"

    @property
    def group(self) -> int:
        """``G = H_q // H_kv``, the query heads per KV head."""
        return self.q_heads // self.kv_heads

    @property
    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def kv_bytes(self) -> int:
        """Bytes of this case's K and V (one layer's KV cache)."""
        return kv_cache_bytes(1, self.kv_heads, self.head_dim, self.kv_len, self.batch, self.dtype)

    @property
    def kv_cache_mib(self) -> float:
        return self.kv_bytes / 2**20

    @property
    def min_bytes(self) -> int:
        """K and V read once, q read once, the output written once."""
        return self.kv_bytes + 2 * self.batch * self.q_heads * self.q_len * self.head_dim * self.element_bytes

    @property
    def visible_pairs(self) -> int:
        """(query, key) pairs that take part, per batch row and query head, summed: ``L S`` unmasked, fewer causal."""
        L, S = self.q_len, self.kv_len
        if self.mask == "none":
            return L * S
        return L * (S - L) + L * (L + 1) // 2  # bottom-right causal

    @property
    def flops(self) -> int:
        """Useful FLOPs: ``4 D`` per visible (query, key) pair and query head (see the module docstring)."""
        return 4 * self.head_dim * self.batch * self.q_heads * self.visible_pairs

    @property
    def input_bytes(self) -> int:
        """Bytes of q, k, v and the mask tensor of this case."""
        qkv = self.min_bytes - self.batch * self.q_heads * self.q_len * self.head_dim * self.element_bytes
        mask = {"bool": 1, "additive": self.element_bytes}.get(self.mask, 0) * self.q_len * self.kv_len
        return qkv + mask

    @property
    def label(self) -> str:
        short = DTYPE_SHORT.get(self.dtype, dtype_name(self.dtype))
        if self.kind == "decode":
            return f"decode {short} B={self.batch} H_kv={self.kv_heads} S={self.kv_len}"
        return f"prefill {short} H_kv={self.kv_heads} L=S={self.q_len} mask={self.mask}"

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "dtype": dtype_name(self.dtype),
            "B": self.batch,
            "H_q": self.q_heads,
            "H_kv": self.kv_heads,
            "L": self.q_len,
            "S": self.kv_len,
            "D": self.head_dim,
            "mask": self.mask,
            "kv_cache_bytes": self.kv_bytes,
            "kv_cache_mib": self.kv_cache_mib,
            "min_bytes": self.min_bytes,
            "flops": self.flops,
        }


@dataclass(frozen=True)
class Grid:
    """The shapes of one run. Decode runs every ``(B, S)`` pair, prefill every ``L == S`` (batch ``prefill_batch``)
    with every mask form; both for every dtype and ``H_kv``."""

    decode: tuple[tuple[int, int], ...]  # (B, S)
    prefill: tuple[int, ...]  # L == S
    masks: tuple[str, ...] = MASKS
    prefill_batch: int = 1
    q_heads: int = 32
    head_dim: int = 128


def _pairs(main_batch: int, contexts: Sequence[int], extra: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    return tuple(dict.fromkeys([(main_batch, s) for s in contexts] + list(extra)))


# All H_kv at B=8 over a context sweep (the plot), plus B=1 and B=32 at two contexts. Cases too big for the memory,
# and implementations too slow for one call, are skipped at run time with the reason (see attention.py).
CPU_FULL = Grid(decode=_pairs(8, (1024, 2048, 4096, 8192, 16384), [(1, 4096), (1, 16384), (32, 4096), (32, 16384)]),
                prefill=(1024, 4096))  # fmt: skip
CPU_QUICK = Grid(decode=_pairs(8, (512, 2048), [(1, 2048), (32, 512)]), prefill=(256,))
GPU_FULL = Grid(decode=_pairs(8, (1024, 4096, 16384, 32768), [(1, 32768), (32, 8192)]), prefill=(1024, 4096))
GPU_QUICK = Grid(decode=_pairs(8, (1024, 8192), [(1, 8192), (32, 1024)]), prefill=(1024,))


def build_cases(grid: Grid, kinds: Sequence[str], dtypes: Sequence[torch.dtype], kv_heads: Sequence[int]) -> list[Case]:
    """All cases of a run, in the order they are measured: kind, dtype, ``H_kv``, then size (and mask)."""
    cases = []
    for kind in kinds:
        for dtype in dtypes:
            for h_kv in kv_heads:
                if kind == "decode":
                    for batch, s in grid.decode:
                        cases.append(Case(kind, dtype, batch, grid.q_heads, h_kv, 1, s, grid.head_dim))
                else:
                    for length in grid.prefill:
                        for mask in grid.masks:
                            case = Case(kind, dtype, grid.prefill_batch, grid.q_heads, h_kv, length, length,
                                        grid.head_dim, mask)  # fmt: skip
                            cases.append(case)
    return cases


@dataclass
class Inputs:
    """The tensors of one case: ``q (B, H_q, L, D)``, ``k, v (B, H_kv, S, D)``, and either ``is_causal`` or a
    ``(L, S)`` ``attn_mask`` (bool, or additive in the input dtype), never both."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    is_causal: bool

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5


def make_inputs(case: Case, device: torch.device, seed: int) -> Inputs:
    """q, k, v ~ N(0, 1) drawn from ``seed`` (on ``device``, then cast), and the case's mask."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(heads: int, length: int) -> torch.Tensor:
        shape = (case.batch, heads, length, case.head_dim)  # (B, H, length, D)
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(case.dtype)

    q, k, v = randn(case.q_heads, case.q_len), randn(case.kv_heads, case.kv_len), randn(case.kv_heads, case.kv_len)
    mask = None
    if case.mask in ("bool", "additive"):
        mask = causal_mask(case.q_len, case.kv_len, device)  # (L, S) bool, True = attend
        if case.mask == "additive":
            zeros = torch.zeros(case.q_len, case.kv_len, dtype=case.dtype, device=device)
            mask = zeros.masked_fill(~mask, float("-inf"))  # (L, S): 0 or -inf
    return Inputs(q, k, v, mask, is_causal=case.mask == "causal")
