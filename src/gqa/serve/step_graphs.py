"""Decode steps of the GPU serving engine replayed from CUDA graphs, one graph per batch-size bucket (vLLM's way).

An eager serving step on a GPU is launch-bound: SmolLM2's 30 layers are ~15 kernels each, and the host takes longer
to launch them than the GPU to run them (25-41 ms a step on an H100 against 4.2-5.0 ms for the same model's
CUDA-graph decode). A step whose every row wants its next token (decode rows; a draft's rows, each a token at its own
position) has a fixed shape once its row count is rounded up to a bucket: ``DecodeGraphs`` captures, at start-up,
the step over static input buffers for each bucket (``graph_buckets``: 1, 2, 4, 8, then every 8 up to
``max_running``) and later copies a step's token ids, positions and block tables into those buffers and replays the
bucket's graph. Prompt chunks, batches beyond the largest bucket and sequences beyond ``MAX_GRAPH_LENGTH`` tokens
(vLLM's ``max_seq_len_to_capture``; there attention, not launching, takes the time) run eagerly.

What keeps the shapes fixed:
- the rows past a batch's own (the bucket's padding) are token 0 at position 0 with a one-block table holding the
  pool's spare block (``PagedKVCache(spare_blocks=1)``, a block no request's table holds): they write their K/V
  there and attend to it alone, so the real rows and the pool's other blocks never see them;
- the attention kernel is launched for a fixed number of keys, its splits at fixed multiples of its chunk as in an
  eager step, so a row's attention is the eager step's bit for bit; launched for the longest sequence a graph takes
  it would run empty programs per row and head for a short one, so each bucket has a graph per length tier
  (``length_tiers``: 2,048 keys, then x4 up to the longest), and a step replays the shortest tier its longest row fits;
- RoPE reads its tables, grown to the longest tier before capture (no host-side growth during a step); the runner
  keeps the tables and the fused weights the graphs read alive as long as they are (a table grown later elsewhere
  is a new tensor).

Capture runs the step once eagerly first (compiling the Triton kernels and creating cuBLAS's workspaces, on a side
stream as PyTorch asks) over the padding rows only; the graphs share one memory pool and that one stream, captured
largest first so that the smaller ones reuse its memory. On CPU (tests, with Triton's interpreter) ``RecordedStep``
stands in for a CUDA graph: it runs the step's closure again at each replay, reading the same static buffers, so a
step that forgot to copy its inputs there gives wrong tokens on CPU as it would on a GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import torch

__all__ = ["DecodeGraphs", "RecordedStep", "bucket_for", "graph_buckets", "length_tiers"]

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
FIRST_TIER = 2048  # keys of the shortest length tier
MAX_GRAPH_LENGTH = 8192  # longer sequences step eagerly (vLLM's max_seq_len_to_capture): attention dominates there


def graph_buckets(max_rows: int) -> tuple[int, ...]:
    """The batch sizes a graph is captured for: 1, 2, 4, 8, then every 8 up to ``max_rows`` (which is always one)."""
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive integer, got {max_rows!r}")
    sizes = {n for n in (1, 2, 4, 8) if n < max_rows} | set(range(8, max_rows, 8)) | {max_rows}
    return tuple(sorted(sizes))


def length_tiers(longest: int, first: int | None = None) -> tuple[int, ...]:
    """The sequence lengths a graph is captured for: ``first`` (default ``FIRST_TIER``), 4 times that, ... below
    ``longest``, and ``longest``."""
    if isinstance(longest, bool) or not isinstance(longest, int) or longest < 1:
        raise ValueError(f"longest must be a positive integer, got {longest!r}")
    first = FIRST_TIER if first is None else first
    tiers = []
    while first < longest:
        tiers.append(first)
        first *= 4
    return (*tiers, longest)


def bucket_for(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket (or length tier) that holds ``rows`` (``None``: more than the largest)."""
    return next((b for b in buckets if b >= rows), None)


