"""``gqa info``: a model's architecture and its KV-cache size as MHA, as it is, and as MQA.

Read from the model's metadata alone (config and tensor shapes), without importing torch (~2 s), so it answers at
once; ``--tp`` imports it for the per-rank table.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from ..cache.kv_dtypes import KV_DTYPES, kv_bytes_per_token
from ..cache.sizes import ITEMSIZE, WINDOW_SPARE, kv_cache_elements, layer_cache_tokens
from ..options.common import add_model_arguments, loading, model_label
from ..options.dtypes import NAMES

if TYPE_CHECKING:
    import torch

    from ..models.config import ModelConfig


def kv_cache_table(num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | str) -> str:
    """Markdown table: KV-cache bytes per token and for 4096 tokens as MHA, this model's head count, and MQA.
    ``dtype``: a torch dtype, or torch's name for it (``"bfloat16"``)."""
    rows = [("MHA", num_heads), (f"this model (GQA, {num_kv_heads} KV heads)", num_kv_heads), ("MQA", 1)]
    seen, lines = set(), []
    name = str(dtype).removeprefix("torch.")
    itemsize = ITEMSIZE[dtype] if isinstance(dtype, str) else dtype.itemsize
    lines.append(f"| variant | KV heads | KV cache per token ({name}) | for 4096 tokens |")
    lines.append("|---|---:|---:|---:|")
    for label, heads in rows:
        if heads in seen:
            continue
        seen.add(heads)
        per_token = kv_cache_elements(num_layers, heads, head_dim, 1) * itemsize  # kv_cache_bytes, torch-free
        lines.append(f"| {label} | {heads} | {per_token / 1024:.1f} KiB | {per_token * 4096 / 2**20:.1f} MiB |")
    return "\n".join(lines)


