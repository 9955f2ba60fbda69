"""``gqa serve`` as its users meet it: a process on 127.0.0.1 serving the embedded SmolLM2, talked to with the
official ``openai`` client and with raw HTTP for what a client library would not send."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch

import gqa

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from gqa import kernels  # noqa: E402
from tests.helpers.server_process import MODEL, Server, get, post  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")


@pytest.fixture(scope="module")
def server():
    s = Server("--max-running", "8", kv_cache_mib=None)  # the default pool
    yield s
    assert s.stop() == 0


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def wait_idle(server: Server) -> dict[str, float]:
    """Metrics once nothing is in flight (bounded wait)."""
    for _ in range(200):
        m = server.metrics()
        if m["gqa_requests_in_flight"] == 0 and m["gqa_requests_running"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"requests still in flight: {m}")


def test_chat_completion_answers_as_the_model_does_offline(client, server):
    """The chat endpoint's greedy answer is the model's own greedy answer (``gqa.generate`` on the same weights and
    chat template, the dense decode path), with OpenAI's usage counts."""
    import gqa
    from gqa.decoding.generate import generate

    messages = [{"role": "user", "content": "Name three colours."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    model = gqa.load_model(None, dtype="auto")
    ids = model.tokenizer.apply_chat(messages)
    expected = generate(model, ids, max_new_tokens=8)
    expected = expected[0] if isinstance(expected[0], list) else expected
    eos = set(model.tokenizer.eos_token_ids)
    if eos & set(expected):
        expected = expected[: min(expected.index(t) for t in eos & set(expected))]
    content, decode = r.choices[0].message.content, model.tokenizer.decode
    same = max(k for k in range(len(expected) + 1) if content.startswith(decode(expected[:k])))
    if same < len(expected):  # the two paths round differently (int8 prompt rows, paged splits): they may part
        with torch.no_grad():  # only where the model's top two next tokens are within a rounding of each other
            top = model(torch.tensor([ids + expected[:same]]))[0, -1].float().topk(2).values
        assert same >= 3 and top[0] - top[1] < 0.25, (content, decode(expected), same, top)
    assert r.choices[0].message.role == "assistant" and r.model == MODEL
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens >= same
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_completion_equals_the_whole_one(client):
    prompt = "The three primary colours are"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20


def test_chat_stream_stop_string_and_seeded_sampling(client):
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    free = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    text = free.choices[0].message.content
    stop = text.split()[2]  # a word the answer reaches
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                            stop=[stop], stream=True)  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == text[: text.index(stop)] and chunks[-1].choices[0].finish_reason == "stop"

    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0.9, top_p=0.95, seed=seed
        )
        return r.choices[0].message.content

    sampled = [sample(s) for s in (3, 3, 4)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4' does not exist"):
        client.models.retrieve("gpt-4")
    assert json.loads(get(server.url + "/health")[1]) == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)  # counted, whatever ran before
    m = wait_idle(server)
    assert m["gqa_kv_blocks_used"] == 0 and m["gqa_kv_blocks_free"] > 0 and m["gqa_generation_tokens_total"] > 0
    assert m["gqa_steps_total"] > 0 and m["gqa_cuda_graph_steps_total"] == 0  # CPU: no graphs


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("chat/completions", b"{not json", 400, None, "not valid JSON"),
        ("chat/completions", b"[1, 2]", 400, None, "must be a JSON object"),
        ("chat/completions", {"model": MODEL}, 400, "messages", "'messages' is required"),
        ("chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", "must be an array, got a string"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages",
         "content must be a string"),
        ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens",
         "must be an integer, got a string"),
        ("completions", {"model": MODEL, "prompt": "hi", "temperature": 7}, 400, "temperature", r"in [0, 2]"),
        ("completions", {"model": MODEL, "prompt": "hi", "n": 17}, 400, "n", "in [1, 16]"),
        ("completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", "in [1, 16]"),
        ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model", "does not exist"),
        ("completions", {"model": MODEL, "prompt": [1, "a"]}, 400, "prompt", "token ids"),
        ("completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt", "token ids must be in"),
        ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 9000}, 400, "prompt", "exceed the model's"),
        ("completions", {"model": MODEL, "prompt": "word " * 9000}, 400, "prompt", "exceed the model's context"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "word " * 9000}]}, 400,
         "messages", "exceed the model's context"),  # no max_tokens: said so, not "must be >= 1, got -839"
        ("completions", {"model": MODEL, "prompt": "hi", "stop": ""}, 400, "stop", "must not be an empty string"),
        ("completions", {"model": MODEL, "prompt": "a\ud800b"}, 400, "prompt", "cannot be tokenized"),
        ("completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty",
         "must be in [-2, 2]"),
        ("completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 3.0}, 400, "presence_penalty",
         "must be in [-2, 2]"),
        ("completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty",
         "must be > 0"),
        ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 10}}, 400, "logit_bias", "token ids"),
        ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
        ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias",
         "logit_bias names token ids outside the vocabulary"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "stop_token_ids": [99999]}, 400, "stop_token_ids", "stop_token_ids names token ids outside the vocabulary"),
        # a number beyond a float's range (float() of it would overflow: it was a 500)
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "temperature": 10**400}, 400, "temperature", "must be a number, got an integer of 401 digits"),
        ("completions", {"model": MODEL, "prompt": "hi", "top_p": -(10**400)}, 400, "top_p", "beyond a number's"),
        ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"5": 10**400}}, 400, "logit_bias",
         "[-100, 100]"),
        # a lone surrogate in chat text (no UTF-8 holds it: it was a 500)
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]}, 400,
         "messages", "'messages' cannot be tokenized"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages",
         "messages[0].role must be one of system, developer, user, assistant, tool, got 'wizard'"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "max_completion_tokens": 0}, 400, "max_completion_tokens", "'max_completion_tokens' must be >= 1"),
        ("completions", {"model": MODEL, "prompt": "hi", "min_p": 1.5}, 400, "min_p", r"'min_p' must be in [0, 1]"),
        ("completions", {"model": MODEL, "prompt": "hi", "min_p": "0.1"}, 400, "min_p", "must be a number"),
        # vLLM / llama-server fields that change the answer and are not served: refused by name (were ignored)
        ("completions", {"model": MODEL, "prompt": "hi", "typical_p": 0.5}, 400, "typical_p", "is not supported"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "echo": True}, 400,
         "echo", "'echo' is not supported"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "continue_final_message": True}, 400, "continue_final_message", "is not supported"),
        ("completions", {"model": MODEL, "prompt": "hi", "skip_special_tokens": False}, 400, "skip_special_tokens",
         "is not supported"),
        ("completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs", "in [0, 20]"),
        ("completions", {"model": MODEL, "prompt": "hi", "logprobs": True}, 400, "logprobs", "must be an integer"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
         "top_logprobs": 21}, 400, "top_logprobs", "in [0, 20]"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
         400, "top_logprobs", "needs 'logprobs': true"),
        ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "must be >= 1"),
        ("completions", {"model": MODEL, "prompt": "hi", "echo": True, "max_tokens": False}, 400, "max_tokens",
         "must be an integer"),
        ("completions", {"model": MODEL, "prompt": [5, 9, 10**6], "echo": True, "logprobs": 1, "max_tokens": 0}, 400,
         "prompt", "token ids must be in"),
        ("completions", {"model": MODEL, "prompt": "hi", "echo": 1}, 400, "echo", "must be a boolean"),
        ("completions", {"model": MODEL, "prompt": "hi", "best_of": 3, "n": 4}, 400, "best_of", "in [n=4, 16]"),
        ("completions", {"model": MODEL, "prompt": "hi", "best_of": 3, "stream": True}, 400, "best_of",
         "cannot be streamed"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "best_of": 2}, 400,
         "best_of", "not supported"),
        ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens",
         "in [0, max_tokens=3]"),
        ("completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", ">= 0"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "response_format": {"type": "yaml"}}, 400, "response_format", "must be 'text', 'json_object' or"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format",
         "with a 'schema' object"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400,
         "response_format", "the json_schema does not compile"),
        ("completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "(a"}}, 400,
         "structured_outputs", "the regex does not compile"),
        # schemas whose grammar xgrammar would not hold the answer to (tests/serve/test_schema_check.py has more)
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"allOf": [
             {"type": "integer"}, {"minimum": 5}]}}}}, 400, "response_format", "'allOf' of 2 schemas"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
         "not": {"const": 3}}}}}, 400, "response_format", "'not' is not supported"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
             "$ref": "https://example.com/s.json"}}}}, 400, "response_format", "points outside the schema"),
        ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8, "structured_outputs": {"json": {
         "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "dependentRequired": {
             "a": ["b"]}}}}, 400, "structured_outputs", "'dependentRequired' is not supported"),
        # over the bounds of size: refused before compiling (a 70-deep one compiled and was served)
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
             '{"type": "array", "items": ' * 70 + "{}" + "}" * 70)}}}, 400, "response_format",
         "nests deeper than 64 levels"),
        ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8, "response_format": {"type": "json_schema",
         "json_schema": {"name": "x", "schema": {"enum": list(range(12_000))}}}}, 400,
         "response_format", "more than 10000 JSON values"),
        ("completions", {"model": MODEL, "prompt": "hi", "max_tokens": 8, "guided_regex": "a" * 200_000}, 400,
         "guided_regex", "more than the 131072 allowed"),
        ("completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
         "structured_outputs", "exactly one of"),
        ("completions", {"model": MODEL, "prompt": "hi", "guided_choice": [], "response_format": {"type":
         "json_object"}}, 400, "guided_choice", "each ask for structured output"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
         "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, 400, "tools",
         "does not render tools"),
        # once 500s: a key that passes str.isdigit but not int, one int() refuses for its length, a body nested past
        # the decoder's recursion, an integer literal past int()'s digits, Python's non-JSON NaN, a tool call that is
        # no object, token ids too large to decode, a name with a lone surrogate (its error could not be encoded)
        ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"²": 1}}, 400, "logit_bias", "token ids"),
        ("completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias",
         "token ids"),
        ("completions", b'{"model": "x", "prompt": "hi", "n": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None,
         "nested too deeply"),
        ("completions", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None, "not valid JSON"),
        ("completions", b'{"prompt": "hi", "temperature": NaN}', 400, None, "NaN is not a JSON value"),
        ("chat/completions", {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]},
         {"role": "user", "content": "hi"}]}, 400, "messages", "tool_calls must be an array of objects"),
        ("completions", {"model": MODEL, "prompt": [1, 10**30], "echo": True, "logprobs": 1, "max_tokens": 0}, 400,
         "prompt", "token ids"),
        ("completions", {"model": "a\ud800", "prompt": "hi"}, 404, "model", "does not exist"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors_before_any_work(server, path, body, status, param, message):
    code, answer, _ = post(f"{server.url}/v1/{path}", body)
    assert code == status
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and message in answer["error"]["message"]
    assert server.metrics()["gqa_requests_in_flight"] == 0


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_cannot_take_gets_a_400_and_the_server_serves_on(server, client, seed):
    """A seed outside [-2**63, 2**64) (once: the engine thread died in ``manual_seed`` and every request hung) is
    refused before any work, and the next seeded request, at the range's edge, is served."""
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 1.0, "seed": seed}
    code, answer, _ = post(f"{server.url}/v1/completions", body)
    assert code == 400 and answer["error"]["param"] == "seed" and "'seed' must be in" in answer["error"]["message"]
    edge = 2**64 - 1 if seed > 0 else -(2**63)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=1.0, seed=edge,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert get(server.url + "/health")[0] == 200