class RecordedStep:
    """A CUDA graph's stand-in on CPU: ``replay()`` runs ``fn`` again (over the same static buffers) and returns its
    outputs. Made as a graph is: ``fn`` runs once first (the warm-up)."""

    def __init__(
        self, fn: Callable[[], tuple[torch.Tensor, torch.Tensor]], device: torch.device, pool: object, stream: object
    ) -> None:
        fn()
        self.fn = fn

    def replay(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn()


class CudaStep:
    """``fn`` captured in a CUDA graph on ``device`` after one eager warm-up run on the side stream ``side``;
    ``replay()`` relaunches every kernel and returns the outputs captured (static tensors, rewritten by each replay).
    Graphs that share ``pool`` share ``side`` too: the caching allocator reuses a freed block only on the stream it
    was allocated on (torch.cuda.graph's docs: pass the same stream to every capture into one pool). Other threads
    may use the GPU meanwhile (another model of the same server): the capture refuses only this thread's unsafe
    calls."""

    def __init__(
        self, fn: Callable[[], tuple[torch.Tensor, torch.Tensor]], device: torch.device, pool: object, side: object
    ) -> None:
        self.device = device
        with torch.cuda.device(device):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # on the side stream: torch's default capture stream belongs to the device current at its first use
            with torch.cuda.graph(self.graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                self.outputs = fn()

    def replay(self) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.outputs


class DecodeGraphs:
    """``step(ids (b,), positions (b,), tables (b, width), length) -> (logits (b, vocab) float32, greedy (b,))``, where
    every row's position is below ``length``, captured once per bucket ``b`` and length tier over static buffers on
    ``device`` (module docstring); ``pad_block``: the pool's spare block, where the padding rows write; ``width``: the
    table columns a row can need (the longest tier over the block size, rounded up). ``recorded`` makes
    ``RecordedStep`` stand-ins instead of CUDA graphs (CPU)."""

    def __init__(
        self,
        step: Step,
        *,
        buckets: Sequence[int],
        lengths: Sequence[int],
        width: int,
        pad_block: int,
        device: torch.device,
        recorded: bool = False,
    ) -> None:
        self.buckets, self.lengths, self.width, self.pad_block = tuple(buckets), tuple(lengths), width, pad_block
        # one row per batch row: [token id, position, block table ...] — one host-to-device copy per step
        self.inputs = torch.zeros(self.buckets[-1], 2 + width, dtype=torch.long, device=device)
        self.inputs[:, 2:] = pad_block
        self.replays = 0
        self.used: Counter[tuple[int, int]] = Counter()  # replays per (bucket, length tier)
        self.step = step
        # every graph writes its outputs into these (made by the first warm-up, outside any capture): one logits
        # buffer for all, not one per graph (64 rows x a 128k vocabulary is 32 MiB a graph)
        self.logits: torch.Tensor | None = None
        self.greedy: torch.Tensor | None = None
        make = RecordedStep if recorded else CudaStep
        pool = side = None
        if not recorded:  # one pool and one capture stream for all the graphs
            with torch.cuda.device(device):
                pool, side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        self.graphs: dict[tuple[int, int], RecordedStep | CudaStep] = {}
        for b in sorted(self.buckets, reverse=True):  # largest first: the others reuse its memory
            for length in sorted(self.lengths, reverse=True):
                self.graphs[b, length] = make(partial(self._rows, b, length), device, pool, side)

    def _rows(self, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step over the static inputs' first ``b`` rows, its outputs copied into the shared buffers' first
        ``b``."""
        rows = self.inputs[:b]
        logits, greedy = self.step(rows[:, 0], rows[:, 1], rows[:, 2:], length)
        if self.logits is None:
            self.logits = logits.new_empty(self.buckets[-1], *logits.shape[1:])
            self.greedy = greedy.new_empty(self.buckets[-1])
        self.logits[:b].copy_(logits)
        self.greedy[:b].copy_(greedy)
        return self.logits[:b], self.greedy[:b]

    def takes(self, rows: int, longest: int) -> bool:
        """Whether a graph takes ``rows`` decode rows whose longest sequence is ``longest`` tokens."""
        return bucket_for(rows, self.buckets) is not None and bucket_for(longest, self.lengths) is not None

    @torch.inference_mode()
    def run(
        self, ids: Sequence[int], positions: Sequence[int], tables: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step for these ``n`` decode rows (``takes``; every table at most ``width`` blocks): ``(logits (n,
        vocab), greedy (n,))``, the logits a copy on the device, the greedy tokens on the CPU."""
        n = len(ids)
        b, length = bucket_for(n, self.buckets), bucket_for(max(positions) + 1, self.lengths)
        if b is None or length is None:
            raise ValueError(f"{n} rows up to position {max(positions)}: the largest graph takes {self.buckets[-1]} "
                             f"rows of {self.lengths[-1]} tokens")  # fmt: skip
        used = min(self.width, max(len(t) for t in tables))  # the kernel reads no column at or past `width`
        host = np.full((b, 2 + used), self.pad_block, dtype=np.int64)
        host[:, :2] = 0  # padding rows: token 0 at position 0, in the spare block
        host[:n, 0], host[:n, 1] = ids, positions
        for r, table in enumerate(tables):
            row = table[:used]
            host[r, 2 : 2 + len(row)] = row
        # columns past `used` keep older entries: no row's length reaches them
        self.inputs[:b, : 2 + used].copy_(torch.from_numpy(host), non_blocking=True)
        logits, greedy = self.graphs[b, length].replay()
        self.replays += 1
        self.used[b, length] += 1
        return logits[:n].clone(), greedy[:n].cpu()
