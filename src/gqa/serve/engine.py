"""The serving engine: continuous batching over a paged KV cache.

Each ``step()`` runs, in this order:

1. *admission* — waiting requests get block tables (sharing the cached blocks of their longest cached prefix) while
   blocks and batch slots last;
2. *one native call for the whole batch* (``gqa::decode_paged``: every layer, each row reading its own blocks, any
   batch size, ragged lengths): a row for every request that has a token to feed (*decode*), and the next rows of
   the prompts still being read (*prefill*: at most ``prefill_chunk`` prompt tokens per step while others decode, so
   a long prompt delays running streams by a chunk per step, not by the whole prompt). A prompt's rows attend to the
   rows before them in the same call (their K/V are written first); only the rows whose next token is wanted get
   logits.

Requests join at the next step and leave the step they finish, and their blocks go back to the pool. When a
request needs a new block and none is free, the most recently admitted request is *preempted*: its blocks are freed
and it waits at the front of the queue, to be recomputed from its prompt and the tokens it already produced (which
its client already has).

A row's result does not depend on the other rows of the call (``gqa::decode_paged`` splits each context at fixed
positions and streams every row through the same kernels, prompt rows and decode rows alike), so a token's K/V and a
greedy response do not depend on what else is being served, on how a prompt was cut into chunks, or on which of its
blocks came from the prefix cache.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from .. import kernels
from ..generation import sample_next
from ..models import decode_step
from .blocks import BlockManager, BlockTable, OutOfBlocks
from .paged_cache import PagedKVCache, blocks_in_budget, table_tensor
from .sampling import SamplingParams, TextStream

__all__ = ["Engine", "EngineError", "Request", "RequestOutput"]

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"


class EngineError(ValueError):
    """A request the engine cannot take (too long for the context or the cache, bad token ids)."""


@dataclass
class RequestOutput:
    """What one step produced for one request: its new token ids and text, and whether it is done (and why:
    ``"stop"`` — an end-of-sequence token or a stop string, ``"length"`` — ``max_tokens``, ``"abort"``,
    ``"error"``)."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)  # prompt + output, the last one not yet fed when decoding
    outputs: list[int] = field(default_factory=list)
    state: str = WAITING
    table: BlockTable | None = None
    computed: int = 0  # leading tokens whose K/V are in the pool
    generator: torch.Generator | None = None
    text: TextStream | None = None
    finish_reason: str | None = None
    preemptions: int = 0


