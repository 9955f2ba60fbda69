"""The serving engine against independent references: HF transformers' greedy generation on the same weights, each
request served alone, and the block pool's free count after every kind of ending."""

from __future__ import annotations

import os

import pytest
import torch

import gqa
from gqa import kernels
from gqa.serve.engine import Engine, EngineError
from gqa.serve.sampling import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Qwen2 (H_q=6, H_kv=2, head_dim 16, q/k/v biases) saved by HF, and HF's own model."""
    path = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=160, hidden_size=72, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=5000.0, eos_token_id=3,
        bos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    ref = transformers.Qwen2ForCausalLM(config).eval()
    ref.save_pretrained(path, safe_serialization=True)
    return path, ref


def run(engine: Engine, prompts, params) -> dict[str, list[int]]:
    """Serve every prompt to completion; each request's output tokens."""
    ids = [engine.add(p, params).request_id for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(10_000):
        if not engine.has_work:
            break
        for o in engine.step():
            out[o.request_id] += o.token_ids
    assert not engine.has_work
    return [out[i] for i in ids]


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                           pad_token_id=0)  # fmt: skip
    return ids[0, len(prompt) :].tolist()


PROMPTS = [[5, 9, 17, 33, 2, 8, 100, 41, 7], [11], [7] * 40 + [12, 13], list(range(20, 90))]


@pytest.mark.parametrize("block_size", [16, 4])
def test_greedy_responses_equal_hf_and_each_request_alone(tiny, block_size):
    """Four prompts (1 to 70 tokens, chunked prefill of 32) decoded together through the paged step give HF's
    greedy tokens, and the same tokens as each prompt served alone."""
    path, ref = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = Engine(model, kv_cache_mib=1, block_size=block_size, prefill_chunk=32)
    free = engine.blocks.num_free
    together = run(engine, PROMPTS, params)
    assert engine.blocks.num_free == free
    for prompt, tokens in zip(PROMPTS, together, strict=True):
        assert tokens == hf_greedy(ref, prompt, 12)
        assert run(Engine(model, kv_cache_mib=1, block_size=block_size, prefill_chunk=32), [prompt], params) == [tokens]


def test_preemption_recomputes_and_changes_nothing(tiny):
    """A pool too small for every request at once: requests are preempted and recomputed, and every response is
    still HF's greedy one; all blocks come back."""
    path, ref = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    engine = Engine(model, kv_cache_mib=2 * 2 * 2 * 16 * 4 * 4 * 12 / 2**20, block_size=4, prefill_chunk=16)
    assert engine.blocks.num_blocks == 12  # 48 slots for 4 requests of up to 86 tokens
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [[5, 9, 17, 33, 2, 8], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47], [60, 61]]
    out = run(engine, prompts, params)
    assert engine.stats["preemptions"] > 0
    for prompt, tokens in zip(prompts, out, strict=True):
        assert tokens == hf_greedy(ref, prompt, 10)
    assert engine.blocks.num_free == 12


def test_prefix_cache_shares_blocks_and_gives_the_same_tokens(tiny):
    path, ref = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    engine = Engine(model, kv_cache_mib=1, block_size=8, prefill_chunk=16)
    system = list(range(30, 78))  # 48 tokens: 6 full blocks, 3 whole chunks
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = run(engine, [[*system, 5, 6]], params)[0]
    hits = engine.blocks.prefix_hits
    second = run(engine, [[*system, 7, 8, 9]], params)[0]
    assert engine.blocks.prefix_hits - hits == 6
    assert first == hf_greedy(ref, [*system, 5, 6], 6)
    assert second == hf_greedy(ref, [*system, 7, 8, 9], 6)


def test_seeded_sampling_is_reproducible_per_request(tiny):
    path, _ = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    engine = Engine(model, kv_cache_mib=1)
    a = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    b = SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True)
    first = run(engine, [[5, 6, 7], [5, 6, 7]], a)
    assert first[0] == first[1]  # same seed, same tokens, side by side
    assert run(engine, [[5, 6, 7], [9]], a)[0] == first[0]  # and beside another request
    assert run(engine, [[5, 6, 7]], b)[0] != first[0]


