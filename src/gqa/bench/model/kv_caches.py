"""What each run of ``gqa bench model`` stores in its KV cache for an entry of ``--kv-cache-dtypes``: the storage type
per engine (llama.cpp's own for ``auto``: f16), which engines cannot hold a type (skipped, and said so in the report),
and the bytes a token takes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

import torch

from ...cache.kv_dtypes import KV_DTYPES, KVDtype, check_head_dim
from ...cache.kv_dtypes import kv_bytes_per_token as kind_bytes_per_token
from ...cache.quantize import resolve_kv_dtype, storage_dtype
from ...models.config import ModelConfig
from ..llama_cpp_kv import cache_kind
from .worker import DTYPES, QUANTIZED

__all__ = ["cache_dtype", "check_kv_dtypes", "kv_bytes_per_token", "kv_kind", "kv_runs", "kv_skip"]


def cache_dtype(dtype: str) -> torch.dtype:
    """The KV cache's dtype for a bench dtype: itself, or for a block format the activations' (``auto_dtype``)."""
    from ...hardware import auto_dtype

    return auto_dtype() if dtype in QUANTIZED else DTYPES[dtype]


def kv_kind(engine: str, dtype: str, kv: str) -> KVDtype | None:
    """What the KV cache of an ``engine`` run at bench ``dtype`` stores for ``--kv-cache-dtypes`` entry ``kv``:
    llama.cpp's type (``auto``: its f16), else ``kv`` (``auto``: the activations' dtype); ``None`` for a float type
    other than the activations' (a float cache stores what the model computes)."""
    if engine == "llama.cpp":
        return cache_kind(kv)
    activations = cache_dtype(dtype)
    kind = resolve_kv_dtype(kv, activations)
    return kind if kind.quantized or storage_dtype(kind) == activations else None


def kv_bytes_per_token(
    num_layers: int, kv_heads: int, head_dim: int, dtype: str, kv: str = "auto", engine: str = "gqa"
) -> int:
    """K and V of every layer for one token as ``engine``'s cache stores them (``kv_kind``): ``2 * layers * H_kv *
    D * itemsize``, or the blocks' bytes."""
    return kind_bytes_per_token(num_layers, kv_heads, head_dim, kv_kind(engine, dtype, kv))


def kv_runs(engine: str, dtype: str, kvs: list[str], skipped: dict) -> Iterator[tuple[str, KVDtype]]:
    """The ``--kv-cache-dtypes`` entries of ``kvs`` that ``engine`` runs at bench ``dtype`` and what each stores, one
    run per storage (``auto`` and the activations' own float type are one cache); the others noted in ``skipped``."""
    seen = set()
    for kv in kvs:
        if why := kv_skip(engine, dtype, kv):
            _note(skipped, f"{engine} {dtype} with a {kv} KV cache: {why}")
        elif (kind := kv_kind(engine, dtype, kv)) not in seen:
            seen.add(kind)
            yield kv, kind


def kv_skip(engine: str, dtype: str, kv: str) -> str | None:
    """Why ``engine`` at bench ``dtype`` does not run with a ``kv`` cache, or ``None`` when it does."""
    kind = kv_kind(engine, dtype, kv)
    if kind is None:
        return f"a float KV cache stores the activations' dtype, {str(cache_dtype(dtype)).removeprefix('torch.')}"
    if kind.fp8:
        return "an fp8 KV cache is read by the CUDA kernels only"
    if kind.quantized and engine == "hf":
        return "transformers' caches are float here (its QuantizedCache needs quanto/HQQ, other formats)"
    if kind.quantized and engine == "gqa-compile":
        return "the compiled step takes a float KV cache"
    return None


def check_kv_dtypes(parser: argparse.ArgumentParser, kvs: list[str], cfg: ModelConfig) -> None:
    """Exit 2 naming ``--kv-cache-dtypes`` where a block type cannot tile the model's head dimension."""
    for kv in kvs:
        if kv in KV_DTYPES:
            try:
                check_head_dim(KV_DTYPES[kv], cfg.head_dim)
            except ValueError as e:
                parser.error(f"--kv-cache-dtypes {kv}: {e}")


def _note(skipped: dict, text: str) -> None:
    """Say once, on stderr and (``skipped``'s keys) in the report, that a combination was not run."""
    if text not in skipped:
        skipped[text] = None
        print(f"[bench model] skipping {text}", file=sys.stderr, flush=True)