def test_logit_bias_and_penalties_through_the_openai_client(server, client):
    """A +100 bias on one token makes every greedy token that one (the text is that token four times); a -100 bias
    on the first greedy token changes the first token; frequency and presence penalties are served."""
    tok = gqa.load_tokenizer()
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    forced = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                       logit_bias={"1234": 100})  # fmt: skip
    assert forced.choices[0].text == tok.decode([1234] * 4)
    first = tok.encode(plain.choices[0].text)[0]
    banned = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})  # fmt: skip
    assert tok.encode(banned.choices[0].text)[:1] != [first]
    messages = [{"role": "user", "content": "Count to ten."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                       frequency_penalty=1.0, presence_penalty=0.5)  # fmt: skip
    assert r.usage.completion_tokens >= 1


def test_min_p_through_the_openai_client(client):
    """vLLM's ``min_p`` (in ``extra_body``): at 1 only the likeliest token stays, so a hot sampled answer is the
    greedy one; a small one at the same seed samples what the plain request samples more often than not, and a
    sample that differs from the greedy answer somewhere shows the setting reached the sampler."""
    messages = [{"role": "user", "content": "Write a short poem about rain."}]
    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    hot = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 2.0, "seed": 3}
    plain = client.chat.completions.create(**hot)
    cut = client.chat.completions.create(**hot, extra_body={"min_p": 1.0})
    assert cut.choices[0].message.content == greedy.choices[0].message.content
    assert plain.choices[0].message.content != greedy.choices[0].message.content  # (sampled at T = 2: not greedy)


