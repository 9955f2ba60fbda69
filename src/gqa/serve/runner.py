"""The model side of a serving step: the KV pool, and one native call that runs a scheduled batch's rows through
every layer (``gqa::decode_paged``: each row reading its own blocks, any batch size, ragged lengths).

A prompt's rows attend to the rows before them in the same call (their K/V are written first); only the rows whose
next token is wanted get logits. A row's result does not depend on the other rows of the call (the kernel splits
each context at fixed positions and streams every row through the same kernels), so a token's K/V and a greedy
response do not depend on what else is being served, on how a prompt was cut into chunks, or on which of its blocks
came from the prefix cache.
"""

from __future__ import annotations

import itertools
import os

import torch

from .. import kernels
from ..cache.kv import kv_kinds
from ..cache.kv_dtypes import KVDtype
from ..cache.quantize import native_reads
from ..decoding import native_step
from ..kernels import ops
from .config import EngineConfig
from .paged_cache import PagedKVCache, blocks_in_budget, table_tensor, token_bytes
from .pool_size import CPU_MEMORY_SHARE, PoolSize, default_pool_size
from .request import EngineError, Request

__all__ = [
    "ModelRunner",
    "available_memory",
    "batch_rows",
    "default_kv_cache_mib",
    "full_context_bytes",
    "pool_kinds",
    "pool_size",
]


