"""Fault injection: the model's forward, the sampler, the tokenizer's decoding and block allocation raise now and then
while 48 requests (greedy and sampled, some abandoned by their consumer) are served together through a pool small
enough to preempt. No request waits unbounded, each ends in an answer or an error of its own, the engine thread
lives on, a fault fails one request at most (not the batch it was in), every block comes back, and afterwards a
request is answered exactly as on a fresh engine."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gqa import kernels
from gqa.serve import LLM, SamplingParams
from gqa.serve.async_engine import AsyncEngine

pytestmark = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")

FAULTS = ("forward", "sample", "decode", "allocate")


class Faults:
    """Raises ``RuntimeError("injected <where> fault")`` on every ``period[where]``-th call there (counted across
    threads, so each kind is hit however the steps interleave; which request a fault meets depends on the timing);
    counts them."""

    def __init__(self, period: dict[str, int]) -> None:
        self.period, self.lock = period, threading.Lock()
        self.calls, self.raised = dict.fromkeys(FAULTS, 0), dict.fromkeys(FAULTS, 0)
        self.on = True

    def maybe(self, where: str) -> None:
        with self.lock:
            self.calls[where] += 1
            hit = self.on and self.calls[where] % self.period[where] == 0
            if hit:
                self.raised[where] += 1
        if hit:
            raise RuntimeError(f"injected {where} fault")

    def wrap(self, where: str, fn):
        def faulty(*args, **kwargs):
            self.maybe(where)
            return fn(*args, **kwargs)

        return faulty


async def _consume(engine: AsyncEngine, prompt: list[int], params: SamplingParams, leave_after: int | None):
    """A request's outputs (or the exception it raised); ``leave_after``: the consumer leaves after that many."""
    outs = []
    try:
        async for o in engine.generate(prompt, params):
            outs.append(o)
            if leave_after is not None and len(outs) >= leave_after:
                break
    except Exception as e:
        return e
    return outs


def test_random_faults_never_hang_a_request_nor_lose_a_block(monkeypatch):
    import gqa.serve.sampler as sampler

    llm = LLM(kv_cache_mib=6, block_size=8, max_running=12, prefill_chunk=16)
    engine, tokenizer = llm.engine, llm.tokenizer
    prompts = [tokenizer.encode(f"Story {i}: once upon a time there was a {w}") for i, w in
               enumerate(["dragon", "king", "ship", "cat"] * 12)]  # fmt: skip
    reference = llm.generate(prompts[0], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    faults = Faults({"forward": 13, "sample": 7, "decode": 41, "allocate": 11})
    monkeypatch.setattr(engine.runner, "forward", faults.wrap("forward", engine.runner.forward))
    monkeypatch.setattr(sampler, "sample_next", faults.wrap("sample", sampler.sample_next))
    monkeypatch.setattr(tokenizer, "decode", faults.wrap("decode", tokenizer.decode))
    monkeypatch.setattr(engine.blocks, "allocate", faults.wrap("allocate", engine.blocks.allocate))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    try:
        jobs = []
        for i, prompt in enumerate(prompts):
            sampled = i % 2 == 1
            params = SamplingParams(max_tokens=12 + i % 5, ignore_eos=True, temperature=0.8 if sampled else 0.0,
                                    seed=i if sampled else None)  # fmt: skip
            jobs.append((prompt, params, 3 if i % 6 == 5 else None))

        async def every():
            return await asyncio.wait_for(asyncio.gather(*(_consume(async_engine, *job) for job in jobs)), 300)

        results = asyncio.run(every())  # a hang fails here (TimeoutError), not in a stuck test
        assert all(faults.raised[where] > 0 for where in FAULTS), faults.raised  # every kind was hit
        answered = failed = 0
        for (_, params, leave_after), result in zip(jobs, results, strict=True):
            if isinstance(result, Exception):  # refused at admission: its own error
                assert "injected" in str(result), result
                failed += 1
            elif result[-1].finished and result[-1].finish_reason == "error":
                assert "injected" in result[-1].error
                failed += 1
            elif leave_after is None:
                assert result[-1].finish_reason == "length"
                assert sum(len(o.token_ids) for o in result) == params.max_tokens
                answered += 1
        assert answered > 0 and failed > 0, (answered, failed)
        assert failed <= sum(faults.raised.values()), (failed, faults.raised)  # a fault fails one request at most
        faults.on = False
        for _ in range(200):  # the abandoned requests' aborts reach the engine thread
            if async_engine.in_flight == 0 and not engine.has_work:
                break
            asyncio.run(asyncio.sleep(0.05))
        assert async_engine.alive and async_engine.in_flight == 0 and not engine.has_work
        assert engine.blocks.num_free == engine.blocks.num_blocks
        again = asyncio.run(_consume(async_engine, prompts[0], SamplingParams(max_tokens=12, ignore_eos=True), None))
        assert [t for o in again for t in o.token_ids] == reference
    finally:
        async_engine.stop()
