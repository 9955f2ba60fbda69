"""OpenAI's Responses API (``/v1/responses``): the translation to a chat prompt, the store's bounds and the stream's
events without a server, then ``gqa serve`` (the Hermes template: the shared server of conftest) through the
official ``openai`` client: greedy answers equal to ``/v1/chat/completions``' for the same conversation, streams
that reassemble to the whole response, a function call round trip over ``previous_response_id``, json_schema output
that validates, retrieve and delete, and a 404 for an unknown response."""

from __future__ import annotations

import json

import pytest

from gqa.loaders import load_tokenizer
from gqa.serve import responses_api as api
from gqa.serve.answers import Answer, CallStarted, MoreArguments, Text
from gqa.serve.openai_api import ApiError
from gqa.serve.response_store import ResponseStore
from tests.helpers.server_process import HERMES_TEMPLATE, MODEL

pytest.importorskip("starlette")

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}  # fmt: skip
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_tokenizer()
    tok.use_chat_template(HERMES_TEMPLATE)
    return tok


def test_input_items_render_as_the_chat_they_translate_to(tokenizer):
    """Instructions, a developer message, text parts, a function call and its output, after a previous response's
    conversation: the prompt is the chat template's for the OpenAI messages they stand for; the conversation kept
    for the next response has no instructions; ``max_output_tokens`` is cut to what the context leaves."""
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    body = {"instructions": "Be brief.", "max_output_tokens": 10**6, "tools": [WEATHER], "input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}]}  # fmt: skip
    t = api.translate(body, history)
    chat = [{"role": "system", "content": "Be brief."}, *history, {"role": "system", "content": "Use tools."},
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]  # fmt: skip
    parsed = api.parse(t, tokenizer, [MODEL], context=8192, pool=4096)
    expected = tokenizer.apply_chat(chat, tools=[CHAT_WEATHER])
    assert parsed.prompt_ids == expected and parsed.params.max_tokens == 4096 - len(expected)
    assert t.conversation == t.chat["messages"][1:] and t.conversation[:3] == chat[1:4]  # no instructions
    assert api.parse(api.translate({"input": ASK}), tokenizer, [MODEL], 8192).prompt_ids == tokenizer.apply_chat(ASK)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "input", "'input' is required"),
        ({"input": [{"role": "bot", "content": "x"}]}, "input", "'input[0].role' must be one of"),
        ({"input": [{"type": "input_image"}]}, "input", "is not supported"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input", "only text parts"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "must be >= 1"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "must be a function tool"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "'schema' object"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": 5}, "tool_choice", "'tool_choice' must be"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}, "tool_choice": "x",
          "tools": [WEATHER]}, "tool_choice", "'tool_choice' must be"),
        # fields that change the answer and are not served here: refused by name (they were accepted and ignored)
        ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include",
         "'include' item \"reasoning.encrypted_content\" is not supported by this server"),
        ({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs",
         "'top_logprobs' must be in [0, 20]"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "'prompt' is not supported"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "'conversation' is not supported"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "'reasoning' is not supported"),
        ({"input": "x", "truncation": "auto"}, "truncation", "'truncation' is not supported"),
    ],
)  # fmt: skip
def test_bad_requests_name_their_field(tokenizer, body, param, message):
    with pytest.raises(ApiError, match=message.replace("[", r"\[")) as e:
        api.parse(api.translate(body), tokenizer, [MODEL], 8192)
    assert e.value.status == 400 and e.value.param == param


def test_fields_at_their_off_values_are_accepted(tokenizer):
    """What clients send by default (the openai SDK leaves them out; others send the off values) still serves."""
    body = {"input": "x", "include": [], "top_logprobs": 0, "reasoning": {"effort": None}, "truncation": "disabled",
            "prompt": None, "conversation": None}  # fmt: skip
    assert api.parse(api.translate(body), tokenizer, [MODEL], 8192).prompt_ids


def test_the_store_keeps_the_newest_within_its_bounds():
    store = ResponseStore(max_count=2, max_chars=500)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [{"role": "user", "content": "x"}])
    assert [store.get(f"resp_{i}") is not None for i in range(3)] == [False, True, True]
    store.put({"id": "resp_big"}, [{"role": "user", "content": "x" * 440}])  # pushes both older ones out
    assert len(store) == 1 and store.get("resp_big").conversation[0]["content"] == "x" * 440
    store.put({"id": "resp_huge"}, [{"role": "user", "content": "x" * 500}])  # larger than the bound: not kept
    assert store.get("resp_huge") is None and store.delete("resp_big") and not store.delete("resp_big")
    assert len(store) == 0


def test_stream_events_are_numbered_and_end_with_the_response_of_the_items_streamed():
    events = api.ResponseEvents(api.response_body("resp_1", 0, MODEL, {}, [], None))
    sent = events.start() + events.deltas([Text("Hi"), CallStarted(0, "call_1", "f", '{"a"'), MoreArguments(0, "}")])
    last, body = events.end(Answer(reason="tool_calls", prompt_tokens=3, completion_tokens=4))
    got = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in sent + last]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]  # fmt: skip
    assert got[-1]["response"] == body and body["status"] == "completed" and body["usage"]["total_tokens"] == 7
    assert [i["type"] for i in body["output"]] == ["message", "function_call"]
    assert body["output"][1]["arguments"] == '{"a"}' and body["output"][0]["id"] == got[2]["item"]["id"]


