"""The serving engine against independent references: HF transformers' greedy generation on the same weights, each
request served alone, and the block pool's free count after every kind of ending."""

from __future__ import annotations

import os
import time

import pytest
import torch

import gqa
from gqa import kernels
from gqa.serve import engine as engine_module
from gqa.serve.engine import Engine, EngineError
from gqa.serve.sampling import SamplingParams
from gqa.serve.speculation import LANE_LENGTHS
from tests.helpers.serving import hf_greedy, serve_all, tiny_qwen2

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Qwen2 (H_q=6, H_kv=2, head_dim 16, q/k/v biases) saved by HF, and HF's own model."""
    path = tmp_path_factory.mktemp("tiny")
    return path, tiny_qwen2(path)


run = serve_all


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


def _penalized_greedy(ref, prompt: list[int], n: int, frequency: float, presence: float) -> list[int]:
    """Greedy tokens with OpenAI's penalties written out on HF's logits: each step, the logit of every token generated
    so far loses ``count * frequency + presence``."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = ref(torch.tensor([tokens])).logits[0, -1].double()
            counts = torch.bincount(torch.tensor(tokens[len(prompt) :], dtype=torch.long), minlength=logits.shape[0])
            logits -= counts * frequency + (counts > 0) * presence
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def test_penalties_and_logit_bias_match_their_references_together_and_alone(tiny):
    """Greedy requests with a repetition penalty (HF's ``repetition_penalty``), a logit bias (HF's ``sequence_bias``),
    frequency/presence penalties (written out on HF's logits) and none, decoded in one batch: each equals its
    reference and the same request alone; the penalties change the tokens (a test that could not fail is none)."""
    path, ref = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    prompt, n = [7] * 6 + [12, 13], 16
    plain = hf_greedy(ref, prompt, n)
    favoured = plain[0] + 1
    cases = [
        (SamplingParams(max_tokens=n, ignore_eos=True), plain),
        (SamplingParams(max_tokens=n, ignore_eos=True, repetition_penalty=1.8),
         ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, repetition_penalty=1.8,
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()),
        (SamplingParams(max_tokens=n, ignore_eos=True, logit_bias=((favoured, 3.0),)),
         ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, sequence_bias={(favoured,): 3.0},
                      eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()),
        (SamplingParams(max_tokens=n, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
         _penalized_greedy(ref, prompt, n, 1.5, 0.5)),
    ]  # fmt: skip
    assert all(want != plain for _, want in cases[1:]), "a penalty that changes nothing tests nothing"
    engine = Engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=32)
    ids = [engine.add(prompt, params).request_id for params, _ in cases]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_work:
        for o in engine.step():
            out[o.request_id] += o.token_ids
    for i, (params, want) in zip(ids, cases, strict=True):
        assert out[i] == want, params
        assert run(Engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=32), [prompt], params) == [want]


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
    assert engine.stats().preemptions > 0
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
    from gqa.serve import sampler as sampler_module

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
    real, calls = sampler_module.sample_next, []
    monkeypatch.setattr(sampler_module, "sample_next", lambda x, **kw: calls.append(len(x)) or real(x, **kw))
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
    for seed in (2**64, -(2**63) - 1, 1.5, True):  # what torch.Generator.manual_seed cannot take, or not an integer
        with pytest.raises(ValueError, match="seed must be an integer in"):
            SamplingParams(temperature=1.0, seed=seed)
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


# -- the engine thread: never dies of a request, never leaves one waiting ---------------------------------------------


def serve_async(async_engine, jobs, timeout: float = 60.0) -> list:
    """Run ``(prompt, params)`` jobs through ``async_engine`` concurrently: per job its outputs, or the exception it
    raised. A job still waiting after ``timeout`` seconds fails the test (a hang, not an answer)."""
    import asyncio

    async def one(prompt, params):
        outs = []
        try:
            async for o in async_engine.generate(prompt, params):
                outs.append(o)
        except Exception as e:
            return e
        return outs

    async def every():
        return await asyncio.wait_for(asyncio.gather(*(one(p, sp) for p, sp in jobs)), timeout)

    return asyncio.run(every())


@pytest.fixture
def async_engine(tiny):
    from gqa.serve.async_engine import AsyncEngine

    path, _ = tiny
    engine = Engine(gqa.load_model(path, dtype=torch.float32, tokenizer=False), kv_cache_mib=1, max_running=1)
    ae = AsyncEngine(engine)
    ae.start()
    yield ae
    ae.stop()


def test_a_step_that_raises_fails_its_requests_and_the_engine_serves_on(async_engine, monkeypatch):
    """An arbitrary exception in a step (here a ``KeyError`` while the first request decodes, the second waiting for
    the one running slot) fails the running request; the waiting one is then served in full, and so is a later one."""
    engine = async_engine.engine
    real, calls = engine._sampled, []

    def flaky(batch, tokens):
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("boom")
        return real(batch, tokens)

    monkeypatch.setattr(engine, "_sampled", flaky)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first, second = serve_async(async_engine, [([5, 6, 7], params), ([8, 9], params)])
    assert first[-1].finish_reason == "error" and "KeyError" in first[-1].error and len(first) == 3
    assert second[-1].finish_reason == "length" and sum(len(o.token_ids) for o in second) == 6
    assert serve_async(async_engine, [([10, 11], params)])[0][-1].finish_reason == "length"
    assert async_engine.alive and async_engine.errors == 1 and engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize(("handling", "handover"), [(0.003, 0.5), (0.2, None)])
def test_the_next_step_waits_for_the_consumer_to_take_up_the_last_output_but_not_long(
    async_engine, monkeypatch, handling, handover
):
    """A consumer that spends 3 ms on each output (writing its chunk) sees the next step start only after it asks for
    the next output — a consumer running beside the step's native call would stall one of its threads; one that
    spends 200 ms does not hold the engine back more than ``HANDOVER_SECONDS`` (5 ms) per step."""
    import asyncio
    import itertools
    import time

    from gqa.serve import async_engine as module

    if handover is not None:  # ordering, not the time limit, is what the first case checks (a busy CI machine)
        monkeypatch.setattr(module, "HANDOVER_SECONDS", handover)
    engine = async_engine.engine
    real, starts = engine.step, []

    def step():
        starts.append(time.monotonic())
        return real()

    monkeypatch.setattr(engine, "step", step)
    asked = []  # when the consumer asked for the next output, after handling one

    async def consume():
        async for _ in async_engine.generate([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True)):
            await asyncio.sleep(handling)
            asked.append(time.monotonic())

    asyncio.run(asyncio.wait_for(consume(), 30))
    assert len(asked) >= 7 and len(starts) >= len(asked)
    if handover is not None:  # every step after an output starts once its consumer asked again
        assert all(start >= taken for start, taken in zip(starts[1:], asked[:-1], strict=False))
    else:  # the engine went on without it: its steps ran well before the consumer caught up
        assert starts[len(asked) - 1] < asked[-2]
        assert max(b - a for a, b in itertools.pairwise(starts)) < handling


def test_a_step_that_raises_while_admitting_fails_that_request_alone(async_engine, monkeypatch):
    """A fault in admission (the block manager raising something other than 'out of blocks' for one prompt) fails
    that request; it does not stay at the head of the queue failing every step, and the next request is served."""
    blocks = async_engine.engine.blocks
    real = blocks.allocate

    def allocate(tokens, **kw):
        if tokens[:2] == [99, 98]:
            raise IndexError("bad table")
        return real(tokens, **kw)

    monkeypatch.setattr(blocks, "allocate", allocate)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    bad, good = serve_async(async_engine, [([99, 98, 5], params), ([8, 9], params)])
    assert bad[-1].finish_reason == "error" and "IndexError" in bad[-1].error
    assert good[-1].finish_reason == "length"
    assert async_engine.alive and async_engine.errors == 0  # the scheduler failed the request; no step raised


def test_a_request_the_engine_cannot_add_gets_its_error_and_the_next_is_served(async_engine, monkeypatch):
    """Any exception from ``Engine.add`` (the overflowing seed's ``ValueError`` once killed the thread) goes to that
    request alone."""
    engine = async_engine.engine
    real = engine.add

    def add(prompt, params=None, request_id=None):
        if prompt == [42]:
            raise ValueError("Overflow when unpacking long long")
        return real(prompt, params, request_id)

    monkeypatch.setattr(engine, "add", add)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    bad, good = serve_async(async_engine, [([42], params), ([8, 9], params)])
    assert isinstance(bad, ValueError) and "Overflow" in str(bad)
    assert good[-1].finish_reason == "length" and async_engine.alive


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_requests_get_engine_stopped_at_once_when_the_thread_is_gone(async_engine, monkeypatch):
    """The thread ended by something no handler catches: the request in flight gets ``EngineStopped`` (not a wait
    forever), and so does every later one, before any work."""
    from gqa.serve.async_engine import EngineStopped

    def die():
        raise SystemExit("the thread ends")

    monkeypatch.setattr(async_engine.engine, "step", die)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    [got] = serve_async(async_engine, [([5, 6], params)], timeout=30)
    assert isinstance(got, EngineStopped)
    async_engine._thread.join(10)
    assert not async_engine.alive
    [later] = serve_async(async_engine, [([5, 6], params)], timeout=5)
    assert isinstance(later, EngineStopped) and async_engine.in_flight == 0


async def asgi_call(
    app, method: str, route: str, body: dict | None = None, leave: bool = False
) -> tuple[int, dict | None, dict]:
    """One request through the ASGI ``app`` in this process: status, JSON body (``None`` when empty), headers. The
    client stays until its answer has come, or with ``leave`` disconnects right after sending its body. An exception
    the app re-raises after answering (starlette's last handler does, for the server's log) is swallowed: the answer
    counts."""
    import asyncio
    import json

    scope = {"type": "http", "method": method, "path": route, "raw_path": route.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "root_path": ""}  # fmt: skip
    incoming = [{"type": "http.request", "body": json.dumps(body).encode() if body else b"", "more_body": False}]
    sent, answered = [], asyncio.Event()

    async def receive():  # the body, then the client stays until its answer has come (then leaves)
        if incoming:
            return incoming.pop(0)
        if not leave:
            await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            answered.set()

    try:
        await app(scope, receive, send)
    except Exception:
        if not sent:
            raise
    start = next(m for m in sent if m["type"] == "http.response.start")
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(text) if text else None, {k.decode(): v.decode() for k, v in start["headers"]}


def bounded(coroutine):
    """``coroutine``'s result within 30 s, or the test fails (a request must never wait on no thread)."""
    import asyncio

    return asyncio.run(asyncio.wait_for(coroutine, 30))


def test_the_http_app_answers_503_while_the_engine_is_not_running(tiny):
    """The app's engine thread not running (here: never started): 503 in OpenAI's error shape with Retry-After, and
    /health says so."""
    from gqa.serve.async_engine import AsyncEngine
    from gqa.serve.server import build_app

    path, _ = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    app = build_app(AsyncEngine(Engine(model, kv_cache_mib=1)), None, "tiny")
    status, body, headers = bounded(asgi_call(app, "POST", "/v1/completions", {"model": "tiny", "prompt": [5, 6]}))
    assert status == 503 and body["error"]["type"] == "server_error" and "not running" in body["error"]["message"]
    assert headers["retry-after"] == "1"
    assert bounded(asgi_call(app, "GET", "/health"))[0] == 503


def test_a_bug_in_a_route_is_answered_in_openais_error_shape(tiny, monkeypatch):
    """An exception no handler expected (here: building the whole answer's body, after generation) is a 500 with
    OpenAI's JSON error body naming it — what the openai client reads — not starlette's plain-text 500."""
    import gqa.serve.server as server
    from gqa.serve.async_engine import AsyncEngine

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the answer's body")

    monkeypatch.setattr(server, "completion_body", broken)
    path, _ = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    engine = AsyncEngine(Engine(model, kv_cache_mib=1))
    app = server.build_app(engine, None, "tiny")
    engine.start()
    try:
        request = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2}
        status, body, _ = bounded(asgi_call(app, "POST", "/v1/completions", request))
    finally:
        engine.stop()
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "RuntimeError: a bug in the answer's body" in body["error"]["message"]


def test_a_client_that_leaves_during_its_grammars_compile_is_a_499_and_the_compile_is_left_behind(tiny):
    """A request whose client disconnects while its grammar compiles ends as 499 (client closed request), not as an
    error of the server; the compile goes on to its end on its own thread."""
    import threading

    from gqa.serve.async_engine import AsyncEngine
    from gqa.serve.server import build_app

    class SlowGrammars:  # stands in for ``Grammars``: every spec is taken, and a compile takes 1 s
        def __init__(self) -> None:
            self.compiled = threading.Event()

        def check(self, s) -> None:
            pass

        def find(self, s) -> None:
            return None

        def compile(self, s) -> str:
            time.sleep(1)
            self.compiled.set()
            return "grammar"

    path, _ = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    engine = Engine(model, kv_cache_mib=1)
    engine.grammars = SlowGrammars()
    app = build_app(AsyncEngine(engine), None, "tiny")
    request = {"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "structured_outputs": {"regex": "a+"}}
    status, body, _ = bounded(asgi_call(app, "POST", "/v1/completions", request, leave=True))
    assert status == 499 and body is None
    assert engine.grammars.compiled.wait(10)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=8, ignore_eos=True, logprobs=4),
        SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, temperature=0.7, seed=5),
        SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0, frequency_penalty=1.5, repetition_penalty=1.3),
    ],
    ids=["greedy", "sampled", "penalized"],
)
def test_logprobs_are_the_log_softmax_the_token_was_chosen_from(tiny, params):
    """Each token's logprob (and its alternatives) against HF's float32 logits for the prompt and the answer, the
    penalties applied here as their formulas say and divided by the temperature when sampling; a request that asks
    for none gets the same tokens beside it, and its outputs carry none."""
    path, ref = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    engine = Engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=8)
    prompt = PROMPTS[0]
    plain = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = [engine.add(prompt, params).request_id, engine.add(PROMPTS[2], plain).request_id]
    outs: dict[str, list] = {i: [] for i in ids}
    while engine.has_work:
        for o in engine.step():
            outs[o.request_id].append(o)
    tokens = [t for o in outs[ids[0]] for t in o.token_ids]
    entries = [e for o in outs[ids[0]] for e in o.logprobs]
    assert all(o.logprobs is None for o in outs[ids[1]])
    assert [t for o in outs[ids[1]] for t in o.token_ids] == run(Engine(model, kv_cache_mib=1), [PROMPTS[2]], plain)[0]
    assert [t for t, _, _ in entries] == tokens and len(tokens) == 8
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
    for i, (token, logprob, top) in enumerate(entries):
        x = logits[i].clone()
        seen = prompt + tokens[:i]
        if params.repetition_penalty != 1.0:
            s = torch.tensor(sorted(set(seen)))
            x[s] = torch.where(x[s] > 0, x[s] / params.repetition_penalty, x[s] * params.repetition_penalty)
        counts = torch.bincount(torch.tensor(tokens[:i], dtype=torch.long), minlength=x.shape[0]).double()
        x -= counts * params.frequency_penalty + (counts > 0).double() * params.presence_penalty
        if params.temperature:
            x /= params.temperature
        want = torch.log_softmax(x, -1)
        assert abs(logprob - float(want[token])) < 1e-4, (i, logprob, float(want[token]))
        assert len(top) == params.logprobs
        assert [a for a, _ in top] == want.topk(params.logprobs).indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top], dtype=torch.float64),
                                   want.topk(params.logprobs).values, atol=1e-4, rtol=0)  # fmt: skip


