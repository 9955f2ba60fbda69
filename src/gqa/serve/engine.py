"""The serving engine: continuous batching over a paged KV cache, one step at a time.

    step = schedule (scheduler.py) -> run the batch in one native call (runner.py) -> sample (sampler.py)
           -> update the requests (scheduler.py)

Requests join at the next step and leave the step they finish; their blocks go back to the pool. The parts:
``Scheduler`` (admission, prompt chunks, finishing, preemption; no tensors), ``ModelRunner`` (the KV pool and the
``gqa::decode_paged`` call), ``sample_rows`` and ``TextStream`` (detokenizer.py). A row's result does not depend on
the other rows (runner.py says why), so a greedy response does not depend on what else is being served.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..models.quantized import QuantizedLinear
from .blocks import BlockManager
from .config import EngineConfig
from .detokenizer import TextStream
from .prefix_disk import DiskPrefixCache
from .request import EngineError, Request, RequestOutput, RequestState
from .runner import ModelRunner, default_kv_cache_mib
from .sampler import adjusted, sample_rows, token_logprob
from .sampling import SamplingParams
from .scheduler import Scheduler
from .speculation import accepted, draft_lengths
from .structured import Grammars

__all__ = ["Engine", "EngineError", "EngineStats", "Request", "RequestOutput", "RequestState", "default_kv_cache_mib"]


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine for ``/metrics``."""

    waiting: int
    running: int
    kv_blocks: int
    kv_blocks_free: int
    kv_block_size: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    prompt_tokens: int
    generation_tokens: int
    preemptions: int
    steps: int
    draft_tokens: int  # proposed by prompt lookup and verified
    draft_tokens_accepted: int
    prefix_cache_resumed_hits: int = 0  # the same two for requests taken up again after preemption
    prefix_cache_resumed_queries: int = 0
    prefix_cache_disk_hits: int = 0  # prompt blocks read from the prefix cache on disk instead of computed
    prefix_cache_disk_writes: int = 0  # block files written to it
    cuda_graph_steps: int = 0  # steps replayed from a CUDA graph (the GPU runner's decode steps)


