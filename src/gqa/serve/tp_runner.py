"""Tensor-parallel serving: the engine's step over ``tp`` ranks, each holding its KV groups' shard of the weights
and of the paged KV pool (``gqa.parallel.tensor_parallel``).

Rank 0 owns the engine — scheduler, block manager, sampling, the HTTP front — and runs ``ShardedRunner``: each step
it broadcasts the step's plan (one int64 tensor: the rows' token ids and positions, their block tables, the rows
that want logits) to every rank, then runs its own shard of the step. The other ranks run ``serve_shard``: receive a
plan, run their shard, until rank 0 says stop. Every rank writes its KV heads' K/V to its pool at the blocks rank 0
chose, so prefix caching, preemption, speculation and structured output — all decided on rank 0 — work as in one
process. Per layer the projections and attention run as native calls on the rank's heads, and the two all-reduces
of ``o_proj`` and ``down_proj`` complete the layer; the embedding lookup takes one all-reduce more (each rank holds a
slice of the vocabulary, ``parallel.vocab_parallel``) and each rank's slice of the logits is gathered on rank 0.

The step is the one native call of one process (``gqa::decode_paged``) over the rank's shards: given the process
group's name, the call sums each layer's ``o_proj`` and ``down_proj`` partial products with the group's all-reduce
(torch.distributed's gloo, called from inside the call) before they join the residual. Shards it cannot take (a
weight a rank holds in float32 because its columns cut through blocks) run op by op: ~8 native calls a layer
(``linear_rows_n``, ``paged_attention`` ...), the same sums.

A step that fails on any rank — a rank that died, hung past ``GQA_DIST_TIMEOUT``, or raised — leaves the ranks out
of step for good: rank 0 raises ``RanksLost`` (a ``SystemExit``: it passes the engine's per-request recovery and
ends the engine thread, whose waiting requests then get ``EngineStopped``, 503), and the server exits.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import kernels
from ..decoding import native_step
from ..kernels import ops
from ..models.linear import Linear, linears, uses_kernel
from ..models.quantized import QuantizedLinear
from ..parallel.tensor_parallel import ReducingLinear
from ..parallel.vocab_parallel import gather_logits
from .config import EngineConfig
from .paged_cache import PagedKVCache
from .request import EngineError, Request
from .runner import batch_rows, pool_kinds
from .tp_start import agree_on_start

__all__ = ["RanksLost", "ShardStep", "ShardedRunner", "serve_shard"]

STOP, STEP = 0, 1
PLAN_WAIT = timedelta(days=365)  # a rank waits this long for the next plan: a server may stay idle for days


class RanksLost(SystemExit):
    """The ranks can no longer run a step together (one died, hung or failed): this process must end."""


class ShardStep:
    """One rank's part of a serving step: its shard of ``model`` (``shard_model``'s) and its KV heads' paged pool.

    Constructing it is a collective (every rank at once): the ranks compare their models and settings
    (``tp_start.agree_on_start``: ``ValueError`` naming a difference) and agree on the pool's block count.
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        check_sharded_model(model)
        self.model, cfg = model, model.config
        self.kinds = pool_kinds(model, config)
        self.pool_size, num_blocks = agree_on_start(model, config, self.kinds)
        self.cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, config.block_size,
                                  model.dtype, kv_dtype=self.kinds)  # fmt: skip
        # the plans' broadcasts wait as long as an idle server; the layers' all-reduces time out (GQA_DIST_TIMEOUT)
        self.plans = dist.new_group(backend=dist.get_backend(), timeout=PLAN_WAIT)
        self.reduce_seconds, self.step_seconds, self.steps = 0.0, 0.0, 0
        # the whole step in one native call where it takes the shards (the layers' all-reduces inside it), else op by op
        self.weights = native_step.decode_weights(model, model.dtype)
        self.group = native_step.reduce_group(model)

    @torch.inference_mode()
    def run(self, plan: torch.Tensor, logits: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Run ``plan`` (``encode_plan``'s) over this rank's shard, its K/V into the pool; with ``logits`` the logits
        ``(N, vocab)`` and greedy tokens ``(N,)`` of the rows that want them (rank 0), else ``None``."""
        start = time.perf_counter()
        ids, positions, table, wanted = decode_plan(plan)
        model, backbone, cache = self.model, self.model.model, self.cache
        B, D = ids.shape[0], model.config.head_dim
        (cos, sin), _ = native_step.rope_rows(model, positions.view(B, 1))  # (B, D) float32
        x = self._reduce(backbone.embed_tokens.partial(ids))  # (B, E): each rank its vocabulary rows
        if self.weights is not None:  # every layer in one call, its two all-reduces inside; this rank's logit slice
            reduced = ops.reduce_seconds()
            part = ops.decode_paged(x, self.weights, cos, sin, cache.key, cache.value, table, positions, None, wanted,
                                    kv_formats=cache.kv_formats, reduce_group=self.group)  # fmt: skip
            self.reduce_seconds += ops.reduce_seconds() - reduced
            return self._logits(part, wanted, logits, start)
        slots = table.gather(1, (positions // cache.block_size).view(B, 1)).view(B), positions % cache.block_size
        lengths = positions + 1  # a row attends to its slots [0, position]: a prompt chunk's rows see the ones before
        for i, layer in enumerate(backbone.layers):
            attn, mlp, eps = layer.self_attn, layer.mlp, layer.input_layernorm.eps
            h = ops.rms_norm(x, layer.input_layernorm.weight, eps)
            q, k, v = _rows(h, (attn.q_proj, attn.k_proj, attn.v_proj))  # (B, H_q * D), (B, H_kv * D) x2
            q, k, v = q.view(B, -1, D), k.view(B, -1, D), v.view(B, k.shape[1] // D, -1)
            if attn.q_norm is not None:  # Qwen3: each head's q and k normalised before RoPE
                q = ops.rms_norm(q.reshape(-1, D), attn.q_norm.weight, attn.q_norm.eps).view(B, -1, D)
                k = ops.rms_norm(k.reshape(-1, D), attn.k_norm.weight, attn.k_norm.eps).view(B, -1, D)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            cache.write_slots(i, *slots, k, v)  # every row's K/V before any row reads
            a = self._attend(i, q, table, lengths, attn.scale or D**-0.5)  # (B, H_q * D_v)
            x = x + self._reduce(_rows(a, (attn.o_proj,))[0])
            h = ops.rms_norm(x, layer.post_attention_layernorm.weight, eps)
            gate, up = _rows(h, (mlp.gate_proj, mlp.up_proj))  # (B, F) each
            x = x + self._reduce(_rows(ops.silu_mul(gate, up), (mlp.down_proj,))[0])
        part = x.new_empty(0, len(model.lm_head.rows))
        if len(wanted):  # this rank's slice of the vocabulary's logits
            x = ops.rms_norm(x[wanted], backbone.norm.weight, backbone.norm.eps)  # (N, E)
            part = _rows(x, (model.lm_head.part,))[0]
        return self._logits(part, wanted, logits, start)

    def _logits(
        self, part: torch.Tensor, wanted: torch.Tensor, logits: bool, start: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's end: every rank's logit slice ``part (N, V_r)`` gathered on rank 0 — with ``logits`` the whole
        logits ``(N, vocab)`` and greedy tokens ``(N,)``, else ``None`` — and its time counted."""
        vocab = self.model.lm_head.vocab_size
        out = None
        if len(wanted):
            scores = gather_logits(part, vocab)  # (N, vocab) on rank 0, else None
            out = None if scores is None else (scores, scores.float().argmax(-1))
        elif logits:
            out = part.new_empty(0, vocab), torch.empty(0, dtype=torch.long)
        self.steps += 1
        self.step_seconds += time.perf_counter() - start
        return out

    def _attend(self, layer: int, q: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor, scale: float):
        """``q (B, H_q, D)`` against each row's first ``lengths[b]`` slots of the pool -> ``(B, H_q * D_v)``."""
        B = q.shape[0]
        key, value = self.cache.key[layer], self.cache.value[layer]
        if not self.cache.kv_formats:
            return ops.paged_attention(q, key, value, table, lengths, scale).view(B, -1)
        # quantized blocks: the rows' slots gathered (B, H_kv, S, row bytes) and read where they lie
        size = self.cache.block_size
        width = -(-int(lengths.max()) // size)
        k, v = (pool[table[:, :width]].transpose(1, 2).flatten(2, 3) for pool in (key, value))
        H_kv = k.shape[1]
        visible = torch.arange(width * size) < lengths.view(B, 1)  # (B, S)
        mask = visible.view(B, 1, 1, 1, -1).expand(B, H_kv, q.shape[1] // H_kv, 1, -1)
        k_format, v_format = self.cache.kv_formats
        out = ops.decode_attention(q.reshape(B, H_kv, -1, q.shape[2]), k, v, mask, scale, 1, False,
                                   k_format=k_format, v_format=v_format)  # fmt: skip
        return out.reshape(B, -1)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of this rank's partial product (in place); the time it took, counted."""
        start = time.perf_counter()
        dist.all_reduce(partial)
        self.reduce_seconds += time.perf_counter() - start
        return partial

    def broadcast(self, plan: torch.Tensor | None) -> torch.Tensor | None:
        """Rank 0 sends ``plan`` (``None``: stop), the others receive it (``None`` when told to stop)."""
        header = torch.tensor([STOP if plan is None else STEP, 0 if plan is None else plan.numel()])
        dist.broadcast(header, 0, group=self.plans)
        if header[0] == STOP:
            return None
        if plan is None:
            plan = torch.empty(int(header[1]), dtype=torch.long)
        dist.broadcast(plan, 0, group=self.plans)
        return plan

    def summary(self) -> str:
        """The steps run and the all-reduces' share of their time (waiting for the slowest rank included)."""
        share = self.reduce_seconds / self.step_seconds if self.step_seconds else 0.0
        return f"{self.steps} steps, all-reduces {100 * share:.0f}% of the step time"


def _rows(x: torch.Tensor, layers: tuple[torch.nn.Module, ...]) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]`` for ``x (N, in)``, by the native kernel for any ``N`` where it takes the
    layers (float weights in x's dtype, as the sharded loader makes them): each row's product then does not depend on
    how many rows the call has — ``Linear`` hands more than a few rows to MKL's GEMM, whose sums do — so an answer
    does not depend on what else is served; block-quantized layers through the quantized kernel. Bias-free partial
    products (``o_proj``, ``down_proj``) included: their all-reduce is the caller's."""
    if all(type(m) in (Linear, ReducingLinear) and uses_kernel(x[:1], m.weight, m.bias) for m in layers):
        return ops.linear_rows_n(x.contiguous(), [m.weight for m in layers], [m.bias for m in layers])
    if len(layers) > 1:
        return linears(x, layers)
    return [(QuantizedLinear.forward if isinstance(layers[0], QuantizedLinear) else Linear.forward)(layers[0], x)]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's half-rotation RoPE of ``x (B, H, D)`` with ``cos``, ``sin (B, D)`` float32, rounded to x's dtype once (as
    the native kernels round)."""
    xf = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), -1)
    return (xf * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)


def encode_plan(ids: list[int], positions: list[int], tables: list[list[int]], wanted: list[int]) -> torch.Tensor:
    """A step's rows (``runner.batch_rows``) as one int64 tensor: ``[B, W, N, ids (B), positions (B), table (B, W),
    wanted (N)]``, tables padded with block 0 to the longest's width ``W``."""
    B, W, N = len(ids), max(1, max(len(t) for t in tables)), len(wanted)
    plan = torch.zeros(3 + 2 * B + B * W + N, dtype=torch.long)
    plan[:3] = torch.tensor([B, W, N])
    plan[3 : 3 + B] = torch.tensor(ids)
    plan[3 + B : 3 + 2 * B] = torch.tensor(positions)
    table = plan[3 + 2 * B : 3 + 2 * B + B * W].view(B, W)
    for row, t in enumerate(tables):
        table[row, : len(t)] = torch.tensor(t)
    plan[3 + 2 * B + B * W :] = torch.tensor(wanted, dtype=torch.long)
    return plan


def decode_plan(plan: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``encode_plan``'s tensor as ``(ids (B,), positions (B,), table (B, W), wanted (N,))`` (views of it)."""
    B, W, N = plan[:3].tolist()
    body = plan[3:]
    return body[:B], body[B : 2 * B], body[2 * B : 2 * B + B * W].view(B, W), body[2 * B + B * W :][:N]


class ShardedRunner:
    """The engine's runner on rank 0 of a tensor-parallel world (``Engine(..., runner=ShardedRunner)``): the
    ``ModelRunner`` surface — ``forward(work)``, ``cache``, ``window``, ``pool_size`` — over ``ShardStep``."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        self.shard = ShardStep(model, config)
        self.model, self.cache, self.pool_size = model, self.shard.cache, self.shard.pool_size
        self.window = None  # check_sharded_model: no sliding windows
        self.threads = torch.get_num_threads()  # the engine thread's steps run with the rank's share of the cores
        self.lost: str | None = None

    @staticmethod
    def check_model(model: torch.nn.Module) -> None:
        check_sharded_model(model)

    def forward(self, work: list[tuple[Request, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step over every rank: the plan broadcast, this rank's shard run; the logits ``(N, vocab)`` and greedy
        tokens ``(N,)`` of the requests fed up to their last token (``ModelRunner.forward``). ``RanksLost`` when the
        ranks cannot run it together (any failure: the others are out of step)."""
        if self.lost is not None:
            raise RanksLost(self.lost)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)  # OpenMP's count is per thread: the engine thread's own
        try:
            plan = self.shard.broadcast(encode_plan(*batch_rows(work)))
            return self.shard.run(plan, logits=True)
        except Exception as e:
            self.lost = f"a tensor-parallel step failed, the ranks are out of step: {type(e).__name__}: {e}"
            print(f"gqa serve: {self.lost}", file=sys.stderr)
            raise RanksLost(self.lost) from e

    def close(self) -> None:
        """Tell the other ranks to stop (when they can still hear it)."""
        if self.lost is None:
            self.shard.broadcast(None)
            self.lost = "stopped"


def serve_shard(model: torch.nn.Module, config: EngineConfig) -> None:
    """A rank > 0 of a tensor-parallel server: its ``ShardStep`` (the start's collectives, as rank 0's
    ``ShardedRunner``), then every plan rank 0 sends, until it says stop. Raises where a step fails."""
    shard = ShardStep(model, config)
    while (plan := shard.broadcast(None)) is not None:
        shard.run(plan, logits=False)


def check_sharded_model(model: torch.nn.Module) -> None:
    """Raise ``EngineError`` unless a sharded step runs ``model``: Llama's layers (Qwen3's q/k norms too) with full
    half-rotation RoPE, no sliding windows, sinks, soft-caps or output biases, float32 or bfloat16 on CPU, the native
    kernels built."""
    if model.device.type != "cpu" or model.dtype not in native_step.DTYPES or not kernels.vectorized():
        raise EngineError(
            "tensor-parallel serving runs float32 or bfloat16 models on CPU with the native kernels built"
        )
    attns = [layer.self_attn for layer in model.model.layers]
    plain = model.runs_llama_layers() and not model.config.gemma
    if not plain or any(a.window is not None or a.sinks is not None or a.softcap is not None for a in attns):
        raise EngineError(
            f"tensor-parallel serving runs Llama's layers (Qwen3's too) without sliding windows, sinks or soft-caps; "
            f"this {model.config.arch} model's are not"
        )
    rope = model.model.rope
    if rope.interleaved or rope.rotary_dim != rope.head_dim:
        raise EngineError("tensor-parallel serving needs full half-rotation RoPE")
    if any(layer.mlp.down_proj.bias is not None or layer.self_attn.o_proj.bias is not None
           for layer in model.model.layers):  # fmt: skip
        raise EngineError("tensor-parallel serving takes no o_proj / down_proj biases")
