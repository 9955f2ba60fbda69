"""Who runs in a step, and what happens to each request after it: admission, prompt chunks, finishing, preemption.

``schedule()`` admits waiting requests while blocks and batch slots last (each gets a block table that shares the
cached blocks of its longest cached prefix; ``restore`` may fill the blocks after them, from disk) and returns a
``ScheduledBatch``: the token range to feed per request — the newest token of every decoding request, and the next
rows of the prompts still being read (at most ``prefill_chunk`` prompt tokens per step while others decode, four
times that while none does). After the model ran the batch, ``fed(batch)`` records what is in the pool now and names
the requests that want a token; ``update(requests, tokens)`` appends their tokens, finishes the ones that are done
(their blocks go back) and reserves the next slot of the rest — preempting the most recently admitted request while
no block is free: its blocks are freed and it waits at the front of the queue, to be recomputed from its prompt and
the tokens it already produced.

No tensors and no model here: the scheduler is tested on its own (tests/serve/test_serve_scheduler.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .blocks import BlockManager, BlockTable, OutOfBlocks
from .request import EngineError, Request, RequestOutput, RequestState
from .speculation import LENGTHS, MAX_DRAFTING, MIN_DRAFT, DraftLengths

__all__ = ["ScheduledBatch", "Scheduler"]

WAITING, PREFILL, DECODE, FINISHED = RequestState


@dataclass
class ScheduledBatch:
    """One step's work: ``(request, start, end)``, feed the request's tokens ``[start, end)``; decoding requests
    first, then prompt chunks. A request fed up to its last token gets logits."""

    work: list[tuple[Request, int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.work)


class Scheduler:
    """The queue and the running batch of an engine whose KV pool ``blocks`` manages; ``eos``: the token ids that end
    a response."""

    def __init__(
        self, blocks: BlockManager, max_running: int, prefill_chunk: int, eos: set[int], window: int | None = None,
        speculate: int = 0, draft_lengths: DraftLengths = LENGTHS,
        restore: Callable[[BlockTable], object] | None = None,
    ) -> None:  # fmt: skip
        self.blocks, self.max_running, self.prefill_chunk, self.eos = blocks, max_running, prefill_chunk, eos
        self.window = window  # every layer's query sees at most this many keys to its left: older blocks go back
        self.speculate = speculate  # draft tokens per greedy request and step at most (speculation.py)
        self.draft_lengths = draft_lengths  # a draft's lengths (speculation.draft_lengths)
        self.restore = restore  # fills more of an admitted table's leading blocks (from disk: prefix_disk)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.counts = {"prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0, "steps": 0, "draft_tokens": 0,
                       "draft_tokens_accepted": 0}  # fmt: skip
        self.failed: list[RequestOutput] = []  # requests that failed while being admitted, for the step to hand out

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, r: Request) -> None:
        """Queue ``r``: it joins the running batch at the next ``schedule``."""
        if r.request_id in self.requests:
            raise EngineError(f"request id {r.request_id!r} is already in use")
        self.requests[r.request_id] = r
        self.waiting.append(r)

    # -- a step ------------------------------------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Admit what fits, then this step's rows: every decoding request's newest token and the next prompt chunks."""
        self.counts["steps"] += 1
        self._admit()
        work = []
        drafting = self.speculate and sum(r.state is DECODE for r in self.running) <= MAX_DRAFTING
        for r in self.running:
            if r.state is DECODE:
                r.draft = self._draft(r) if drafting else []
                work.append((r, r.computed, len(r.tokens) + len(r.draft)))
        budget = self.prefill_chunk if work else 4 * self.prefill_chunk
        for r in self.running:
            if r.state is PREFILL and budget > 0:
                end = min(len(r.tokens), r.computed + budget)
                work.append((r, r.computed, end))
                budget -= end - r.computed
        return ScheduledBatch(work)

    def _admit(self) -> None:
        """Admit waiting requests in order while they fit. Beside running requests a new one must leave a block free
        for each of them and itself (its next slot may need one): admitting into the last free blocks would preempt
        a request at the next step's boundary and throw its prompt's work away. Alone, a request takes what there is."""
        while self.waiting and len(self.running) < self.max_running:
            r = self.waiting[0]
            try:
                keep = len(self.running) + 1 if self.running else 0
                r.table = self.blocks.allocate(r.tokens, keep_free=keep, resumed=r.preemptions > 0)
            except OutOfBlocks:
                return  # blocks come back as running requests finish
            except Exception as e:  # a fault admitting this request: it fails alone (its output at the next step)
                self.failed.append(self.finish(r, "error", error=f"{type(e).__name__}: {e}"))
                continue
            self.waiting.popleft()
            r.table.tokens = r.tokens  # one list: the table hashes the tokens its full blocks hold
            r.state = PREFILL
            self.running.append(r)
            if self.restore is not None:  # running first: should it raise, the step's failure frees the blocks
                self.restore(r.table)
            r.computed = r.table.cached_tokens

    def _draft(self, r: Request) -> list[int]:
        """Tokens to verify after ``r``'s newest one this step (prompt lookup), their slots reserved; none unless
        speculation is on and ``r`` decodes greedily from plain logits (no window: its blocks go back as it slides)."""
        p = r.params
        if self.window is not None or not p.greedy or p.adjusts_logits or p.logprobs is not None:
            return []
        k = min(r.drafting.wanted(self.speculate, self.draft_lengths), p.max_tokens - len(r.outputs) - 1)
        draft = r.drafting.propose(r.tokens, k) if k else []
        if len(draft) < min(k, MIN_DRAFT):
            draft = []
        if draft:
            try:
                self.blocks.reserve(r.table, len(r.tokens) + len(draft))
            except OutOfBlocks:  # a draft never preempts anyone
                return []
            self.counts["draft_tokens"] += len(draft)
        return draft

    def fed(self, work: list[tuple[Request, int, int]]) -> list[Request]:
        """Record that ``work``'s tokens are in the pool now (a draft's count once accepted, in ``update``); the
        requests fed up to their last token (they want a token next — after each draft token too), in order."""
        wanting = []
        for r, _, end in work:
            end = min(end, len(r.tokens))
            r.computed = end
            self.blocks.computed(r.table, end)
            if self.window is not None:  # the next query (position end) reads from end - window on
                self.blocks.release_before(r.table, end - self.window)
            if end < len(r.tokens):
                continue  # a prompt chunk that does not reach the prompt's end: no logits
            if r.state is PREFILL:
                r.state = DECODE
                self.counts["prompt_tokens"] += len(r.prompt) if not r.preemptions else 0
            wanting.append(r)
        return wanting

    def update(self, batch: list[Request], tokens: list[int | list[int]]) -> list[RequestOutput]:
        """Each request's new token (or tokens: its accepted draft and the token after it): outputs, finished
        requests released, a block for the next slot of the rest (preempting the latest admitted requests when none
        is free)."""
        outputs = []
        for r, new in zip(batch, tokens, strict=True):
            if r.draft:
                self.counts["draft_tokens_accepted"] += len(new) - 1
                r.drafting.verified(len(r.draft), len(new) - 1, self.draft_lengths)
                r.draft = []
            if r.state is FINISHED:
                continue
            try:
                outputs.append(self._advance(r, [new] if isinstance(new, int) else new))
            except Exception as e:  # e.g. the detokenizer raising on this request's tokens: it fails alone
                outputs.append(self.finish(r, "error", error=f"{type(e).__name__}: {e}"))
        for r in batch:
            if r.state is DECODE:
                self._reserve_slot(r)
        return outputs

    def _advance(self, r: Request, new: list[int]) -> RequestOutput:
        """``r``'s ``new`` tokens (an accepted draft's, then one more): its output, and its end when a token, the text
        or ``max_tokens`` ends it (the tokens after that are dropped)."""
        pieces: list[str] = []
        for i, token in enumerate(new):
            r.outputs.append(token)
            r.tokens.append(token)
            self.counts["generation_tokens"] += 1
            # an end-of-sequence or stop token, or the grammar's end (which is one of those), ends the response
            eos = (token in self.eos and not r.params.ignore_eos) or token in r.params.stop_token_ids
            eos = eos or (r.grammar is not None and r.grammar.complete)
            if eos and r.logprobs:  # the end of the answer is no token of it
                r.logprobs.pop()
            if r.text is not None:
                pieces.append(r.text.update(r.outputs[:-1] if eos else r.outputs, final=eos))
            if eos or (r.text is not None and r.text.stopped):
                return self.finish(r, "stop", tokens=new[: i + 1], piece="".join(pieces))
            if len(r.outputs) >= r.params.max_tokens:
                if r.text is not None:
                    pieces.append(r.text.update(r.outputs, final=True))
                return self.finish(r, "length", tokens=new[: i + 1], piece="".join(pieces))
        if len(new) > 1:  # the accepted draft tokens' K/V are in the pool: the newest token is the next to feed
            r.computed += len(new) - 1
            self.blocks.computed(r.table, r.computed)
        return self.output(r, new, "".join(pieces))

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
        self.counts["preemptions"] += 1
        self.waiting.appendleft(r)

    # -- endings -----------------------------------------------------------------------------------------------------

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now (its blocks go back to the pool); ``None`` if it is unknown or already done."""
        r = self.requests.get(request_id)
        return None if r is None else self.finish(r, "abort")

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """End a request with an error (its blocks go back); ``None`` if it is unknown or already done."""
        r = self.requests.get(request_id)
        return None if r is None else self.finish(r, "error", error=error)

    def fail_step(self, error: str) -> list[RequestOutput]:
        """End the requests of a step that raised with ``error``: the running ones (their state is not to be trusted),
        or, where none runs, the one being admitted (the head of the queue); the other waiting ones stay queued."""
        failing = list(self.running) or list(self.waiting)[:1]
        return [self.finish(r, "error", error=error) for r in failing]

    def finish(
        self, r: Request, reason: str, *, tokens: list[int] | None = None, piece: str = "", error: str | None = None
    ) -> RequestOutput:
        """End ``r`` with ``reason``: its blocks go back, it leaves the queue or the batch; its last output (``tokens``:
        the new ones it carries)."""
        if r.table is not None and r.state in (PREFILL, DECODE):
            self.blocks.free(r.table)
        if r in self.running:
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        r.state, r.finish_reason, r.table = FINISHED, reason, None
        del self.requests[r.request_id]
        return self.output(r, tokens or [], piece, error)

    @staticmethod
    def output(r: Request, token_ids: list[int], piece: str, error: str | None = None) -> RequestOutput:
        logprobs = None
        if r.params.logprobs is not None:
            logprobs, r.logprobs_sent = r.logprobs[r.logprobs_sent :], len(r.logprobs)
        return RequestOutput(r.request_id, token_ids, piece, r.state is FINISHED, r.finish_reason, len(r.prompt),
                             len(r.outputs), error, logprobs)  # fmt: skip