def test_logprobs_through_the_openai_client_are_the_models_log_softmax(client):
    """Chat ``logprobs``/``top_logprobs`` and completions ``logprobs``: each token's log-probability is the log-softmax
    of the model's own next-token logits (a full forward of the prompt and the answer here, float32), the greedy
    token is the first alternative, the tokens spell the text, and the stream carries the same values."""
    model = gqa.load_model(None, dtype=torch.float32)
    tok = model.tokenizer
    messages = [{"role": "user", "content": "Name three colours."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content and len(content) == 6
    ids = tok.apply_chat(messages)
    answer = tok.encode(r.choices[0].message.content)
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids + answer]))[0, len(ids) - 1 : -1].float(), -1)
    for i, t in enumerate(content):
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == t.logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
        assert t.bytes == list(t.token.encode())
        # int8 rounding of the served rows (bf16 activations where the CPU has them) against the float32 forward
        assert abs(t.logprob - float(want[i, answer[i]])) < 0.15, (i, t.logprob, float(want[i, answer[i]]))
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=3, stream=True)  # fmt: skip
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                     logprobs=2)  # fmt: skip
    lp = done.choices[0].logprobs
    assert "".join(lp.tokens) == done.choices[0].text and len(lp.token_logprobs) == 5
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(5)]
    pairs = zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    assert all(len(top) <= 2 and max(top.values()) == p for top, p in pairs)
    sampled = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0.8,
                                        seed=3, logprobs=0)  # fmt: skip
    assert all(p <= 0 for p in sampled.choices[0].logprobs.token_logprobs)
    assert sampled.choices[0].logprobs.top_logprobs == [{}] * 4