# -- through gqa serve --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(hermes_server):
    openai = pytest.importorskip("openai")
    from gqa import kernels
    from tests.helpers.server_process import HERMES_KEY

    if not kernels.vectorized():
        pytest.skip("native SIMD kernels not built on this machine")
    return openai.OpenAI(base_url=hermes_server.url + "/v1", api_key=HERMES_KEY, max_retries=0, timeout=60)


def greedy(**request) -> dict:
    return {"model": MODEL, "max_output_tokens": 12, "temperature": 0} | request


def test_text_answers_are_chat_completions_own_and_streams_reassemble_them(client):
    """Instructions and an input, greedy: the text and usage are what ``/v1/chat/completions`` answers to the same
    conversation; the stream helper reassembles the same response; the response can be retrieved, then deleted."""
    r = client.responses.create(**greedy(instructions="Answer in one word.", input="Name a colour."))
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}]
    c = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=messages)
    assert r.output_text == c.choices[0].message.content and r.id.startswith("resp_") and r.object == "response"
    assert r.status == ("completed" if c.choices[0].finish_reason == "stop" else "incomplete")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert [i.type for i in r.output] == ["message"] and r.output[0].id.startswith("msg_")
    with client.responses.stream(**greedy(instructions="Answer in one word.", input="Name a colour.")) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == text
    client.responses.delete(final.id)
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)
    cut = client.responses.create(**greedy(input="Count from one to fifty.", max_output_tokens=3))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_logprobs_are_chat_completions_own_whole_and_streamed(client):
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: each output token's logprob and its
    alternatives, the same as ``/v1/chat/completions`` gives for the same conversation; streamed, the deltas' logprobs
    join to the same list, and each delta's tokens spell its text."""
    ask = greedy(
        instructions="Answer in one word.",
        input="Name a colour.",
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )  # (an answer that ends: the stream helper wants response.completed)
    r = client.responses.create(**ask)
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}]
    c = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2,
                                       messages=messages)  # fmt: skip
    mine = r.output[0].content[0].logprobs
    theirs = c.choices[0].logprobs.content
    assert 0 < len(mine) == len(theirs) <= r.usage.output_tokens  # (the end-of-sequence token: counted, not listed)
    for a, b in zip(mine, theirs, strict=True):
        assert (a.token, a.logprob, a.bytes) == (b.token, b.logprob, b.bytes)
        assert [(t.token, t.logprob) for t in a.top_logprobs] == [(t.token, t.logprob) for t in b.top_logprobs]
        assert len(a.top_logprobs) == 2
    with client.responses.stream(**ask) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert [lp.token for d in deltas for lp in d.logprobs] == [lp.token for lp in mine]
    assert all("".join(lp.token for lp in d.logprobs) == d.delta for d in deltas)  # (plain ASCII words here)
    assert [lp.logprob for lp in final.output[0].content[0].logprobs] == [lp.logprob for lp in mine]
    plain = client.responses.create(**greedy(input="Name a colour."))
    assert plain.output[0].content[0].logprobs == []  # not asked: none


def test_function_call_round_trip_over_previous_response_id(client):
    """A required call validates against its parameters; its output sent with ``previous_response_id`` (the earlier
    conversation not sent again): the greedy answer is chat completions' for the whole conversation. Streamed, the
    call's arguments reassemble to the whole one's. An unknown previous response is a 404."""
    jsonschema = pytest.importorskip("jsonschema")
    openai = pytest.importorskip("openai")
    r = client.responses.create(**greedy(input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=40))
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    with client.responses.stream(**greedy(input=ASK, tools=[WEATHER], tool_choice="required",
                                          max_output_tokens=40)) as stream:  # fmt: skip
        final = stream.get_final_response()
    assert [(i.name, i.arguments) for i in final.output] == [(call.name, call.arguments)]
    follow = client.responses.create(**greedy(previous_response_id=r.id, tools=[WEATHER], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}]))  # fmt: skip
    c = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, tools=[CHAT_WEATHER], messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "21 C"}])  # fmt: skip
    assert follow.output_text == c.choices[0].message.content and follow.previous_response_id == r.id
    assert follow.usage.input_tokens == c.usage.prompt_tokens
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(**greedy(input=ASK, previous_response_id="resp_unknown"))
    assert e.value.body["param"] == "previous_response_id"


def test_json_schema_output_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}
    r = client.responses.create(**greedy(input="Invent a person.", text=fmt, max_output_tokens=40))
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    free = client.responses.create(**greedy(input="Invent a person.", max_output_tokens=40))
    with pytest.raises(
        (ValueError, jsonschema.ValidationError)
    ):  # the test can fail: without the schema the answer is no such JSON
        jsonschema.validate(json.loads(free.output_text), schema)