def test_min_tokens_and_stop_token_ids_against_hf_logits(tiny):
    """A stop token id (HF's greedy 4th token) ends the response there, kept in the token ids; with ``min_tokens`` 7
    the end tokens are not chosen before the 7th token: each step is the argmax of HF's logits with them removed,
    and where the end token comes afterwards it ends the response. ``min_tokens`` 0 changes nothing."""
    path, ref = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    prompt = PROMPTS[0]
    plain = hf_greedy(ref, prompt, 12)
    end = plain[3]
    assert end not in plain[:3], "pick a prompt whose 4th greedy token is new"

    def engine(eos=()):
        return Engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=8, eos_token_ids=eos)

    stop = SamplingParams(max_tokens=12, stop_token_ids=(end,))
    assert run(engine(), [prompt], stop) == [plain[:4]]
    assert run(engine(eos=[end]), [prompt], SamplingParams(max_tokens=12, min_tokens=0)) == [plain[:4]]
    tokens = list(prompt)
    with torch.no_grad():
        for i in range(12):
            logits = ref(torch.tensor([tokens])).logits[0, -1].double()
            if i < 7:
                logits[end] = -torch.inf
            tokens.append(int(logits.argmax()))
            if tokens[-1] == end:
                break
    want = tokens[len(prompt) :]
    assert want != plain[:4] and end not in want[:7]
    for params, eos in [(SamplingParams(max_tokens=12, min_tokens=7), [end]),
                        (SamplingParams(max_tokens=12, min_tokens=7, stop_token_ids=(end,)), ())]:  # fmt: skip
        e = engine(eos)
        free = e.blocks.num_free
        assert run(e, [prompt, PROMPTS[2]], params)[0] == want
        assert e.blocks.num_free == free
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(-1,))
    with pytest.raises(EngineError, match="stop_token_ids"):
        engine().add(prompt, SamplingParams(stop_token_ids=(10**6,)))


