"""Tensor parallelism (Megatron-style) for the Llama-family decoder, with a KV group as the unit of sharding.

A KV group is one KV head and the ``G = H_q / H_kv`` query heads that read it. ``tp`` ranks share a model so:

* ``tp <= H_kv``: each rank holds whole groups, contiguous; when ``tp`` does not divide ``H_kv`` the first
  ``H_kv % tp`` ranks hold one group more (SmolLM2, 9 query / 3 KV heads, at tp=2: 6 q + 2 kv heads and 3 q + 1 kv
  heads — the ranks are then unbalanced, and the slowest sets the pace);
* ``tp > H_kv``: ``tp % H_kv == 0`` and ``G % (tp / H_kv) == 0``; each KV head is replicated on ``tp / H_kv`` ranks,
  each of which computes its share of that group's query heads (as vLLM and SGLang do);
* anything else is refused with a ``ValueError`` that names the ``tp`` values that work.

Per layer, ``q/k/v_proj`` (and their biases) keep the rank's heads' rows and ``o_proj`` the matching input columns;
the MLP's ``gate_proj``/``up_proj`` keep a slice of rows and ``down_proj`` the same columns. ``o_proj`` and
``down_proj`` then hold partial sums, which one all-reduce each completes: two all-reduces per layer. The
embeddings and ``lm_head`` keep a slice of the vocabulary's rows (``vocab_parallel``: one all-reduce after the lookup,
one all-gather of the logits, so every rank gets the same logits); norms and RoPE are replicated. Each rank's model
is an ordinary ``CausalLM`` on plain local tensors with a local ``ModelConfig`` (its own head counts): native kernels,
static caches holding only the rank's KV heads, compiled decode steps and batched generation work as in one process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol

from ..models.config import ModelConfig
from ..models.linear import Linear
from ..models.quantized import QuantizedLinear, QuantizedTensor
from .vocab_parallel import EMBEDDING, HEAD, vocab_modules

if TYPE_CHECKING:
    from ..models.llama import CausalLM

__all__ = [
    "RankShard",
    "ReducingLinear",
    "ReducingQuantizedLinear",
    "check_tp",
    "head_layout",
    "rank_shard",
    "rank_weight_bytes",
    "shard_model",
    "shard_state",
    "shard_tensor",
    "whole_digest",
    "working_tp",
]


@dataclass(frozen=True)
class RankShard:
    """What one rank holds, in global indices.

    Attributes
    ----------
    rank, tp : this rank and the number of ranks.
    q_heads, kv_heads : the query and KV heads it computes.
    kv_replicas : ranks holding each of its KV heads (1 unless ``tp > H_kv``).
    mlp_rows : its slice of the MLP's intermediate features.
    vocab_rows : its slice of the vocabulary: rows of the embeddings and of ``lm_head`` (``vocab_parallel``).
    """

    rank: int
    tp: int
    q_heads: range
    kv_heads: range
    kv_replicas: int
    mlp_rows: range
    vocab_rows: range


def _check_int(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _layout_error(num_heads: int, num_kv_heads: int, tp: int) -> str | None:
    """Why ``tp`` cannot shard these heads, or ``None`` when it can."""
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        return None
    if tp % num_kv_heads:
        return f"tp > H_kv needs tp to be a multiple of H_kv ({num_kv_heads})"
    if group % (tp // num_kv_heads):
        return f"each group's {group} query heads cannot be split over {tp // num_kv_heads} ranks"
    return None


def working_tp(num_heads: int, num_kv_heads: int) -> list[int]:
    """Every ``tp`` that can shard ``num_heads`` query and ``num_kv_heads`` KV heads."""
    return [tp for tp in range(1, num_heads + 1) if _layout_error(num_heads, num_kv_heads, tp) is None]


def check_tp(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """Raise ``ValueError`` naming ``H_q``, ``H_kv``, ``tp`` and the ``tp`` values that work when ``tp`` cannot shard
    these heads (``TypeError`` for a non-int)."""
    _check_int("num_heads", num_heads)
    _check_int("num_kv_heads", num_kv_heads)
    _check_int("tp", tp)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    why = _layout_error(num_heads, num_kv_heads, tp)
    if why is not None:
        works = ", ".join(map(str, working_tp(num_heads, num_kv_heads)))
        raise ValueError(
            f"cannot shard H_q={num_heads} query heads and H_kv={num_kv_heads} KV heads over tp={tp} ranks: {why}; "
            f"tp values that work: {works}"
        )


def _split(n: int, parts: int, index: int) -> range:
    """Part ``index`` of ``range(n)`` cut into ``parts`` contiguous pieces, the first ``n % parts`` one longer."""
    size, extra = divmod(n, parts)
    start = index * size + min(index, extra)
    return range(start, start + size + (index < extra))


def head_layout(num_heads: int, num_kv_heads: int, tp: int) -> list[tuple[range, range, int]]:
    """Per rank: ``(query heads, KV heads, replicas of each KV head)``, global head indices (module docstring)."""
    check_tp(num_heads, num_kv_heads, tp)
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        kv = [_split(num_kv_heads, tp, r) for r in range(tp)]
        return [(range(k.start * group, k.stop * group), k, 1) for k in kv]
    replicas = tp // num_kv_heads
    per_rank = group // replicas
    layout = []
    for r in range(tp):
        kv, part = divmod(r, replicas)
        first = kv * group + part * per_rank
        layout.append((range(first, first + per_rank), range(kv, kv + 1), replicas))
    return layout


def rank_shard(cfg: ModelConfig, tp: int, rank: int) -> RankShard:
    """What rank ``rank`` of ``tp`` holds of a model with ``cfg``."""
    layout = head_layout(cfg.num_heads, cfg.num_kv_heads, tp)
    if _check_int("rank", rank, low=0) >= tp:
        raise ValueError(f"rank must be in [0, {tp}), got {rank}")
    q, kv, replicas = layout[rank]
    if tp > cfg.intermediate_size:
        raise ValueError(f"tp={tp} exceeds the MLP's {cfg.intermediate_size} intermediate features")
    mlp, vocab = _split(cfg.intermediate_size, tp, rank), _split(cfg.vocab_size, tp, rank)
    return RankShard(rank, tp, q, kv, replicas, mlp, vocab)


Weight = torch.Tensor | QuantizedTensor


def _narrow(name: str, t: Weight, dim: int, start: int, length: int) -> Weight:
    """A contiguous copy of ``t``'s ``[start, start + length)`` along ``dim``; block-quantized weights stay blocks
    (``QuantizedTensor.narrow``) unless the columns cut through their blocks: then that one weight is dequantized
    (float32), with a warning naming it."""
    if not isinstance(t, QuantizedTensor):
        return t.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)  # a copy even of rows
    try:
        return t.narrow(dim, start, length)
    except ValueError as why:
        warnings.warn(f"{name}: {why}; this rank holds its part in float32", stacklevel=3)
        return t.dequantize(torch.float32).narrow(dim, start, length).contiguous()


def _rows(name: str, t: Weight, heads: range, per_head: int, dim: int = 0) -> Weight:
    return _narrow(name, t, dim, heads.start * per_head, len(heads) * per_head)


def shard_tensor(name: str, t: Weight, shard: RankShard, head_dim: int) -> Weight:
    """The shard's part of the whole model's tensor ``name`` (HF name): ``q/k/v_proj`` weights ``(heads * D, E)``
    and biases keep the shard's heads' rows, ``o_proj.weight (E, H_q * D)`` the matching columns,
    ``gate_proj``/``up_proj`` ``(I, E)`` the shard's rows and ``down_proj (E, I)`` its columns, the embeddings and
    ``lm_head`` ``(vocab, E)`` its vocabulary rows (contiguous copies; a ``QuantizedTensor`` keeps its blocks, see
    ``_narrow``, and its embedding rows are a view of them: a lookup reads only the rows it needs); anything else
    (norms) is replicated and returned as it is.
    Works on meta tensors (sizes without data)."""
    rows = shard.mlp_rows
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return _rows(name, t, shard.q_heads, head_dim)
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                      "self_attn.v_proj.bias")):  # fmt: skip
        return _rows(name, t, shard.kv_heads, head_dim)
    if name.endswith("self_attn.o_proj.weight"):
        return _rows(name, t, shard.q_heads, head_dim, dim=1)
    if name.endswith("self_attn.o_proj.bias"):
        raise ValueError(f"{name}: an o_proj bias is not supported under tensor parallelism")
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return _narrow(name, t, 0, rows.start, len(rows))
    if name.endswith("mlp.down_proj.weight"):
        return _narrow(name, t, 1, rows.start, len(rows))
    vocab = shard.vocab_rows
    if name == EMBEDDING and isinstance(t, QuantizedTensor) and t.blocks.device.type != "meta":
        # a view of the file's blocks (a GGUF's map): only the rows looked up are ever read into memory
        return QuantizedTensor(t.blocks.narrow(0, vocab.start, len(vocab)), t.format, (len(vocab), t.shape[1]))
    if name in (EMBEDDING, HEAD):
        return _narrow(name, t, 0, vocab.start, len(vocab))
    if name == "lm_head.bias":
        raise ValueError(f"{name}: an lm_head bias is not supported under tensor parallelism")
    return t


def shard_state(
    cfg: ModelConfig, state: dict[str, Weight], shard: RankShard, copied: Callable[[Weight], object] | None = None
) -> tuple[ModelConfig, dict[str, Weight]]:
    """The rank's config (its head counts and MLP width) and tensors (``shard_tensor``), from the whole model's.
    ``copied(t)`` is called with each whole tensor right after its shard was copied out of it (e.g. to drop the
    file's pages under it before the next is read)."""
    local = dataclasses.replace(
        cfg, num_heads=len(shard.q_heads), num_kv_heads=len(shard.kv_heads), intermediate_size=len(shard.mlp_rows)
    )
    tensors = {}
    for name, t in state.items():
        tensors[name] = shard_tensor(name, t, shard, cfg.head_dim)
        if copied is not None and tensors[name] is not t:
            copied(t)
    return local, tensors


def rank_weight_bytes(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    shard: RankShard,
    dtype: torch.dtype,
    blocks: dict[str, float] | None = None,
) -> int:
    """Bytes of the weights the shard holds in ``dtype`` (a tied ``lm_head`` counted once); ``blocks``: bytes per
    value of the tensors it keeps as quantized blocks (a GGUF's, loaded with dtype auto)."""
    size = torch.empty((), dtype=dtype).element_size()
    blocks = blocks or {}
    names = [n for n in state if not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    meta = {n: torch.empty(state[n].shape, device="meta") for n in names}
    held = {n: shard_tensor(n, t, shard, cfg.head_dim).numel() for n, t in meta.items()}
    return round(sum(numel * blocks.get(n, size) for n, numel in held.items()))


class ReducingLinear(Linear):
    """A row-parallel ``Linear``: this rank's partial product, summed over the ranks of ``group`` by one all-reduce.

    The all-reduce is torch's functional collective, so a ``torch.compile``'d decode step traces it into its graph.
    Eagerly, ``calls`` counts the all-reduces and, with ``timed`` set, ``seconds`` adds up their wall time (waiting
    for each to finish: for benchmarks).
    """

    group: dist.ProcessGroup | None = None
    calls: int = 0
    timed: bool = False
    seconds: float = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(super().forward(x), self.group)


class ReducingQuantizedLinear(QuantizedLinear):
    """``ReducingLinear`` over block-quantized weights (``QuantizedLinear``): the same all-reduce, counted and timed
    in ``ReducingLinear``'s class attributes."""

    group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(super().forward(x), self.group)


def _all_reduce(partial: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of ``partial`` over ``group``'s ranks (default: the world), counted in ``ReducingLinear.calls`` and,
    with ``ReducingLinear.timed``, waited for and timed in ``ReducingLinear.seconds``."""
    group = group or dist.group.WORLD
    if torch.compiler.is_compiling():
        return funcol.all_reduce(partial, "sum", group)
    ReducingLinear.calls += 1
    if not ReducingLinear.timed:
        return funcol.all_reduce(partial, "sum", group)
    start = time.perf_counter()
    out = funcol.wait_tensor(funcol.all_reduce(partial, "sum", group))
    ReducingLinear.seconds += time.perf_counter() - start
    return out


def shard_model(
    cfg: ModelConfig,
    state: dict[str, Weight],
    group: dist.ProcessGroup | None = None,
    dtype: torch.dtype | None = None,
    copied: Callable[[Weight], object] | None = None,
) -> CausalLM:
    """This process's part of the model in ``group`` (default: the whole world), ready to run in step with the other
    ranks: a ``CausalLM`` with the local config, ``o_proj``/``down_proj`` all-reducing, ``model.shard`` (a
    ``RankShard``) saying what part of the whole it holds, ``model.whole_config`` the whole model's config and
    ``model.tp_group`` the group (``None``: the world).
    ``QuantizedTensor`` weights (``read_model(..., keep_quantized=True)``) are sharded as blocks and held by
    ``QuantizedLinear`` / ``QuantizedEmbedding`` modules (embeddings giving rows in ``dtype``, default float32), so a
    rank holds its share of a quantized file's bytes, not the whole model in float; the embeddings and ``lm_head``
    hold the rank's vocabulary rows (``vocab_parallel``). ``copied``: as ``shard_state``'s."""
    from ..models.llama import CausalLM
    from ..models.quantized import install_quantized

    if not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs an initialised torch.distributed process group")
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    shard = rank_shard(cfg, tp, rank)
    digest = whole_digest(state)
    local_cfg, local_state = shard_state(cfg, state, shard, copied)
    vocab = {name: local_state.pop(name) for name in (EMBEDDING, HEAD) if name in local_state}  # this rank's rows
    quantized = {name: t for name, t in local_state.items() if isinstance(t, QuantizedTensor)}
    for name, t in [*quantized.items(), *vocab.items()]:  # placeholders: these modules are replaced below
        local_state[name] = torch.empty(t.shape if name not in vocab else (cfg.vocab_size, t.shape[1]), device="meta")
    model = CausalLM.from_state(local_cfg, local_state, assign=True)
    if quantized:
        install_quantized(model, quantized, dtype or torch.float32)
    head = None if cfg.tie_word_embeddings else vocab[HEAD]
    embed, lm_head = vocab_modules(vocab[EMBEDDING], head, shard.vocab_rows, cfg.vocab_size, dtype or torch.float32,
                                   _all_reduce, group)  # fmt: skip
    model.model.embed_tokens, model.lm_head = embed, lm_head
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            linear = getattr(parent, name)
            if isinstance(linear, QuantizedLinear):
                reducing: nn.Module = ReducingQuantizedLinear(linear.quantized())
            else:
                reducing = ReducingLinear(linear.in_features, linear.out_features, bias=False, device="meta")
                reducing.weight = linear.weight  # the same parameter, under the same name
            reducing.group = group
            setattr(parent, name, reducing)
    model.shard, model.whole_config, model.whole_digest, model.tp_group = shard, cfg, digest, group
    return model


def whole_digest(state: dict[str, Weight], samples: int = 64) -> str:
    """A digest of the whole model's tensors, the same on every rank that loaded the same weights: each tensor's name,
    shape and ``samples`` of its values (blocks) spread over it, so a few pages of each are read, not the model."""
    digest = hashlib.blake2b(digest_size=8)
    for name in sorted(state):
        t = state[name]
        data = (t.blocks if isinstance(t, QuantizedTensor) else t).detach().reshape(-1)
        picked = data[:: max(1, data.numel() // samples)][:samples].contiguous()
        digest.update(f"{name}{tuple(t.shape)}".encode())
        digest.update(picked.cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