def test_sampled_rows_are_drawn_in_one_call_per_setting_and_each_gets_its_own_token(tiny, monkeypatch):
    """Rows sampled with the same settings share one ``sample_next`` call, each inverting its own request's next
    uniform number: every request gets the tokens it gets served alone. A row whose logits cannot be sampled (NaN)
    fails alone."""
    from gqa.serve import engine as engine_module

    path, _ = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    engine = Engine(model, kv_cache_mib=1)
    nucleus = dict(max_tokens=10, temperature=1.0, top_p=0.9, ignore_eos=True)
    settings = [
        SamplingParams(**nucleus, seed=7), SamplingParams(max_tokens=10, temperature=0.7, top_k=20, seed=9,
        ignore_eos=True), SamplingParams(**nucleus, seed=8), SamplingParams(max_tokens=10, ignore_eos=True),
    ]  # fmt: skip
    prompts = [[5, 6, 7], [9, 10], [5, 6, 7], [11]]
    alone = [run(engine, [p], sp)[0] for p, sp in zip(prompts, settings, strict=True)]
    assert alone[0] != alone[2]  # same prompt, another seed: else the per-request numbers were not tested
    real, calls = engine_module.sample_next, []
    monkeypatch.setattr(engine_module, "sample_next", lambda x, **kw: calls.append(len(x)) or real(x, **kw))
    requests = [engine.add(p, sp) for p, sp in zip(prompts, settings, strict=True)]
    engine.step()
    assert sorted(calls) == [1, 2]  # the two nucleus rows together, the top-k row; the greedy row needs none
    while engine.has_work:
        engine.step()
    assert [r.outputs for r in requests] == alone

    real_forward = engine._forward

    def nan_row(work):  # the first request's logits turn NaN
        logits, greedy = real_forward(work)
        logits[0] = float("nan")
        return logits, greedy

    monkeypatch.setattr(engine, "_forward", nan_row)
    requests = [engine.add(p, sp) for p, sp in zip(prompts[:3], settings[:3], strict=True)]
    failed = [o for o in engine.step() if o.finished]
    assert [o.request_id for o in failed] == [requests[0].request_id] and "finite" in failed[0].error
    monkeypatch.setattr(engine, "_forward", real_forward)
    while engine.has_work:
        engine.step()
    assert [r.outputs for r in requests[1:]] == alone[1:3]


def test_bad_requests_are_refused_before_any_work(tiny):
    path, _ = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    engine = Engine(model, kv_cache_mib=0.05, block_size=16)
    with pytest.raises(EngineError, match="exceed the model's context of 256"):
        engine.add(list(range(5, 105)) * 2, SamplingParams(max_tokens=100))
    with pytest.raises(EngineError, match="need more than the KV cache's"):
        engine.add([5] * 100, SamplingParams(max_tokens=100))
    with pytest.raises(EngineError, match=r"token ids must be in \[0, 160\)"):
        engine.add([5, 160])
    with pytest.raises(EngineError, match="empty"):
        engine.add([])
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0.0)
    assert not engine.has_work


def test_abort_and_a_failing_request_release_their_blocks(tiny, monkeypatch):
    path, _ = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    engine = Engine(model, kv_cache_mib=1, block_size=4)
    free = engine.blocks.num_free
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    keep = engine.add([5, 6, 7], params)
    gone = engine.add([8, 9, 10, 11, 12], params)
    kept = []

    def step():
        outs = engine.step()
        kept.extend(t for o in outs if o.request_id == keep.request_id for t in o.token_ids)
        return outs

    step()
    step()
    assert engine.blocks.num_free < free
    out = engine.abort(gone.request_id)
    assert out.finished and out.finish_reason == "abort"
    real = engine._forward

    def broken(work):  # a call that holds the bad request's rows raises: the others are served, it fails alone
        if any(r.prompt == [99, 98] for r, _, _ in work):
            raise RuntimeError("boom")
        return real(work)

    monkeypatch.setattr(engine, "_forward", broken)
    bad = engine.add([99, 98], params)
    failed = [o for o in step() if o.request_id == bad.request_id]
    assert failed[0].finish_reason == "error" and "boom" in failed[0].error
    while engine.has_work:
        step()
    assert len(kept) == 50 and engine.blocks.num_free == free


def test_offline_llm_generates_a_batch_in_order(tiny):
    from gqa.serve import LLM

    path, ref = tiny
    llm = LLM(path, dtype=torch.float32, kv_cache_mib=1)
    params = [SamplingParams(max_tokens=5, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True)]
    done = llm.generate([[5, 9, 17], [11, 12]], params)
    assert [c.token_ids for c in done] == [hf_greedy(ref, [5, 9, 17], 5), hf_greedy(ref, [11, 12], 3)]
    assert [c.finish_reason for c in done] == ["length", "length"]
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[5]], params)