def exchange(server: Server, path: str, body: dict) -> tuple[int, bytes]:
    """POST ``body`` to ``/v1/<path>``: the status and the raw body (parsed by the test, strictly)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", f"/v1/{path}", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def strict_json(raw: bytes) -> object:
    """JSON as RFC 8259 has it: Python's decoder would take ``NaN`` and ``-Infinity``, clients' parsers do not."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(raw, parse_constant=refuse)


def test_logprobs_under_a_grammar_list_only_what_it_allows_in_strict_json(server):
    """Structured output with 20 alternatives asked where the grammar allows fewer (once: -inf for the masked ones, a
    plain-text 500 whole and ``-Infinity`` streamed): every response and chunk is strict JSON, every logprob finite,
    the chosen token's logprob is its own entry among the alternatives (the distribution it was sampled from), and
    the alternatives listed — all the grammar allows — sum to probability 1."""
    pytest.importorskip("xgrammar")
    grammar = {"structured_outputs": {"choice": ["red", "green"]}, "temperature": 1.0, "seed": 7}
    asks = {"chat/completions": {"messages": [{"role": "user", "content": "Pick a colour."}], "logprobs": True,
                                 "top_logprobs": 20},
            "completions": {"prompt": "My favourite colour is", "logprobs": 20}}  # fmt: skip
    for path, ask in asks.items():
        for stream in (False, True):
            status, raw = exchange(server, path, {"model": MODEL, "stream": stream, **ask, **grammar})
            assert status == 200, raw[:300]
            events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: {")] if stream else [raw]
            steps, text = [], ""
            for body in map(strict_json, events):
                choice = body["choices"][0] if body["choices"] else {}
                said = choice.get("message") or choice.get("delta") or choice
                text += said.get("content") or said.get("text") or ""
                lp = choice.get("logprobs")
                if lp is not None and path == "chat/completions":
                    steps += [(bytes(t["bytes"]), t["logprob"], {bytes(a["bytes"]): a["logprob"] for a in
                                                                t["top_logprobs"]}) for t in lp["content"]]  # fmt: skip
                elif lp is not None:
                    steps += list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True))
            assert text in ("red", "green") and steps, (path, stream, text)
            for token, logprob, alternatives in steps:
                assert math.isfinite(logprob) and all(math.isfinite(v) for v in alternatives.values())
                assert alternatives[token] == logprob and len(alternatives) < 20
                assert abs(sum(math.exp(v) for v in alternatives.values()) - 1) < 1e-3, alternatives


def test_logprob_bytes_join_to_the_content_where_tokens_split_characters(client, server):
    """Chat ``bytes`` (once U+FFFD's for each piece of a multi-byte character): joined over the answer's tokens they
    are its UTF-8, whole and streamed, on text whose emoji and kanji the tokens split; such a piece's ``token`` is
    OpenAI's ``bytes:\\xNN`` spelling of them."""
    pytest.importorskip("xgrammar")
    text = "日本語 😀🎉"
    kw = dict(model=MODEL, messages=[{"role": "user", "content": f"Say {text}"}], max_tokens=24, temperature=0,
              logprobs=True, top_logprobs=2, extra_body={"structured_outputs": {"choice": [text]}})  # fmt: skip
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == text
    assert b"".join(bytes(t.bytes) for t in content) == text.encode("utf-8")
    split = [t for t in content if "\ufffd" in bytes(t.bytes).decode("utf-8", errors="replace")]
    assert split and all(t.token == spelled(t.bytes) for t in content for t in [t, *t.top_logprobs])
    chunks = client.chat.completions.create(**kw, stream=True)
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.bytes, t.logprob) for t in streamed] == [(t.token, t.bytes, t.logprob) for t in content]