class Engine:
    """Continuous batching for a ``CausalLM`` on CPU (float32 or bfloat16, float or block-quantized weights).

    ``kv_cache_mib``: the KV pool's size (default: a quarter of the available memory, at most what ``max_running``
    full contexts need); ``block_size``: token slots per block; ``max_running``: requests decoded together at most;
    ``prefill_chunk``: prompt tokens per step while others decode (four times as many while none does);
    ``eos_token_ids``: the tokens that end a response (default: the tokenizer's, else the model config's). Prompts and
    decoding read block-quantized weights as blocks (no float copy).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        *,
        kv_cache_mib: float | None = None,
        block_size: int = 16,
        max_running: int = 64,
        prefill_chunk: int = 64,
        eos_token_ids: Iterable[int] | None = None,
    ) -> None:
        self.check_model(model)
        cfg = model.config
        for name, n in (("block_size", block_size), ("max_running", max_running), ("prefill_chunk", prefill_chunk)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a positive integer, got {n!r}")
        self.model, self.tokenizer, self.config = model, tokenizer, cfg
        self.block_size, self.max_running, self.prefill_chunk = block_size, max_running, prefill_chunk
        if kv_cache_mib is None:
            kv_cache_mib = default_kv_cache_mib(model, max_running)
        if not (isinstance(kv_cache_mib, (int, float)) and math.isfinite(kv_cache_mib) and kv_cache_mib > 0):
            raise ValueError(f"kv_cache_mib must be a positive number, got {kv_cache_mib!r}")
        num_blocks = blocks_in_budget(kv_cache_mib, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                                      model.dtype)  # fmt: skip
        if num_blocks < 1:
            raise ValueError(f"kv_cache_mib={kv_cache_mib} holds no block of {block_size} tokens")
        self.cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size, model.dtype)
        self.blocks = BlockManager(num_blocks, block_size)
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else cfg.eos_token_id
        self.eos = {int(t) for t in eos_token_ids or []}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "steps": 0}

    @staticmethod
    def check_model(model: torch.nn.Module) -> None:
        """Raise ``EngineError`` unless the engine takes ``model``: float32 or bfloat16 on CPU with the native kernels
        built, layers the native step takes, full half-rotation RoPE."""
        if model.device.type != "cpu" or model.dtype not in decode_step.DTYPES or not kernels.vectorized():
            raise EngineError("the engine runs float32 or bfloat16 models on CPU with the native kernels built")
        if decode_step._cached_model_args(model, model.dtype) is None:
            raise EngineError("the model's layers are not all ones the native step takes (see models.decode_step)")
        rope = model.model.rope
        if rope.interleaved or rope.rotary_dim != rope.head_dim:
            raise EngineError("the engine needs full half-rotation RoPE")

    # -- requests --------------------------------------------------------------------------------------------------

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ``EngineError`` for a request that cannot be served: empty, token ids outside the vocabulary, or a
        prompt that does not fit the context or the whole cache with ``max_tokens`` more tokens. Reads only
        settings (safe from any thread)."""
        if not prompt:
            raise EngineError("the prompt is empty")
        V = self.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            raise EngineError(f"token ids must be in [0, {V})")
        context = self.config.max_position_embeddings
        if len(prompt) + params.max_tokens > context:
            raise EngineError(
                f"the prompt's {len(prompt)} tokens plus max_tokens={params.max_tokens} exceed the model's context "
                f"of {context} tokens"
            )
        if self.blocks.blocks_needed(len(prompt) + params.max_tokens) > self.blocks.num_blocks:
            raise EngineError(
                f"the prompt's {len(prompt)} tokens plus max_tokens={params.max_tokens} need more than the KV cache's "
                f"{self.blocks.num_blocks * self.block_size} token slots"
            )

    def add(self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        """Queue a request for token ids ``prompt``; it joins the running batch at the next ``step``. Raises
        ``EngineError`` (before any work) where ``check`` does."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        self.check(prompt, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise EngineError(f"request id {request_id!r} is already in use")
        r = Request(request_id, prompt, params, tokens=list(prompt))
        if not params.greedy:
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            r.generator = torch.Generator().manual_seed(seed)
        if self.tokenizer is not None:
            r.text = TextStream(self.tokenizer.decode, params.stop)
        self.requests[request_id] = r
        self.waiting.append(r)
        return r

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (its blocks go back to the pool); ``None`` if it is unknown or already done."""
        r = self.requests.get(request_id)
        if r is None or r.state == FINISHED:
            return None
        return self._finish(r, "abort")

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """End a request with an error (its blocks go back); ``None`` if it is unknown or already done."""
        r = self.requests.get(request_id)
        if r is None or r.state == FINISHED:
            return None
        return self._finish(r, "error", error=error)

    def fail_step(self, error: str) -> list[RequestOutput]:
        """End the requests of a step that raised with ``error``: the running ones (their state is not to be trusted),
        or, where none runs, the one being admitted (the head of the queue); the other waiting ones stay queued."""
        failing = list(self.running) or list(self.waiting)[:1]
        return [self._finish(r, "error", error=error) for r in failing]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ----------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration: admit, then one call for the decode rows and the next prompt rows; the outputs it
        produced."""
        self.stats["steps"] += 1
        self._admit()
        work = [(r, r.computed, len(r.tokens)) for r in self.running if r.state == DECODE]
        budget = self.prefill_chunk if work else 4 * self.prefill_chunk
        for r in self.running:
            if r.state == PREFILL and budget > 0:
                end = min(len(r.tokens), r.computed + budget)
                work.append((r, r.computed, end))
                budget -= end - r.computed
        return self._run(work) if work else []

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            try:
                r.table = self.blocks.allocate(r.tokens)
            except OutOfBlocks:
                return  # blocks come back as running requests finish
            self.waiting.popleft()
            r.table.tokens = r.tokens  # one list: the table hashes the tokens its full blocks hold
            r.state, r.computed = PREFILL, r.table.cached_tokens
            self.running.append(r)

    def _run(self, work: list[tuple[Request, int, int]]) -> list[RequestOutput]:
        """Feed each request's tokens ``[start, end)``; sample for those fed up to their last token. If the call
        raises, each request runs alone, and the ones that still raise fail alone."""
        outputs: list[RequestOutput] = []
        try:
            groups = [(work, self._forward(work))]
        except Exception:
            groups = []
            for item in work:
                try:
                    groups.append(([item], self._forward([item])))
                except Exception as e:  # the request fails alone; the engine serves on
                    outputs.append(self._finish(item[0], "error", error=f"{type(e).__name__}: {e}"))
        picked = []  # (request, its greedy token or None when sampled, its logits row), in row order
        for items, (logits, greedy) in groups:
            row = 0
            for r, _, end in items:
                r.computed = end
                self.blocks.computed(r.table, end)
                if end < len(r.tokens):
                    continue  # a prompt chunk that does not reach the prompt's end: no logits
                if r.state == PREFILL:
                    r.state = DECODE
                    self.stats["prompt_tokens"] += len(r.prompt) if not r.preemptions else 0
                picked.append((r, int(greedy[row]) if r.params.greedy else None, logits[row]))
                row += 1
        drawn = iter(self._sample([(r, x) for r, token, x in picked if token is None]))
        sampled, tokens = [], []
        for r, token, _ in picked:
            token = next(drawn) if token is None else token
            if isinstance(token, Exception):
                outputs.append(self._finish(r, "error", error=f"{type(token).__name__}: {token}"))
            else:
                sampled.append(r)
                tokens.append(token)
        return outputs + self._sampled(sampled, tokens)

    def _forward(self, work: list[tuple[Request, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One ``gqa::decode_paged`` call over every request's rows ``[start, end)`` (their K/V into the pool):
        the logits ``(N, vocab)`` and greedy tokens ``(N,)`` of the requests fed up to their last token, in order."""
        model, backbone = self.model, self.model.model
        ids, positions, tables, wanted = [], [], [], []
        for r, start, end in work:
            ids += r.tokens[start:end]
            positions += range(start, end)
            tables += [r.table.blocks] * (end - start)
            if end == len(r.tokens):
                wanted.append(len(ids) - 1)
        B = len(ids)
        positions = torch.tensor(positions, dtype=torch.long)
        cos, sin = backbone.rope.cos_sin(positions.view(B, 1))  # (B, 1, D) each
        x = backbone.embed_tokens(torch.tensor(ids, dtype=torch.long).view(B, 1)).view(B, -1)
        norms1, norms2, eps, weights, formats, biases, head, head_format = decode_step._cached_model_args(
            model, model.dtype
        )
        greedy = torch.empty(len(wanted), dtype=torch.long)
        logits = torch.ops.gqa.decode_paged(
            x, norms1, norms2, eps, weights, formats, biases, cos.view(B, -1).contiguous(),
            sin.view(B, -1).contiguous(), self.cache.key, self.cache.value, table_tensor(tables), positions,
            1.0 / math.sqrt(backbone.layers[0].self_attn.head_dim), backbone.norm.weight, backbone.norm.eps, head,
            head_format, greedy, torch.tensor(wanted, dtype=torch.long),
        )  # fmt: skip
        return logits, greedy

    def _sample(self, rows: list[tuple[Request, torch.Tensor]]) -> list[int | Exception]:
        """A token for each ``(request, logits (vocab,))`` row: one ``sample_next`` call per distinct setting, each
        row inverting its own request's next uniform number, so a row gets the token it would get alone. A row that
        cannot be sampled (NaN logits) gets its exception instead; the others are sampled."""
        out: list[int | Exception] = [0] * len(rows)
        settings: dict[tuple, list[int]] = {}
        for i, (r, _) in enumerate(rows):
            settings.setdefault((r.params.temperature, r.params.top_k, r.params.top_p), []).append(i)
        for (temperature, top_k, top_p), idx in settings.items():
            u = torch.cat([torch.rand(1, generator=rows[i][0].generator) for i in idx])  # (n,)
            x = torch.stack([rows[i][1] for i in idx])  # (n, vocab)
            how = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
            try:
                got: list[int | Exception] = sample_next(x, uniforms=u, **how).tolist()
            except Exception:  # a bad row: sample each alone, so only the bad ones fail
                got = []
                for k in range(len(idx)):
                    try:
                        got.append(int(sample_next(x[k : k + 1], uniforms=u[k : k + 1], **how)))
                    except Exception as e:
                        got.append(e)
            for i, token in zip(idx, got, strict=True):
                out[i] = token
        return out

    def _sampled(self, batch: list[Request], tokens: list[int | None]) -> list[RequestOutput]:
        """Each request's new token: outputs, finished requests released, a block for the next slot of the rest
        (preempting the latest admitted requests when none is free)."""
        outputs = []
        for r, token in zip(batch, tokens, strict=True):
            if r.state == FINISHED:
                continue
            r.outputs.append(token)
            r.tokens.append(token)
            self.stats["generation_tokens"] += 1
            eos = token in self.eos and not r.params.ignore_eos
            piece = ""
            if r.text is not None:
                piece = r.text.update(r.outputs[:-1] if eos else r.outputs, final=eos)
            if eos or (r.text is not None and r.text.stopped):
                outputs.append(self._finish(r, "stop", token=token, piece=piece))
            elif len(r.outputs) >= r.params.max_tokens:
                if r.text is not None:
                    piece += r.text.update(r.outputs, final=True)
                outputs.append(self._finish(r, "length", token=token, piece=piece))
            else:
                outputs.append(self._output(r, [token], piece))
        for r in batch:
            if r.state == DECODE:
                self._reserve_slot(r)
        return outputs

    def _reserve_slot(self, r: Request) -> None:
        """A block for ``r``'s newest token, freeing other requests' blocks (preemption) if needed."""
        while True:
            try:
                return self.blocks.reserve(r.table, len(r.tokens))
            except OutOfBlocks:
                victim = self.running[-1]  # the latest admitted
                self._preempt(victim)
                if victim is r:
                    return

    def _preempt(self, r: Request) -> None:
        self.blocks.free(r.table)
        self.running.remove(r)
        r.state, r.table, r.computed = WAITING, None, 0
        r.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(r)

    def _output(self, r: Request, token_ids: list[int], piece: str, error: str | None = None) -> RequestOutput:
        return RequestOutput(r.request_id, token_ids, piece, r.state == FINISHED, r.finish_reason, len(r.prompt),
                             len(r.outputs), error)  # fmt: skip

    def _finish(
        self, r: Request, reason: str, *, token: int | None = None, piece: str = "", error: str | None = None
    ) -> RequestOutput:
        if r.table is not None and r.state in (PREFILL, DECODE):
            self.blocks.free(r.table)
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        r.state, r.finish_reason, r.table = FINISHED, reason, None
        del self.requests[r.request_id]
        return self._output(r, [] if token is None else [token], piece, error)


def default_kv_cache_mib(model: torch.nn.Module, max_running: int) -> float:
    """A quarter of the memory available now, at most what ``max_running`` full contexts need."""
    cfg = model.config
    full = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * cfg.max_position_embeddings * model.dtype.itemsize
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        available = 4 * 2**30
    return max(1.0, min(available / 4, full * max_running) / 2**20)
