"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``): the translation to a chat prompt and the
stream's events without a server, then ``gqa serve`` (the Hermes template, an API key) through the official
``anthropic`` client (the shared server of conftest): greedy answers equal to ``/v1/chat/completions``' for the same
conversation, streams that reassemble to the whole answer, a tool use round trip, stop sequences, and errors in
Anthropic's shape."""

from __future__ import annotations

import json
import urllib.request

import pytest

from gqa.loaders import load_tokenizer
from gqa.serve.answers import Answer, CallStarted, MoreArguments, Text
from gqa.serve.anthropic_api import MessageEvents, count_tokens, error_body, parse_messages
from gqa.serve.openai_api import ApiError
from tests.helpers.server_process import HERMES_KEY as KEY
from tests.helpers.server_process import HERMES_TEMPLATE, MODEL, get, post

pytest.importorskip("starlette")

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}  # fmt: skip
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer():
    tok = load_tokenizer()
    tok.use_chat_template(HERMES_TEMPLATE)
    return tok


def test_messages_render_as_the_chat_they_translate_to(tokenizer):
    """System blocks, a tool use and its result, text beside them, tools: the prompt is the chat template's for the
    OpenAI messages they stand for (tool_result: a ``tool`` message before the user's text), and count_tokens
    counts exactly it; ``max_tokens`` is cut to what the context leaves, ``stop_sequences`` kept."""
    body = {
        "model": MODEL, "max_tokens": 10**6, "stop_sequences": ["a", "b", "c", "d", "e"], "tools": [WEATHER],
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                     {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                   "content": [{"type": "text", "text": "21 C"}]},
                                                  {"type": "text", "text": "And so?"}]}],
    }  # fmt: skip
    chat = [{"role": "system", "content": "Be brief."}, *ASK,
            {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
            {"role": "user", "content": "And so?"}]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]  # fmt: skip
    expected = tokenizer.apply_chat(chat, tools=tools)
    parsed = parse_messages(body, tokenizer, [MODEL], context=8192, pool=4096)
    assert parsed.prompt_ids == expected and parsed.tools.choice == "auto"
    assert parsed.params.max_tokens == 4096 - len(expected) and parsed.params.stop == ("a", "b", "c", "d", "e")
    assert count_tokens(body, tokenizer, [MODEL]) == len(expected)
    prefill = {"max_tokens": 5, "messages": [*ASK, {"role": "assistant", "content": "It is"}]}
    text = tokenizer.render_chat(ASK) + "It is"
    assert parse_messages(prefill, tokenizer, [MODEL], 8192).prompt_ids == tokenizer.encode(text, False)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"messages": ASK}, "max_tokens", "'max_tokens' is required"),
        ({"max_tokens": 0, "messages": ASK}, "max_tokens", "must be >= 1"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages", "'user' or 'assistant'"),
        ({"max_tokens": 5, "messages": []}, "messages", "at least one message"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages",
         "only text blocks"),
        ({"max_tokens": 5, "messages": ASK, "stop_sequences": [""]}, "stop_sequences", "non-empty strings"),
        ({"max_tokens": 5, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "always"}}, "tool_choice",
         "'auto', 'any', 'tool' or 'none'"),
        ({"max_tokens": 5, "messages": ASK, "tools": [{"name": "f"}]}, "tools", "input_schema: must be an object"),
        ({"max_tokens": 5, "messages": ASK, "temperature": 3}, "temperature", "must be in [0, 2]"),
    ],
)  # fmt: skip
def test_bad_requests_name_their_field(tokenizer, body, param, message):
    with pytest.raises(ApiError, match=message.replace("[", r"\[").replace("(", r"\(")) as e:
        parse_messages(body, tokenizer, [MODEL], 8192)
    assert e.value.status == 400 and e.value.param == param
    assert error_body(e.value) == {"type": "error", "error": {"type": "invalid_request_error", "message": str(e.value)}}
    assert error_body(ApiError("x", 529))["error"]["type"] == "overloaded_error"


def sse(events: list[str]) -> list[dict]:
    """Server-sent events' data, each checked to name its type as its ``event:`` line does."""
    out = []
    for e in events:
        kind, data = e.split("\n")[:2]
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        out.append(body)
    return out