def spelled(raw: list[int]) -> str:
    """A token's text as OpenAI writes it from its bytes: the text, or ``bytes:\\xe6\\x97`` for a piece of a
    character."""
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def test_a_request_without_model_is_served_by_the_only_model(server):
    """As llama-server and ollama take it; a name that is not the served model stays a 404."""
    code, answer, _ = post(f"{server.url}/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert code == 200 and answer["model"] == MODEL and answer["usage"]["completion_tokens"] >= 1
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    code, answer, _ = post(f"{server.url}/v1/chat/completions", body)
    assert code == 200 and answer["model"] == MODEL
    code, answer, _ = post(f"{server.url}/v1/chat/completions", body | {"model": "gpt-4"})
    assert code == 404 and answer["error"]["code"] == "model_not_found"


def test_the_default_kv_pool_is_sized_from_the_model_and_said_at_start(server):
    """Without ``--kv-cache-mib`` the embedded model's pool is one full context (its K/V outweigh its quantized
    weights), no longer a quarter of the free memory (3.2 GiB once: seconds to zero at start, resident after): the
    start line says its tokens, GiB and why, and the server stays well under 1 GiB resident."""
    lines: list[str] = []
    while len(lines) < 4 and not any("KV cache" in line for line in lines):  # the banner comes before uvicorn's lines
        lines.append(server.proc.stdout.readline())
    found = re.search(r"KV cache (\d+) tokens = ([\d.]+) GiB \((\d+) blocks of 16, 1\.0 8192-token contexts; "
                      r"default: one full context, which outweighs the weights\)", lines[-1])  # fmt: skip
    assert found, lines
    assert int(found[1]) == 8192 == 16 * int(found[3])
    assert found[2] in ("0.18", "0.35")  # 30 layers x 3 KV heads x 64 x 2 (K, V) x 8192 tokens in bf16 or fp32
    assert _rss_mib(server.proc.pid) < 1024


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, hf_smollm2):
    """Completions ``echo`` + ``logprobs``, and ``max_tokens: 0`` (the prompt scored, nothing generated, as evaluation
    harnesses ask): every prompt token after the first carries the log-softmax of transformers' float32 logits for
    it, the first none; with an answer its tokens follow the prompt's; streamed alike."""
    tok = gqa.load_tokenizer()
    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = tok.encode(prompt)
    with torch.no_grad():
        want = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), -1)  # (L, vocab)
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=0)
    choice, lp = r.choices[0], r.choices[0].logprobs
    assert choice.text == prompt and choice.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # the served model's bf16 activations, rounded to int8 per 32 values as llama.cpp rounds them (the prompt's rows
    # too, where the build has lane kernels), against float32: ~0.07 nats on average, 0.19 at most on this prompt
    errors = []
    for i in range(1, len(ids)):
        errors.append(abs(lp.token_logprobs[i] - float(want[i - 1, ids[i]])))
        assert errors[-1] < 0.3, (i, lp.token_logprobs[i])
        top = lp.top_logprobs[i]
        assert len(top) == 3 and abs(max(top.values()) - float(want[i - 1].max())) < 0.3
    assert sum(errors) / len(errors) < 0.1
    assert sum(lp.token_logprobs[1:]) < -5  # not all zeros
    answered = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=4,
                                         temperature=0)  # fmt: skip
    lp2 = answered.choices[0].logprobs
    assert answered.choices[0].text.startswith(prompt) and len(lp2.tokens) == len(ids) + 4
    assert lp2.token_logprobs[: len(ids)] == lp.token_logprobs
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=3, max_tokens=4,
                                            temperature=0, stream=True))  # fmt: skip
    streamed = [p for c in chunks if c.choices and c.choices[0].logprobs for p in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp2.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == answered.choices[0].text
    zero = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0, stream=True))
    assert "".join(c.choices[0].text for c in zero if c.choices) == prompt


def test_best_of_returns_the_answers_with_the_best_mean_logprob(client):
    """``best_of=4, n=2``, sampled with a seed: the two of the four answers ``n=4`` gives (answer i seeded seed + i)
    whose tokens' mean logprob is highest, best first; the usage counts all four; no logprobs unless asked."""
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11)
    four = client.completions.create(**kw, n=4, logprobs=0)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in four.choices]
    order = sorted(range(4), key=lambda i: (-means[i], i))
    assert len({c.text for c in four.choices}) > 1  # the answers differ, so the choice matters
    best = client.completions.create(**kw, n=2, best_of=4)
    assert [c.text for c in best.choices] == [four.choices[i].text for i in order[:2]]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == four.usage.completion_tokens
    with_logprobs = client.completions.create(**kw, best_of=4, logprobs=1)
    assert with_logprobs.choices[0].text == four.choices[order[0]].text
    assert with_logprobs.choices[0].logprobs.token_logprobs == four.choices[order[0]].logprobs.token_logprobs


