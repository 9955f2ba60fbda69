"""The vocabulary sharded over tensor-parallel ranks (Megatron's vocab-parallel embedding and output layer).

Each of ``tp`` ranks holds a contiguous slice of the vocabulary's rows of ``model.embed_tokens`` and ``lm_head``
(one slice when they are tied), so no rank keeps the whole ``(vocab, E)`` table: on a 128k-vocabulary model that is
the largest tensor of all. An embedding lookup gives each token's row on the rank that holds it and zeros elsewhere;
one all-reduce sums them (a row plus zeros: the same bits as the whole table's row). ``lm_head`` computes each rank's
slice of the logits, which one all-gather joins (``VocabParallelHead``), or which a serving step gathers on rank 0
alone (``gather_logits``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import _functional_collectives as funcol

from ..models.linear import Linear
from ..models.quantized import QuantizedEmbedding, QuantizedLinear, QuantizedTensor

__all__ = ["EMBEDDING", "HEAD", "VocabParallelEmbedding", "VocabParallelHead", "gather_logits", "vocab_modules"]

EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # the new name (torch 2.10+)


class VocabParallelEmbedding(nn.Module):
    """``ids (*) -> (*, E)`` from this rank's rows ``rows`` of the table (``table``: an ``nn.Embedding`` or
    ``QuantizedEmbedding`` of ``len(rows)`` rows), the ranks' lookups summed by ``all_reduce(partial, group)`` (the
    tensor-parallel layers' own, ``tensor_parallel._all_reduce``: counted and timed with theirs)."""

    def __init__(
        self, table: nn.Module, rows: range, all_reduce: Callable, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        self.table, self.rows, self.all_reduce, self.group = table, rows, all_reduce, group
        self.embedding_dim = table.embedding_dim

    def extra_repr(self) -> str:
        return f"rows=[{self.rows.start}, {self.rows.stop})"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.partial(ids), self.group)

    def partial(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of the lookup ``(*, E)``: the rows it holds, zeros for the other ids (their sum over the
        ranks is the lookup)."""
        local = ids - self.rows.start
        held = (local >= 0) & (local < len(self.rows))  # (*)
        rows = self.table(torch.where(held, local, torch.zeros_like(local)))  # (*, E): row 0 where not held
        return rows.masked_fill(~held.unsqueeze(-1), 0)


class VocabParallelHead(nn.Module):
    """``x (*, E) -> logits (*, vocab)``: this rank's rows ``rows`` of ``lm_head`` (``part``: a ``Linear`` or
    ``QuantizedLinear`` of ``len(rows)`` outputs), the ranks' slices joined by one all-gather over ``group`` (every
    rank gets every logit)."""

    def __init__(self, part: nn.Module, rows: range, vocab_size: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.part, self.rows, self.vocab_size, self.group = part, rows, vocab_size, group
        self.out_features = vocab_size

    def extra_repr(self) -> str:
        return f"rows=[{self.rows.start}, {self.rows.stop}) of {self.vocab_size}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.join(self.part(x))

    def join(self, part: torch.Tensor) -> torch.Tensor:
        """Every rank's logits ``(*, vocab)`` from this rank's slice ``part (*, len(rows))`` (a collective)."""
        tp = dist.get_world_size(self.group)
        part = _padded(part, self.vocab_size, tp)  # (*, width)
        joined = _all_gather(part, 0, self.group or dist.group.WORLD)  # (tp * *, width)
        return _unpad(joined.view(tp, *part.shape), self.vocab_size)


def _padded(part: torch.Tensor, vocab_size: int, tp: int) -> torch.Tensor:
    """A rank's logits ``part (*, n_r)`` padded to the widest rank's ``ceil(vocab_size / tp)`` (the collectives take
    equal parts), contiguous."""
    return F.pad(part, (0, -(-vocab_size // tp) - part.shape[-1])).contiguous()


def _unpad(parts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``parts (tp, *, width)``: each rank's logits padded to ``width`` (the first ``vocab_size % tp`` slices one
    longer, as ``tensor_parallel._split`` cuts them) -> ``(*, vocab_size)``."""
    tp, width = parts.shape[0], parts.shape[-1]
    size, extra = divmod(vocab_size, tp)
    slices = [parts[r, ..., : size + (r < extra)] for r in range(tp)]
    return torch.cat(slices, -1) if tp * width != vocab_size else parts.movedim(0, -2).flatten(-2)


def gather_logits(part: torch.Tensor, vocab_size: int, group: dist.ProcessGroup | None = None) -> torch.Tensor | None:
    """The whole logits ``(N, vocab_size)`` on rank 0 of ``group`` from every rank's slice ``part (N, n_r)`` (a
    collective: every rank calls it); ``None`` on the other ranks."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    padded = _padded(part, vocab_size, tp)  # (N, width)
    parts = [torch.empty_like(padded) for _ in range(tp)] if rank == 0 else None
    dist.gather(padded, parts, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return None if parts is None else _unpad(torch.stack(parts), vocab_size)


def vocab_modules(
    embedding: torch.Tensor | QuantizedTensor,
    head: torch.Tensor | QuantizedTensor | None,
    rows: range,
    vocab_size: int,
    dtype: torch.dtype,
    all_reduce: Callable,
    group: dist.ProcessGroup | None = None,
) -> tuple[VocabParallelEmbedding, VocabParallelHead]:
    """This rank's embedding and output layer over its vocabulary rows: ``embedding`` and ``head`` are its slices
    ``(len(rows), E)`` of the tables (``head`` ``None``: tied, the embedding's own tensor); quantized slices stay
    blocks (embedding rows given in ``dtype``); ``all_reduce`` as ``VocabParallelEmbedding`` takes it."""
    tied = head is None
    head = embedding if tied else head
    if isinstance(embedding, QuantizedTensor):
        table: nn.Module = QuantizedEmbedding(embedding, dtype)
    else:
        table = nn.Embedding(*embedding.shape, _weight=embedding, _freeze=True)
    if isinstance(head, QuantizedTensor):
        part: nn.Module = QuantizedLinear(head)
        if tied and isinstance(table, QuantizedEmbedding):
            part.blocks = table.blocks  # one tensor for both
    else:
        part = Linear(head.shape[1], head.shape[0], bias=False, device="meta")
        part.weight = table.weight if tied and isinstance(table, nn.Embedding) else nn.Parameter(head, False)
    return VocabParallelEmbedding(table, rows, all_reduce, group), VocabParallelHead(part, rows, vocab_size, group)