class Engine:
    """Continuous batching for a ``CausalLM`` on CPU (float32 or bfloat16, float or block-quantized weights).

    ``config`` (or its fields as keywords: ``kv_cache_mib``, ``block_size``, ``max_running``, ``prefill_chunk``):
    see ``EngineConfig``; ``eos_token_ids``: the tokens that end a response (default: the tokenizer's, else the model
    config's)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Iterable[int] | None = None,
        runner: type | None = None,
        **options,
    ) -> None:
        if config is not None and options:
            raise ValueError(f"give an EngineConfig or its fields ({sorted(options)}), not both")
        config = config or EngineConfig(**options)
        self.runner = (runner or runner_for(model))(model, config)
        self.model, self.tokenizer, self.config, self.engine_config = model, tokenizer, model.config, config
        self.cache = self.runner.cache
        self.blocks = BlockManager(self.cache.num_blocks, config.block_size)
        self.disk = None  # the prefix cache on disk (prefix_disk.py), with config.prefix_cache_dir
        if config.prefix_cache_dir is not None:
            if getattr(model, "shard", None) is not None:  # rank 0's blocks hold its KV heads alone
                raise ValueError("prefix_cache_dir does not take a tensor-parallel shard: rank 0 would store and "
                                 "restore its own KV heads only, the other ranks' blocks left stale")  # fmt: skip
            self.disk = DiskPrefixCache.open(config.prefix_cache_dir, config.prefix_cache_gib, model, self.cache,
                                             self.blocks)  # fmt: skip
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else model.config.eos_token_id
        self.scheduler = Scheduler(self.blocks, config.max_running, config.prefill_chunk,
                                   {int(t) for t in eos_token_ids or []}, window=self.runner.window,
                                   speculate=config.speculate, restore=None if self.disk is None else self.disk.restore,
                                   draft_lengths=draft_lengths(any(isinstance(m, QuantizedLinear)
                                                                   for m in model.modules())))  # fmt: skip
        # structured output's grammars, compiled against this tokenizer and the model's logits (needs a tokenizer)
        self.grammars = None if tokenizer is None else Grammars(tokenizer, self.config.vocab_size, self.scheduler.eos)
        self._ids = itertools.count()

    @staticmethod
    def check_model(model: torch.nn.Module) -> None:
        """Raise ``EngineError`` unless the runner for ``model``'s device (``runner_for``) takes it."""
        runner_for(model).check_model(model)

    @property
    def max_running(self) -> int:
        return self.engine_config.max_running

    @property
    def block_size(self) -> int:
        return self.engine_config.block_size

    @property
    def requests(self) -> dict[str, Request]:
        return self.scheduler.requests

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def stats(self) -> EngineStats:
        s, b, d = self.scheduler, self.blocks, self.disk
        graphs = getattr(self.runner, "graphs", None)  # the GPU runner's CUDA graphs
        return EngineStats(len(s.waiting), len(s.running), b.num_blocks, b.num_free, b.block_size, b.prefix_hits,
                           b.prefix_queries, **s.counts, prefix_cache_resumed_hits=b.resumed_hits,
                           prefix_cache_resumed_queries=b.resumed_queries, prefix_cache_disk_hits=d.hits if d else 0,
                           prefix_cache_disk_writes=d.writes if d else 0,
                           cuda_graph_steps=graphs.replays if graphs is not None else 0)  # fmt: skip

    def close(self) -> None:
        """Finish the engine's background work: the prefix cache's files being written."""
        if self.disk is not None:
            self.disk.flush()

    # -- requests --------------------------------------------------------------------------------------------------

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ``EngineError`` for a request that cannot be served: empty, token ids outside the vocabulary, or a
        prompt that does not fit the context or the whole cache with ``max_tokens`` more tokens, or a grammar that does
        not compile. Reads only settings and the grammar cache (safe from any thread)."""
        if not prompt:
            raise EngineError("the prompt is empty")
        V = self.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            raise EngineError(f"token ids must be in [0, {V})")
        outside = [t for t, _ in params.logit_bias if t >= V]
        if outside:
            raise EngineError(f"logit_bias names token ids outside the vocabulary of {V}: {outside[:5]}", "logit_bias")
        outside = [t for t in params.stop_token_ids if t >= V]
        if outside:
            raise EngineError(
                f"stop_token_ids names token ids outside the vocabulary of {V}: {outside[:5]}", "stop_token_ids"
            )
        if params.structured is not None:
            self.compile(params)
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

    def compile(self, params: SamplingParams) -> None:
        """Compile ``params.structured`` (cached: a second call is cheap; safe from any thread); ``EngineError`` for
        one that does not compile, or when the engine has no tokenizer to compile it against."""
        if self.grammars is None:
            raise EngineError("structured output needs the engine's tokenizer")
        try:
            self.grammars.compile(params.structured)
        except ValueError as e:
            raise EngineError(str(e)) from e

    def add(self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None) -> Request:
        """Queue a request for token ids ``prompt``; it joins the running batch at the next ``step``. Raises
        ``EngineError`` (before any work) where ``check`` does, or for a ``request_id`` in use (``Scheduler.add``)."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt]
        self.check(prompt, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        r = Request(request_id, prompt, params, tokens=list(prompt))
        if not params.greedy:
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            r.generator = torch.Generator().manual_seed(seed)
        if self.tokenizer is not None:
            r.text = TextStream(self.tokenizer.decode, params.stop)
        if params.structured is not None:
            r.grammar = self.grammars.state(params.structured, params.stop_token_ids)
        self.scheduler.add(r)
        return r

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (its blocks go back to the pool); ``None`` if it is unknown or already done."""
        return self.scheduler.abort(request_id)

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """End a request with an error (its blocks go back); ``None`` if it is unknown or already done."""
        return self.scheduler.fail(request_id, error)

    def fail_step(self, error: str) -> list[RequestOutput]:
        """End the requests of a step that raised (``Scheduler.fail_step``)."""
        return self.scheduler.fail_step(error)

    # -- the step ----------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One iteration — schedule, run, sample, update; the outputs it produced. If the batch's call raises, each
        request runs alone, and the ones that still raise fail alone."""
        if self.disk is not None:
            self.disk.collect()  # blocks written to disk since the last step go back before admission
        batch = self.scheduler.schedule()
        outputs, self.scheduler.failed = self.scheduler.failed, []  # admissions that failed
        if not batch:
            return outputs
        try:
            groups = [(batch.work, self._forward(batch.work))]
        except Exception:
            groups = []
            for item in batch.work:
                try:
                    groups.append(([item], self._forward([item])))
                except Exception as e:  # the request fails alone; the engine serves on
                    outputs.append(self.scheduler.finish(item[0], "error", error=f"{type(e).__name__}: {e}"))
        with one_thread():
            return outputs + self._choose(groups)

    def _choose(self, groups: list) -> list[RequestOutput]:
        """The tokens of the rows the model ran (``groups``: ``(work, (logits, greedy))``), the requests updated."""
        outputs: list[RequestOutput] = []
        # (request, its greedy token — tokens after a draft — or None when sampled, the logits it chooses from)
        picked: list[tuple[Request, int | list[int] | None, torch.Tensor | None]] = []
        for items, (logits, greedy) in groups:
            row = 0  # a request's first logits row: it has one, and one more per draft token
            for r in self.scheduler.fed(items):
                if self.disk is not None and not r.outputs:  # its prompt is read: its full blocks go to disk
                    self.disk.save(r.table, len(r.prompt))
                if r.draft:
                    picked.append((r, accepted(r.draft, greedy[row : row + len(r.draft) + 1].tolist()), None))
                elif r.grammar is not None and self._grammar_keeps_greedy(r, int(greedy[row])):
                    picked.append((r, int(greedy[row]), logits[row]))
                elif r.params.adjusts_logits:
                    picked.append((r, None, adjusted(r, logits[row], self.scheduler.eos)))
                else:  # the kernel's argmax is the greedy token
                    picked.append((r, int(greedy[row]) if r.params.greedy else None, logits[row]))
                row += 1 + len(r.draft)
        drawn = iter(sample_rows([(r, x) for r, token, x in picked if token is None]))
        sampled, tokens = [], []
        for r, token, x in picked:
            token = next(drawn) if token is None else token
            if not isinstance(token, Exception) and r.grammar is not None and not r.grammar.accept(token):
                token = EngineError(f"token {token} is outside the request's grammar")
            if isinstance(token, Exception):
                outputs.append(self.scheduler.finish(r, "error", error=f"{type(token).__name__}: {token}"))
            else:
                sampled.append(r)
                tokens.append(token)
                if r.params.logprobs is not None:
                    r.logprobs.append(token_logprob(r, x, token))
        return outputs + self._sampled(sampled, tokens)

    @staticmethod
    def _grammar_keeps_greedy(r: Request, token: int) -> bool:
        """Whether a greedy request whose only adjustment is its grammar takes the kernel's argmax ``token`` as is:
        when the grammar allows it, it is also the argmax of the masked logits (masking only removes tokens), so the
        row's float copy, mask and argmax are not needed."""
        p = r.params
        plain = p.greedy and p.logprobs is None and not p.penalizes and len(r.outputs) >= p.min_tokens
        return plain and r.grammar.allows(token)

    def _forward(self, work: list[tuple[Request, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.runner.forward(work)

    def _sampled(self, batch: list[Request], tokens: list[int | list[int]]) -> list[RequestOutput]:
        return self.scheduler.update(batch, tokens)


@contextmanager
def one_thread() -> Iterator[None]:
    """This thread's torch ops without intra-op threads. The per-row work after a step (a row's logits to float32, a
    grammar's mask, the stacks sampling takes) is tiny, and on a busy CPU — the server's own clients, another process
    — each op's fork/join of two threads costs milliseconds: a ``(16, 49152)`` bfloat16 -> float32 copy took 5.7 ms
    with two threads beside another process and 0.23 ms with one. OpenMP's thread count is per thread: the native call
    and other threads keep theirs."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def runner_for(model: torch.nn.Module) -> type:
    """The runner class for ``model``'s device: the native CPU one (``runner.ModelRunner``), or on CUDA the Triton
    one (``triton_runner.TritonModelRunner``)."""
    if model.device.type == "cuda":
        from .triton_runner import TritonModelRunner

        return TritonModelRunner
    return ModelRunner