def test_structured_output_through_the_openai_client_validates(client):
    """response_format json_schema (chat, validated by ``jsonschema``) and json_object, streamed and not; vLLM's
    structured_outputs choice and guided_regex (completions); min_tokens and stop_token_ids served."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    properties = {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "maximum": 10**9}}
    schema = {"type": "object", "properties": properties, "required": ["city", "population"]}
    messages = [{"role": "user", "content": "What is the capital of France and its population? Answer in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                       response_format=fmt)  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                            response_format=fmt, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    ask = [{"role": "user", "content": 'What is the capital of France? Answer as a JSON object like {"capital": ...}.'}]
    r = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=64, temperature=0,
                                       response_format={"type": "json_object"})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=8, temperature=1.0, seed=4,
                                  extra_body={"structured_outputs": {"choice": ["red", "green"]}})  # fmt: skip
    assert r.choices[0].text in ("red", "green")
    r = client.completions.create(model=MODEL, prompt="Call me on", max_tokens=16, temperature=0,
                                  extra_body={"guided_regex": r" \d{3}-\d{4}"})  # fmt: skip
    assert re.fullmatch(r" \d{3}-\d{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    tok = gqa.load_tokenizer()
    third = tok.encode(plain.choices[0].text)[2]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  extra_body={"stop_token_ids": [third]})  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 3
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  extra_body={"min_tokens": 6, "stop_token_ids": [third]})  # fmt: skip
    assert r.usage.completion_tokens == 6


def test_n_answers_share_the_prompt_and_each_is_the_request_alone(server, client):
    """``n`` = 3 seeded sampled answers (completions and chat, streamed and not): answer ``i`` is the request alone
    with seed + i; the usage counts every answer's tokens; the prompt's blocks are shared from the prefix cache (its
    hit counter grows by the others' full prompt blocks); every block comes back."""
    prompt = "Once upon a time, in a land far away, there lived a dragon who loved " * 3
    before = wait_idle(server)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=3,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    after = wait_idle(server)
    shared = (len(gqa.load_tokenizer().encode(prompt)) - 1) // int(after["gqa_kv_block_size"])  # full blocks
    assert shared >= 2 and after["gqa_prefix_cache_hits_total"] - before["gqa_prefix_cache_hits_total"] >= 2 * shared
    assert after["gqa_kv_blocks_free"] == before["gqa_kv_blocks_free"]
    alone = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=7 + i,
                                       extra_body={"ignore_eos": True}).choices[0].text for i in range(3)]  # fmt: skip
    assert [c.text for c in r.choices] == alone and len(set(alone)) > 1
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=3,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))  # fmt: skip
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == alone and chunks[-1].usage.completion_tokens == 24
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 3
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, n=2)
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same answer twice
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, n=2,
                                                   stream=True))  # fmt: skip
    for i in range(2):
        got = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
        assert got == chat.choices[i].message.content


def test_echo_puts_the_prompt_before_the_answer(client):
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                       echo=True)  # fmt: skip
    assert echoed.choices[0].text == "The capital of France is" + plain.choices[0].text
    assert echoed.usage == plain.usage
    chunks = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0,
                                       echo=True, stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    ids = gqa.load_tokenizer().encode("Hello there")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Hello there")


def test_fields_that_mean_off_are_accepted_and_the_error_shapes_are_openais(server, client):
    """The defaults clients send (penalties 0, logprobs false, response_format text, tool_choice none) are served;
    an unknown model is a 404 with type invalid_request_error and code model_not_found."""
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       frequency_penalty=0, presence_penalty=0, logprobs=False,
                                       response_format={"type": "text"}, tool_choice="none")  # fmt: skip
    assert r.usage.completion_tokens <= 2
    code, answer, _ = post(f"{server.url}/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert code == 404 and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["code"] == "model_not_found"


def test_max_completion_tokens_wins_and_a_tiny_temperature_is_greedy(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0,
                                  extra_body={"max_completion_tokens": 3, "ignore_eos": True})  # fmt: skip
    assert r.usage.completion_tokens == 3
    greedy = client.completions.create(model=MODEL, prompt="The capital of France", max_tokens=8, temperature=0)
    tiny = client.completions.create(model=MODEL, prompt="The capital of France", max_tokens=8, temperature=1e-300)
    assert tiny.choices[0].text == greedy.choices[0].text


def test_a_stream_keeps_one_created_time(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    assert len(chunks) > 5 and len({c.created for c in chunks}) == 1


def test_only_json_bodies_within_the_limit_are_read(server):
    """A text/plain POST (which any web page may send cross-origin) gets 415; a body over the limit 413 before it is
    read."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    code, answer, _ = post(f"{server.url}/v1/completions", body, {"Content-Type": "text/plain"})
    assert code == 415 and "Content-Type must be application/json" in answer["error"]["message"]
    assert post(f"{server.url}/v1/completions", body, {"Content-Type": "application/json; charset=utf-8"})[0] == 200
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 104857600\r\n\r\n{")  # fmt: skip  # 100 MiB announced, 1 byte sent
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert get(server.url + "/health")[0] == 200


def test_a_non_streaming_client_that_leaves_has_its_request_aborted(server):
    before = wait_idle(server)
    free, made = before["gqa_kv_blocks_free"], before["gqa_generation_tokens_total"]
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0,
                       "ignore_eos": True}).encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        for _ in range(100):  # until it is being decoded
            if server.metrics()["gqa_requests_running"] == 1:
                break
            time.sleep(0.05)
    m = wait_idle(server)  # aborted long before its 1,000 tokens
    assert m["gqa_kv_blocks_free"] == free and m["gqa_generation_tokens_total"] - made < 800


def test_grammar_compiles_left_by_their_clients_hold_up_no_plain_request(server, client):
    """Once, six slow schemas whose clients gave up made a plain request wait 56 s: their compiles ran in the thread
    pool that parses every request, and went on after the clients left. They run on threads of their own now (two at
    once), and one whose client leaves before it starts never starts: as many slow compiles as that pool has threads,
    each left by its client, hold up a plain request no more than two compiles' use of the CPU does."""
    pytest.importorskip("xgrammar")
    slow = "([a-z]{1,10}){1,10}"  # ~3 s to compile on one core: xgrammar unrolls the nested repetitions
    left = []
    for i in range(min(32, (os.cpu_count() or 1) + 4)):  # asyncio.to_thread's pool: os.cpu_count() + 4 threads
        schema = {"type": "string", "pattern": f"{slow}x{i}"}
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "slow", "schema": schema}}}).encode()  # fmt: skip
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        left.append(s)
    time.sleep(0.5)  # parsed: two compiling, the others waiting for a thread
    for s in left:
        s.close()
    start = time.monotonic()
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  timeout=30)  # fmt: skip
    assert r.choices[0].text and time.monotonic() - start < 3  # 0.6 s here (0.05 s alone); 12 s before


