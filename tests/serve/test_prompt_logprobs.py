"""The prompt's own logprobs (``serve.prompt_logprobs``, completions' echo with logprobs) against transformers' float32
log-softmax, in chunks shorter than the prompt; and ``AsyncEngine.run_in_engine``, which runs it in the engine thread:
a result, an error that stays the caller's, and an engine that serves on."""

from __future__ import annotations

import asyncio

import pytest
import torch

import gqa
from gqa.serve import prompt_logprobs as scoring
from gqa.serve.async_engine import AsyncEngine, EngineStopped
from gqa.serve.engine import Engine
from gqa.serve.sampling import SamplingParams
from tests.helpers.serving import hf_greedy, tiny_qwen2

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    return path, tiny_qwen2(path)


@pytest.mark.parametrize("chunk", [3, 256])
def test_prompt_logprobs_are_transformers_log_softmax(tiny, monkeypatch, chunk):
    path, ref = tiny
    monkeypatch.setattr(scoring, "CHUNK", chunk)  # 3: the prompt in 7 chunks through the cache
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    ids = [5, 9, 17, 33, 2, 8, 100, 41, 7, 11, 12, 13, 150, 3, 60, 61, 62, 99, 1, 4]
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)  # (L, vocab)
    entries = scoring.prompt_logprobs(model, ids, top=4)
    assert entries[0] == (ids[0], None, None) and [e[0] for e in entries] == ids
    for i in range(1, len(ids)):
        _, logprob, alternatives = entries[i]
        assert logprob == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-4)
        values, tokens = want[i - 1].topk(4)
        assert [a for a, _ in alternatives] == tokens.tolist()
        assert [v for _, v in alternatives] == pytest.approx(values.tolist(), abs=1e-4)
    assert scoring.prompt_logprobs(model, ids[:1], top=2) == [(ids[0], None, None)]
    assert all(alts == () for _, _, alts in scoring.prompt_logprobs(model, ids, top=0)[1:])


def test_run_in_engine_gives_results_and_errors_and_the_engine_serves_on(tiny):
    path, ref = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    engine = AsyncEngine(Engine(model, kv_cache_mib=1))

    async def scenario():
        engine.start()
        try:
            entries = await engine.run_in_engine(lambda e: scoring.prompt_logprobs(e.runner.model, [5, 9, 17], 1))
            assert len(entries) == 3
            with pytest.raises(ZeroDivisionError):
                await engine.run_in_engine(lambda e: 1 / 0)
            out = [o async for o in engine.generate([5, 9, 17], SamplingParams(max_tokens=4, ignore_eos=True))]
            assert [t for o in out for t in o.token_ids] == hf_greedy(ref, [5, 9, 17], 4)
        finally:
            engine.stop()
        with pytest.raises(EngineStopped):
            await engine.run_in_engine(lambda e: None)

    asyncio.run(asyncio.wait_for(scenario(), 60))