class ModelRunner:
    """A ``CausalLM`` on CPU (float32 or bfloat16, float or block-quantized weights, read as they are) and its paged
    KV pool, sized by ``config``."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        self.check_model(model)
        self.model, cfg = model, model.config
        kinds = pool_kinds(model, config)
        self.pool_size = pool_size(model, config, available_memory(), CPU_MEMORY_SHARE)
        mib = self.pool_size.nbytes / 2**20
        num_blocks = blocks_in_budget(mib, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size, kinds)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_mib={mib} holds no block of {config.block_size} tokens")
        self.cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, config.block_size,
                                  model.dtype, kv_dtype=kinds)  # fmt: skip
        self.window = serving_window(model)
        # what the native call reads of the model, gathered once: the engine owns the model while it serves (a tensor
        # changed in place is seen; checking every module for a replacement cost ~0.45 ms a step, 5% of a one-stream
        # step)
        self.weights = native_step.decode_weights(model, model.dtype)

    @staticmethod
    def check_model(model: torch.nn.Module) -> None:
        """Raise ``EngineError`` unless the engine takes ``model``: float32 or bfloat16 on CPU with the native kernels
        built, layers the one-call native step takes (Llama's; Qwen3's q/k norms, Mistral's window, SmolLM3's NoPE
        layers and Gemma's too), full half-rotation RoPE."""
        if model.device.type != "cpu" or model.dtype not in native_step.DTYPES or not kernels.vectorized():
            raise EngineError("the engine runs float32 or bfloat16 models on CPU with the native kernels built")
        if not native_step.whole_model(model):
            raise EngineError(
                f"the engine runs the layers the native step takes in one call (Llama's, Qwen3's, Mistral's, "
                f"SmolLM3's, Gemma 2/3's: see decoding.native_step; no sinks); this {model.config.arch} model's are not"
            )
        rope = model.model.rope
        if rope.interleaved or rope.rotary_dim != rope.head_dim:
            raise EngineError("the engine needs full half-rotation RoPE")

    @torch.inference_mode()
    def forward(self, work: list[tuple[Request, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One ``gqa::decode_paged`` call over every request's rows ``[start, end)`` (their K/V into the pool):
        the logits ``(N, vocab)`` and greedy tokens ``(N,)`` of the requests fed up to their last token, in order."""
        model, backbone = self.model, self.model.model
        ids, positions, tables, wanted = batch_rows(work)
        B = len(ids)
        positions = torch.tensor(positions, dtype=torch.long)
        (cos, sin), local_rope = native_step.rope_rows(model, positions.view(B, 1))  # (B, D) each
        x = backbone.embed(torch.tensor(ids, dtype=torch.long).view(B, 1)).view(B, -1)
        greedy = torch.empty(len(wanted), dtype=torch.long)
        logits = ops.decode_paged(x, self.weights, cos, sin, self.cache.key, self.cache.value, table_tensor(tables),
                                  positions, greedy, torch.tensor(wanted, dtype=torch.long),
                                  local_rope=local_rope, kv_formats=self.cache.kv_formats)  # fmt: skip
        return native_step.final_softcap(model, logits, greedy), greedy


def batch_rows(work: list[tuple[Request, int, int]]) -> tuple[list[int], list[int], list[list[int]], list[int]]:
    """A step's rows, one per token: ``(ids, positions, block tables, wanted)`` for every request's tokens ``[start,
    end)`` (past its tokens: its draft's); ``wanted``: the rows whose next token is asked for — a request fed up to its
    last token, and each of its draft tokens — in order."""
    ids, positions, tables, wanted = [], [], [], []
    for r, start, end in work:
        ids += (r.tokens + r.draft if end > len(r.tokens) else r.tokens)[start:end]
        positions += range(start, end)
        tables += [r.table.blocks] * (end - start)
        if end >= len(r.tokens):
            wanted += range(len(ids) - 1 - (end - len(r.tokens)), len(ids))
    return ids, positions, tables, wanted


def pool_kinds(model: torch.nn.Module, config: EngineConfig, native: bool | None = None) -> tuple[KVDtype, KVDtype]:
    """What the pool stores K and V as: ``config.kv_cache_dtype``, else the model's ``kv_dtype`` (``ValueError``
    naming ``kv_cache_dtype`` for a choice the model cannot take). ``native``: the CPU kernels read the pool (default:
    a model on CPU), which read q8_0 / q4_0 blocks but not fp8."""
    choice = config.kv_cache_dtype if config.kv_cache_dtype is not None else getattr(model, "kv_dtype", None)
    kinds = kv_kinds(choice, model.dtype, "kv_cache_dtype", model.device)
    for kind in kinds:
        if kind.quantized:
            kind.row_bytes(model.config.head_dim)  # ValueError: a head size the blocks do not tile
    native = model.device.type == "cpu" if native is None else native
    if native and not native_reads(kinds):
        raise ValueError("kv_cache_dtype fp8_e4m3 is read by the CUDA kernels only (vLLM's fp8 cache); the CPU engine "
                         "reads q8_0 or q4_0")  # fmt: skip
    return kinds


def full_context_bytes(model: torch.nn.Module, config: EngineConfig | None = None) -> int:
    """K and V of one sequence as long as the model's context, as the pool stores them: what a pool must hold for
    any request."""
    cfg = model.config
    kinds = pool_kinds(model, config or EngineConfig())
    return token_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kinds) * cfg.max_position_embeddings


def pool_size(
    model: torch.nn.Module, config: EngineConfig, memory: int, share: float, by_weights: bool = True
) -> PoolSize:
    """The KV pool ``config`` asks for (``kv_cache_mib``), or the default for ``model`` (``default_pool_size``:
    ``config.max_running`` full contexts, at most the weights' bytes or one full context where ``by_weights``, at
    most ``share`` of ``memory``)."""
    if config.kv_cache_mib is not None:
        return PoolSize(int(config.kv_cache_mib * 2**20), f"--kv-cache-mib {config.kv_cache_mib:g}")
    context = model.config.max_position_embeddings
    weights = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers())) if by_weights else None
    per_token = full_context_bytes(model, config) // context
    return default_pool_size(per_token, context, config.max_running, weights, memory, share)


def available_memory() -> int:
    """Bytes of memory available now (4 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


def default_kv_cache_mib(model: torch.nn.Module, max_running: int) -> float:
    """The default KV pool's size in MiB for ``model`` on CPU (``pool_size``)."""
    return pool_size(model, EngineConfig(max_running=max_running), available_memory(), CPU_MEMORY_SHARE).nbytes / 2**20


def serving_window(model: torch.nn.Module) -> int | None:
    """When every layer slides: the most keys a query reads to its left (older blocks can go back to the pool);
    else None."""
    lefts = [layer.self_attn.window for layer in model.model.layers]
    return None if None in lefts else max(w[0] for w in lefts)