@pytest.mark.parametrize("lengths", ["gemv", "lanes"])
def test_speculation_gives_hf_greedy_tokens_with_drafts_accepted_and_rejected(tiny, lengths, monkeypatch):
    """``speculate=7``: prompt-lookup drafts verified as extra rows give exactly HF's greedy tokens — for two requests
    decoding together beside a prompt being read in chunks, for a request whose end-of-sequence token comes inside an
    accepted draft, and for one cut by ``max_tokens`` mid-draft; drafts were both accepted and rejected (the test
    exercises both), every block comes back, and a later request that shares the prompt and output from the prefix
    cache (blocks written while drafting) still gets HF's tokens. ``lanes``: the lane kernels' lengths (a 1-token
    probe first: 2-row verifications) on this float model."""
    if lengths == "lanes":
        monkeypatch.setattr(engine_module, "draft_lengths", lambda quantized=True: LANE_LENGTHS)
    path, ref = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    prompts = [[5, 6, 7, 8, 9] * 6 + [5, 6], [3, 1, 4, 1, 5, 9, 2, 6] * 3, list(range(20, 90))]
    want = [hf_greedy(ref, p, 40) for p in prompts]
    engine = Engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=8, speculate=7)
    free = engine.blocks.num_free
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    assert run(engine, prompts, params) == want
    s = engine.stats()
    assert 0 < s.draft_tokens_accepted < s.draft_tokens, (s.draft_tokens_accepted, s.draft_tokens)
    assert engine.blocks.num_free == free
    # the end-of-sequence token: the first greedy token that repeats an earlier one of the output (so a draft can
    # reach it); the response ends there whatever the drafts were
    out = want[0]
    end = next(t for i, t in enumerate(out) if t in out[:i])
    e = Engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=8, speculate=7, eos_token_ids=[end])
    assert run(e, [prompts[0]], SamplingParams(max_tokens=40)) == [out[: out.index(end) + 1]]
    for n in (1, 2, 5, 13):
        got = run(Engine(model, kv_cache_mib=1, block_size=4, speculate=7), [prompts[0]], SamplingParams(max_tokens=n,
                  ignore_eos=True))  # fmt: skip
        assert got == [out[:n]]
    again = prompts[0] + out[:20]
    assert run(engine, [again], SamplingParams(max_tokens=12, ignore_eos=True)) == [hf_greedy(ref, again, 12)]
    assert engine.blocks.prefix_hits > 0


def test_the_runner_gathers_the_models_weights_once_not_at_every_step(tiny, monkeypatch):
    """The engine owns its model while it serves: the weights the native call reads are gathered when it starts
    and kept (walking every module for a replacement cost 5% of a one-stream step), and the answers are unchanged."""
    from gqa.decoding import native_step

    path, ref = tiny
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    calls = []
    real = native_step.decode_weights
    monkeypatch.setattr(native_step, "decode_weights", lambda *a: calls.append(1) or real(*a))
    engine = Engine(model, kv_cache_mib=1, prefill_chunk=32)
    calls.clear()  # (the engine checks the model, and the runner gathers its weights, once)
    tokens = run(engine, PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.stats().steps >= 8 and not calls
    assert tokens == [hf_greedy(ref, prompt, 8) for prompt in PROMPTS[:2]]