def test_stream_events_open_and_close_a_block_per_text_run_and_tool_use():
    events = MessageEvents("msg_1", MODEL)
    sent = events.start(7) + events.deltas([Text("Hi"), Text(" there"), CallStarted(0, "call_ab", "f", "")])
    sent += events.deltas([MoreArguments(0, '{"a"'), MoreArguments(0, ": 1}")])
    sent += events.end(Answer(reason="tool_calls", prompt_tokens=7, completion_tokens=9))
    got = sse(sent)
    assert [e["type"] for e in got] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    assert got[0]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}
    assert got[6]["content_block"] == {"type": "tool_use", "id": "toolu_ab", "name": "f", "input": {}}
    json_deltas = [e["delta"]["partial_json"] for e in got if e["type"] == "content_block_delta" and e["index"] == 1]
    assert "".join(json_deltas) == '{"a": 1}'
    assert got[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert got[-2]["usage"]["output_tokens"] == 9


# -- through gqa serve --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(hermes_server):
    from gqa import kernels

    if not kernels.vectorized():
        pytest.skip("native SIMD kernels not built on this machine")
    return hermes_server


@pytest.fixture(scope="module")
def client(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def chat(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def blocks(message) -> list[dict]:
    """A message's content blocks as JSON (what a stream's final message adds, ``parsed_output``, left out)."""
    return [{k: v for k, v in b.to_dict().items() if k != "parsed_output"} for b in message.content]


def greedy(**request) -> dict:
    return {"model": MODEL, "max_tokens": 12, "extra_body": {"temperature": 0}} | request


def test_greedy_answers_are_chat_completions_own_and_streams_reassemble_them(client, chat):
    """A system prompt and a multi-turn conversation, greedy: the text, stop reason and token counts are what
    ``/v1/chat/completions`` answers to the same conversation; the SDK's stream helper reassembles the same message;
    count_tokens is the prompt's count."""
    turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
             {"role": "user", "content": "Another one?"}]  # fmt: skip
    r = client.messages.create(**greedy(system="Answer in one word.", messages=turns))
    c = chat.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Answer in one word."},
                                     *turns], max_tokens=12, temperature=0)  # fmt: skip
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == c.choices[0].message.content
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[c.choices[0].finish_reason]
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == MODEL
    with client.messages.stream(**greedy(system="Answer in one word.", messages=turns)) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == r.content[0].text and blocks(final) == blocks(r) and final.stop_reason == r.stop_reason
    assert final.usage.output_tokens == r.usage.output_tokens and final.usage.input_tokens == r.usage.input_tokens
    counted = client.messages.count_tokens(model=MODEL, system="Answer in one word.", messages=turns)
    assert counted.input_tokens == r.usage.input_tokens


def test_the_raw_stream_is_anthropics_event_sequence(server):
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "messages": ASK, "temperature": 0}
    request = urllib.request.Request(server.url + "/v1/messages", data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "x-api-key": KEY, "anthropic-version": "2023-06-01"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as r:
        events = sse([e for e in r.read().decode().split("\n\n") if e])
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and kinds[-2:] == ["message_delta",
                                                                                           "message_stop"]  # fmt: skip
    assert set(kinds[3:-3]) == {"content_block_delta"} and kinds[-3] == "content_block_stop"
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 3


def test_tool_use_round_trip(client, chat):
    """``any``: a tool use whose input validates against its schema (``tool_use``); a named tool streamed: the
    SDK's reassembled input is the whole answer's; the tool's result sent back: the greedy answer is chat
    completions' for the same conversation in OpenAI's shape."""
    jsonschema = pytest.importorskip("jsonschema")
    r = client.messages.create(**greedy(messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}, max_tokens=40))
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"]
    use = r.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    named = greedy(messages=ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=40)
    whole = client.messages.create(**named)
    with client.messages.stream(**named) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == whole.content[0].input and final.stop_reason == whole.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}
    follow = [*ASK, {"role": "assistant", "content": [use.model_dump()]}, {"role": "user", "content": [result]}]
    answer = client.messages.create(**greedy(messages=follow, tools=[WEATHER]))
    call = {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
    c = chat.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, tools=[
        {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                          "parameters": WEATHER["input_schema"]}}],
        messages=[*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": use.id, "content": "21 C"}])  # fmt: skip
    assert answer.content[0].text == c.choices[0].message.content and answer.stop_reason in ("end_turn", "max_tokens")


def test_stop_sequences_end_the_answer_and_are_named(client):
    free = client.messages.create(**greedy(messages=ASK, max_tokens=16)).content[0].text
    word = free.split()[2]  # a word the answer reaches
    r = client.messages.create(**greedy(messages=ASK, max_tokens=16, stop_sequences=["zzz", word]))
    assert r.content[0].text == free[: free.index(word)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == word
    with client.messages.stream(**greedy(messages=ASK, max_tokens=16, stop_sequences=["zzz", word])) as stream:
        final = stream.get_final_message()
    assert blocks(final) == blocks(r) and (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)


def test_errors_are_anthropics_shape_and_status(client, server):
    anthropic = pytest.importorskip("anthropic")
    for body, message in (({"model": MODEL, "messages": ASK}, "'max_tokens' is required"),
                          ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]},
                           "messages[0].role: must be 'user' or 'assistant'")):  # fmt: skip
        with pytest.raises(anthropic.BadRequestError) as e:
            client.post("/v1/messages", body=body, cast_to=anthropic.types.Message)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert message in e.value.message
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="nope", max_tokens=5, messages=ASK)
    status, text = get(server.url + "/v1/messages", {"x-api-key": KEY})  # a route's own refusal, in the same shape
    assert status == 405 and json.loads(text)["error"]["type"] == "invalid_request_error"
    counted = post(server.url + "/v1/messages/count_tokens", {"messages": ASK}, {"Authorization": f"Bearer {KEY}"})
    assert counted[0] == 200 and counted[1]["input_tokens"] > 0  # a bearer key serves as well as x-api-key
    stranger = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        stranger.messages.create(model=MODEL, max_tokens=5, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