def test_a_pool_smaller_than_the_context_is_said_at_start_and_chat_defaults_fit_it():
    """With a KV pool of fewer tokens than the model's context, the start says the largest request and the size that
    holds a full context; a chat request without max_tokens (the openai client's default) is served, not refused."""
    s = Server("--kv-cache-mib", "8")
    try:
        lines = [s.proc.stdout.readline() for _ in range(3)]  # the banner lines come before uvicorn's
        note = next((line for line in lines if "gqa serve: note:" in line), "")
        found = re.search(r"the KV cache holds (\d+) tokens, fewer than the model's context of 8192.*"
                          r"--kv-cache-mib (\d+) holds a full context", note)  # fmt: skip
        assert found, lines
        slots, full_mib = int(found[1]), int(found[2])
        # SmolLM2: 30 layers x 3 KV heads x 64 x 2 (K, V) x 8192 tokens: 180 MiB in bf16, 360 in fp32 (the auto dtype)
        assert full_mib in (180, 360) and slots == 8 * 8192 // full_mib // 16 * 16
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", timeout=60, max_retries=0)
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}])
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.total_tokens <= slots
    finally:
        assert s.stop() == 0


def test_the_openai_client_raises_its_own_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="exceed the model's context"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    before = wait_idle(server)
    free, made = before["gqa_kv_blocks_free"], before["gqa_generation_tokens_total"]
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        received = b""
        for _ in range(100):
            chunk = s.recv(4096)
            received += chunk
            if not chunk or received.count(b"data: ") >= 3:
                break
        assert received.startswith(b"HTTP/1.1 200") and received.count(b"data: ") >= 3, received[:300]
        assert server.metrics()["gqa_requests_running"] == 1
    m = wait_idle(server)  # the request was aborted long before its 1,000 tokens (the counter is the server's total)
    assert m["gqa_kv_blocks_free"] == free and m["gqa_generation_tokens_total"] - made < 800


def test_api_key_full_queue_and_sigterm():
    """With --api-key: 401 without the key. One running slot and no queue: a second request gets 429 with
    Retry-After. SIGTERM during a stream: the stream ends cleanly and the process exits 0."""
    s = Server("--api-key", "sekret", "--max-running", "1", "--max-queue", "0")
    try:
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        code, answer, _ = post(s.url + "/v1/completions", body)
        assert code == 401 and answer["error"]["type"] == "authentication_error"
        assert get(s.url + "/v1/models")[0] == 401
        auth = {"Authorization": "Bearer sekret"}
        assert post(s.url + "/v1/completions", body, auth)[0] == 200
        assert post(s.url + "/v1/completions", body, {"Authorization": "bearer sekret"})[0] == 200  # any case
        assert post(s.url + "/v1/completions", body, {"Authorization": "Bearer wrong"})[0] == 401
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", timeout=60, max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=300, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        first = next(iter(stream))
        assert first.choices[0].text is not None
        code, answer, headers = post(s.url + "/v1/completions", body, auth)
        assert (
            code == 429
            and {k.lower(): v for k, v in headers.items()}.get("retry-after") == "1"
            and answer["error"]["type"] == "rate_limit_error"
        )
        s.proc.send_signal(signal.SIGTERM)
        rest = list(stream)  # finished (or cancelled at the graceful timeout): the iteration ends, no hang
        assert len(rest) < 300
    finally:
        code = s.stop()
    assert code == 0


def test_connections_that_never_finish_their_headers_are_closed_and_others_are_served():
    """Slowloris: 30 connections that send half a request's headers are all closed by the server once
    ``--header-timeout`` (1 s) has passed, while a normal request is answered meanwhile and a streamed response that
    lasts past the timeout is not cut (the deadline is for headers only); a keep-alive connection that starts a second
    request's headers and stalls is closed too."""
    s = Server("--header-timeout", "1")
    try:
        slow = []
        for _ in range(30):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            slow.append(c)
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        started = time.monotonic()
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=800, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))  # fmt: skip
        # 800 tokens take ~4 s at this machine's ~190 tok/s (200 once took only 0.97 s): the stream outlives the timeout
        assert time.monotonic() - started > 1.0 and len(gqa.load_tokenizer().encode(text)) >= 760
        for c in slow:
            with closing(c):
                assert c.recv(1024) == b""  # closed by the server (a 10 s socket timeout would raise instead)
        with closing(socket.create_connection(("127.0.0.1", s.port), timeout=10)) as c:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = b""
            while not answer.endswith(b'"ok"}'):
                piece = c.recv(1024)
                assert piece, answer
                answer += piece
            assert answer.startswith(b"HTTP/1.1 200")
            c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            started = time.monotonic()
            assert c.recv(1024) == b"" and time.monotonic() - started < 5
    finally:
        assert s.stop() == 0


