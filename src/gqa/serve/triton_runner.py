"""The model side of a serving step on a GPU: the paged KV pool in device memory, and the scheduled batch's rows run
through every layer with the Triton paged-attention kernel (``kernels.triton.paged``).

The same contract as the CPU runner (``runner.ModelRunner``): one row per token — decode rows and prompt-chunk rows
mixed, each with its own block table and position —, every row's K/V written to the pool before its layer's
attention, logits and greedy tokens only for the rows whose next token is wanted. The projections are the fused
ones of ``decoding.fused_step`` (one GEMM for q/k/v, one for gate/up). Attention of a row depends on that row alone
(fixed splits); the GEMMs are cuBLAS's, whose rounding can depend on how many rows a call has, so batch invariance
on a GPU is measured (``benchmarks/gpu_check.py``), not assumed. A step of decode rows alone replays a CUDA graph
captured at start-up (``step_graphs``; ``EngineConfig.cuda_graphs``), other steps run eagerly. A quantized pool
(``kv_cache_dtype`` ``q8_0`` / ``q4_0``, K and V each) stores each new row's blocks once, as it is written, and the
kernel reads them where they lie. Runs on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import torch

from ..attention.rope import RoPE
from ..decoding.fused_step import LayerWeights, fused_applies, fused_layers, logits_of, step_ropes, step_weights
from ..kernels.triton.paged import paged_attention
from ..kernels.triton.split_kv import DTYPES, interpreted, triton_available
from .config import EngineConfig
from .paged_cache import PagedKVCache, blocks_in_budget, table_tensor
from .pool_size import DEVICE_MEMORY_SHARE, PoolSize
from .request import EngineError, Request
from .runner import batch_rows, pool_kinds, pool_size, serving_window
from .step_graphs import MAX_GRAPH_LENGTH, DecodeGraphs, graph_buckets, length_tiers

__all__ = ["TritonModelRunner", "default_device_kv_cache_mib"]


class TritonModelRunner:
    """A ``CausalLM`` of any family gqa loads on a GPU (float32, float16 or bfloat16, plain float linears) and its
    paged KV pool on the same device, sized by ``config`` and stored as its ``kv_cache_dtype`` says (``pool_kinds``:
    the model's dtype, or q8_0 / q4_0 blocks). A sliding-window layer's attention reads only its window's blocks;
    when every layer slides, blocks behind every window go back to the pool (``serving_window``). ``graphs``: whether
    decode steps replay captured graphs (default: ``config.cuda_graphs`` on CUDA; ``True`` on CPU records the steps
    instead, for tests)."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, *, graphs: bool | None = None) -> None:
        self.check_model(model)
        self.model, cfg = model, model.config
        kinds = pool_kinds(model, config, native=False)
        self.pool_size = device_pool_size(model, config)
        mib = self.pool_size.nbytes / 2**20
        num_blocks = blocks_in_budget(mib, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size, kinds)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_mib={mib} holds no block of {config.block_size} tokens")
        if graphs is None:
            graphs = config.cuda_graphs and model.device.type == "cuda"
        self.cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, config.block_size,
                                  model.dtype, device=model.device, kv_dtype=kinds,
                                  spare_blocks=1 if graphs else 0)  # fmt: skip
        self.window = serving_window(model)
        self.graphs: DecodeGraphs | None = None
        self.graph_seconds = 0.0
        if graphs:
            self._capture(config)

    @staticmethod
    def check_model(model: torch.nn.Module) -> None:
        """Raise ``EngineError`` unless this runner takes ``model``: on CUDA (or CPU under Triton's interpreter),
        triton installed, a float dtype the kernel takes, plain float linears (``fused_step.fused_applies``)."""
        device = model.device.type
        if not triton_available() or not (device == "cuda" or (device == "cpu" and interpreted())):
            raise EngineError("the GPU engine runs models on CUDA with triton installed")
        if model.dtype not in DTYPES:
            raise EngineError(f"the GPU engine runs float32, float16 or bfloat16 models, got {model.dtype}")
        reason = fused_applies(model)
        if reason is not None:
            raise EngineError(f"the GPU engine cannot run this model: {reason}")

    @torch.inference_mode()
    def forward(self, work: list[tuple[Request, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's rows ``[start, end)`` (their K/V into the pool) through the model: the logits
        ``(n, vocab)`` (float32, on the device) and greedy tokens ``(n,)`` (on the CPU) of the ``n`` requests fed up
        to their last token, in order. A batch of decode rows alone replays a captured graph where one takes it."""
        ids, positions, tables, wanted = batch_rows(work)
        N, device = len(ids), self.model.device
        graphs = self.graphs
        if graphs is not None and wanted == list(range(N)) and graphs.takes(N, max(positions) + 1):
            return graphs.run(ids, positions, tables)
        # the engine's thread may have another device current: Triton launches on the current one
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            host = torch.tensor([ids, positions], dtype=torch.long)
            ids_t, pos = host.to(device, non_blocking=True)  # (N,) each
            table = table_tensor(tables).to(device, non_blocking=True)  # (N, max_blocks)
            self._grow_ropes(max(positions) + 1)
            picked = torch.tensor(wanted, dtype=torch.long, device=device)
            logits = self._step(ids_t, pos, table, max(positions) + 1, picked)  # (n, vocab)
            return logits, logits.argmax(-1).cpu()

    def _step(
        self, ids: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, max_length: int, picked: torch.Tensor | None
    ) -> torch.Tensor:
        """The logits ``(n, vocab)`` (float32) of rows ``picked`` (``None``: all) of the ``N`` rows ``ids``, ``pos``
        ``(N,)`` with block tables ``table (N, width)`` (on the device; ``max_length`` bounds every row's ``pos +
        1``), every row's K/V written to the pool first. No host synchronisation, no shape that depends on the
        values: a CUDA graph can hold it. The RoPE tables must already reach ``max_length`` (``_grow_ropes``)."""
        model, cache = self.model, self.cache
        N, block_size = ids.shape[0], cache.block_size
        rows = torch.arange(N, device=ids.device)
        blocks, slots = table[rows, pos // block_size], pos % block_size  # where each row's new K/V go
        lengths = pos + 1
        context = max(model.config.max_position_embeddings, max_length)
        k_format, v_format = (kind.code for kind in cache.kinds)

        def attend(i: int, lw: LayerWeights, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write_slots(i, blocks, slots, k[:, :, 0], v[:, :, 0])  # (N, H_kv, D) each
            out = paged_attention(q[:, :, 0], cache.key[i], cache.value[i], table, lengths, max_length=max_length,
                                  max_context=context, scale=lw.scale, window=lw.window, softcap=lw.softcap,
                                  sinks=lw.sinks, k_format=k_format, v_format=v_format)  # fmt: skip
            return out[:, :, None]  # (N, H_q, 1, D)

        def rotation(rope: RoPE) -> tuple[torch.Tensor, torch.Tensor]:
            return rope.cos_cached[pos].unsqueeze(1), rope.sin_cached[pos].unsqueeze(1)  # (N, 1, rotary_dim) each

        x = fused_layers(model, step_weights(model), model.model.embed(ids.view(N, 1)), rotation, attend)  # (N, 1, E)
        return logits_of(model, x[:, 0] if picked is None else x[picked, 0]).float()  # (n, vocab)

    def _grow_ropes(self, length: int) -> None:
        """Every RoPE table the layers use holds positions ``[0, length)``."""
        for rope in step_ropes(self.model):
            if rope.cos_cached.shape[0] < length:
                rope.cos_sin(torch.tensor([length - 1], device=self.model.device))

    @property
    def graph_length(self) -> int:
        """The longest sequence a graphed step takes: the model's context, at most the pool's tokens and
        ``step_graphs.MAX_GRAPH_LENGTH``."""
        cache = self.cache
        return min(self.model.config.max_position_embeddings, cache.num_blocks * cache.block_size, MAX_GRAPH_LENGTH)

    @torch.inference_mode()
    def _capture(self, config: EngineConfig) -> None:
        """The decode graphs (``step_graphs``), one per bucket up to ``config.max_running`` rows and length tier up
        to ``graph_length``; RoPE's tables grown to it first. On CPU (Triton's interpreter) recorded steps stand in
        for the graphs."""
        longest, block_size = self.graph_length, self.cache.block_size
        self._grow_ropes(longest)

        def step(ids: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, length: int):
            logits = self._step(ids, pos, table, length, None)
            return logits, logits.argmax(-1)

        # what the graphs read by address, kept alive for their life: RoPE's tables (a longer sequence elsewhere
        # grows a table into a new tensor; these keep the same values for every position they hold) and the fused
        # weights (rebuilt as new tensors if the model's weights change: the graphs keep the weights they captured)
        self._captured = (step_weights(self.model), [(r.cos_cached, r.sin_cached) for r in step_ropes(self.model)])
        began = time.perf_counter()
        self.graphs = DecodeGraphs(step, buckets=graph_buckets(config.max_running), lengths=length_tiers(longest),
                                   width=-(-longest // block_size), pad_block=self.cache.num_blocks,
                                   device=self.model.device, recorded=self.model.device.type != "cuda")  # fmt: skip
        self.graph_seconds = time.perf_counter() - began


def default_device_kv_cache_mib(model: torch.nn.Module, config: EngineConfig) -> float:
    """The default KV pool's size in MiB for ``model`` on its device (``runner.pool_size``: at most half the device
    memory free now)."""
    return device_pool_size(model, replace(config, kv_cache_mib=None)).nbytes / 2**20


def device_pool_size(model: torch.nn.Module, config: EngineConfig) -> PoolSize:
    """``runner.pool_size`` with the device memory free now (2 GiB under Triton's CPU interpreter), not bounded by
    the weights: the device's memory serves nothing else."""
    free = torch.cuda.mem_get_info(model.device)[0] if model.device.type == "cuda" else 2 * 2**30
    return pool_size(model, config, free, DEVICE_MEMORY_SHARE, by_weights=False)