def kv_dtype_table(num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, budget_gib: float = 1.0) -> str:
    """Markdown table: for every KV-cache storage type (``cache.kv_dtypes``), the bytes a token adds and the tokens
    ``budget_gib`` GiB hold, as MHA, this model's GQA and MQA: the two savings, fewer heads and fewer bits, side by
    side. A block type whose blocks do not tile ``head_dim`` says so instead."""
    variants = [("MHA", num_heads), ("GQA", num_kv_heads), ("MQA", 1)]
    variants = [
        (label, heads) for i, (label, heads) in enumerate(variants) if heads not in [h for _, h in variants[:i]]
    ]
    header = " | ".join(f"{label} ({heads} KV) per token | tokens in {budget_gib:g} GiB" for label, heads in variants)
    lines = [f"| KV dtype | bits | {header} |", "|---|---:|" + "---:|---:|" * len(variants)]
    for kv in KV_DTYPES.values():
        if head_dim % kv.block:
            lines.append(f"| {kv.name} | {kv.bits_per_value:g} | needs a head dim that is a multiple of {kv.block} |")
            continue
        cells = []
        for _, heads in variants:
            per_token = kv_bytes_per_token(num_layers, heads, head_dim, kv)
            tokens = int(budget_gib * 2**30 // per_token) if per_token else 0
            cells.append(f"{per_token / 1024:.2f} KiB | {tokens:,}")
        lines.append(f"| {kv.name} | {kv.bits_per_value:g} | {' | '.join(cells)} |")
    return "\n".join(lines)


HELP = "a model's architecture and KV-cache size vs MHA and MQA"
DESCRIPTION = HELP


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gqa info`` on ``parser``."""
    add_model_arguments(parser, dtype_help="dtype of the KV cache (and weights, with --tp) in the tables")
    parser.add_argument("--tp", type=int, default=None, metavar="N", help="also show each of N tensor-parallel ranks' "
                        "heads, weight bytes and KV-cache bytes per token (default: off)")  # fmt: skip
    parser.add_argument("--kv-budget-gib", type=_positive_gib, default=1.0, metavar="GIB", help="the KV-cache "
                        "budget the storage-type table counts tokens in (default: 1)")  # fmt: skip


def _positive_gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {text!r}")
    return value


def run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from ..loaders.lazy import open_lazy

    if ns.tp is not None and ns.tp < 1:  # before loading; check_tp below checks it against the model's heads
        raise ValueError(f"--tp must be >= 1, got {ns.tp}")
    with loading(model_label(ns.model)):
        lazy = open_lazy(ns.model)  # the config and every tensor's shape, no weight read
    cfg = lazy.config
    if ns.tp is not None:
        from ..parallel.tensor_parallel import check_tp

        check_tp(cfg.num_heads, cfg.num_kv_heads, ns.tp)
    tied = cfg.tie_word_embeddings
    params = sum(math.prod(shape) for k, shape in lazy.shapes.items() if not (tied and k == "lm_head.weight"))
    print(f"architecture     {cfg.arch}")
    print(f"parameters       {params / 1e6:.1f} M")
    print(f"layers           {cfg.num_layers}")
    print(f"hidden size      {cfg.hidden_size}")
    print(f"query heads      {cfg.num_heads}")
    print(f"KV heads         {cfg.num_kv_heads}  (group size {cfg.num_heads // cfg.num_kv_heads})")
    print(f"head dim         {cfg.head_dim}")
    print(f"context          {cfg.max_position_embeddings}")
    print(f"vocab            {cfg.vocab_size}")
    print(f"RoPE theta       {cfg.rope_theta:g}")
    stored = " + ".join(f"{kind} {_size(n)}" for kind, n in lazy.stored_bytes().items())
    print(f"weights          {stored}")
    print(f"native kernels   {native_kernels()}")
    for line in window_lines(cfg, ITEMSIZE[NAMES[ns.dtype]]):
        print(line)
    print()
    print(kv_cache_table(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, NAMES[ns.dtype]))
    print()
    print("KV cache by storage type (--kv-cache-dtype; q8_0/q4_0: llama.cpp's blocks of 32 values with an fp16 scale;")
    print("fp8_e4m3: vLLM's float8 byte a value, CUDA only):")
    print(kv_dtype_table(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ns.kv_budget_gib))
    if ns.tp is not None:
        import torch

        from ..options.dtypes import torch_dtype

        state = {name: torch.empty(shape, device="meta") for name, shape in lazy.shapes.items()}
        print()
        print(tp_table(cfg, state, ns.tp, torch_dtype(ns.dtype), lazy.block_bytes_per_value()))
    return 0


def window_lines(cfg: ModelConfig, itemsize: int) -> list[str]:
    """For a model with sliding-window layers: which layers, and its KV cache over the whole context with
    window-sized caches on those layers (``CausalLM.new_caches``) against full caches on all."""
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    sliding = [w for w in windows if w is not None]
    if not sliding:
        return []
    keys, context = sliding[0][0] + 1, cfg.max_position_embeddings
    per_slot = kv_cache_elements(1, cfg.num_kv_heads, cfg.head_dim, 1) * itemsize  # one layer, one token
    held = sum(layer_cache_tokens(None if w is None else w[0] + 1, context) for w in windows) * per_slot
    full = cfg.num_layers * context * per_slot
    return [
        f"sliding window   {keys} keys on {len(sliding)} of {cfg.num_layers} layers (their caches: {keys} + "
        f"{WINDOW_SPARE} slots)",
        f"KV at context    {held / 2**20:.1f} MiB with window caches vs {full / 2**20:.1f} MiB full "
        f"({held / full:.2f}x) for one {context}-token sequence",
    ]


def native_kernels() -> str:
    """Whether the native kernels are built for this source, torch and CPU, and their SIMD paths, as
    ``gqa.kernels.available()`` and ``simd_width()`` would say, without loading them or importing torch."""
    from ..kernels import probe

    path = probe.built_library()
    if path is None:
        return "not built (python -m gqa.kernels)"
    simd = {16: "AVX-512", 8: "AVX2"}.get(probe.simd_width())
    return f"built: {path}" + (f" ({simd})" if simd else " (no AVX2/AVX-512 here: scalar, so used for bf16 decode "
                                                         "attention only)")  # fmt: skip


def tp_table(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    tp: int,
    dtype: torch.dtype,
    blocks: dict[str, float] | None = None,
) -> str:
    """Markdown table: per rank of ``tp``, its query and KV heads, MLP and vocabulary rows, weight bytes and KV-cache
    bytes per token; with
    ``blocks`` (bytes per value of a GGUF's quantized tensors) also its weights as ``dtype="auto"`` keeps them."""
    from ..cache.kv import kv_cache_bytes
    from ..parallel.tensor_parallel import rank_shard, rank_weight_bytes

    name = str(dtype).removeprefix("torch.")
    kept = " weights kept as blocks (dtype auto) |" if blocks else ""
    lines = [
        f"tensor parallel over {tp} ranks ({name}):",
        f"| rank | query heads | KV heads | MLP rows | vocabulary rows | weights |{kept} KV cache per token |",
        "|---:|---|---|---:|---|---:|" + ("---:|" if blocks else "") + "---:|",
    ]
    for rank in range(tp):
        shard = rank_shard(cfg, tp, rank)
        q, kv = shard.q_heads, shard.kv_heads
        kv_text = f"{len(kv)} ({_span(kv)})"
        if shard.kv_replicas > 1:
            kv_text += f", on {shard.kv_replicas} ranks"
        per_token = kv_cache_bytes(cfg.num_layers, len(kv), cfg.head_dim, 1, dtype=dtype)
        as_blocks = f" {_size(rank_weight_bytes(cfg, state, shard, dtype, blocks))} |" if blocks else ""
        lines.append(
            f"| {rank} | {len(q)} ({_span(q)}) | {kv_text} | {len(shard.mlp_rows)} | {_span(shard.vocab_rows)} | "
            f"{_size(rank_weight_bytes(cfg, state, shard, dtype))} |{as_blocks} {_size(per_token)} |"
        )
    return "\n".join(lines)


def _span(heads: range) -> str:
    return f"{heads.start}-{heads.stop - 1}" if len(heads) > 1 else str(heads.start)


def _size(n: int) -> str:
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"