def test_speculate_serves_the_same_greedy_text_with_drafts(client):
    """``--speculate 7``: a request that copies its prompt gets the text the server without drafts gives (streamed
    and not), and the metrics count drafts accepted."""
    prompt = (
        "Fix the spelling in this text and return it: The watter cycle describes how watter evaporates from "
        "oceans and lakes, rises into the atmosphere, cools and condenses into clouds, and falls back as rain."
    )
    messages = [{"role": "user", "content": prompt}]
    want = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0)
    s = Server("--speculate", "7")
    try:
        fast = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = fast.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0)
        assert got.choices[0].message.content == want.choices[0].message.content
        chunks = fast.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=0,
                                              stream=True)  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == got.choices[0].message.content
        m = s.metrics()
        assert m["gqa_draft_tokens_accepted_total"] > 0 and m["gqa_kv_blocks_used"] == 0
    finally:
        assert s.stop() == 0


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_soak_of_64_clients_with_aborts_returns_every_block_and_levels_off():
    """Four rounds of 64 concurrent clients (streamed and whole chat requests of 4-24 tokens; every other streaming
    client hangs up after its second chunk, every seventh sends a bad request): every answer that was read to the end is
    whole, the server's RSS after the last round is within 10% of where it was after the first, and every block is
    back in the pool with nothing in flight."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor

    s = Server("--max-running", "64")

    def client(i: int, round_: int) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
        try:
            stream = i % 2 == 0
            body = {"model": MODEL, "max_tokens": 4 + (i * 7 + round_) % 21, "temperature": 0, "stream": stream,
                    "messages": [{"role": "user", "content": f"Tell me fact number {i} about the sea."}]}  # fmt: skip
            if i % 7 == 3:
                body["temperature"] = 9  # refused with a 400
            conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                return "refused" if response.status == 400 else f"HTTP {response.status}"
            if not stream:
                answer = json.loads(response.read())
                return "whole" if answer["choices"][0]["finish_reason"] in ("stop", "length") else "bad"
            chunks = 0
            for raw in response:
                if raw.startswith(b"data: [DONE]"):
                    return "whole"
                if raw.startswith(b"data:"):
                    chunks += 1
                    if i % 4 == 2 and chunks == 2:
                        return "left"  # hangs up: the finally closes the connection mid-stream
            return "cut"
        finally:
            conn.close()

    try:
        rss = []
        with ThreadPoolExecutor(64) as pool:
            for round_ in range(4):
                results = list(pool.map(lambda i, r=round_: client(i, r), range(64)))
                assert set(results) <= {"whole", "left", "refused"}, results
                assert results.count("refused") == sum(i % 7 == 3 for i in range(64))
                assert results.count("left") >= 10
                wait_idle(s)
                rss.append(_rss_mib(s.proc.pid))
        assert rss[-1] <= 1.1 * rss[0], rss
        m = wait_idle(s)
        assert m["gqa_kv_blocks_used"] == 0 and m["gqa_requests_waiting"] == 0
    finally:
        assert s.stop() == 0


def test_streamed_text_offsets_are_the_whole_answers_where_tokens_split_characters(client):
    """A token that ends inside a character (SmolLM2's ``b' \\xe6'`` of " 日") counted as one more character in a
    stream, whose chunks were measured one by one: every later ``text_offset`` was off. One count over the answer."""
    text = "x 日本語 😀🎉 means"  # held to this text; the bias makes b' \xe6' (17097) the token that starts " 日"
    request = {"model": MODEL, "prompt": "Say it:", "max_tokens": 40, "temperature": 0, "logprobs": 1,
               "logit_bias": {"17097": 100}, "extra_body": {"structured_outputs": {"choice": [text]}}}  # fmt: skip
    whole = client.completions.create(**request).choices[0]
    assert whole.text == text and "bytes:\\x20\\xe6" in whole.logprobs.tokens
    offsets, tokens = [], []
    for c in client.completions.create(stream=True, **request):
        for ch in c.choices:
            if ch.logprobs:
                offsets += ch.logprobs.text_offset
                tokens += ch.logprobs.tokens
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
    ends = [*whole.logprobs.text_offset[1:], len(text)]
    assert all(a <= b for a, b in zip(whole.logprobs.text_offset, ends, strict=True)) and ends[-1] == len(text)
