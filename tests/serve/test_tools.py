"""Function calling: ``tools``/``tool_choice`` checked and turned into grammars (checked here by ``jsonschema`` on
answers that follow them), Hermes ``<tool_call>`` blocks read back, and through ``gqa serve --chat-template`` with
the openai client: forced calls (required and named) whose arguments validate, streamed and not, a tool result sent
back in the conversation, and a template without tools refused."""

from __future__ import annotations

import json

import pytest

from gqa.serve.tools import ToolError, ToolRequest, assistant_message, parse_tools, tool_calls_in
from tests.helpers.server_process import HERMES_TEMPLATE

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                   "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]},
}  # fmt: skip
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                                           "required": ["zone"]}}  # fmt: skip
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
TEMPLATE = HERMES_TEMPLATE


@pytest.mark.parametrize(
    "body,param,message",
    [
        ({"tools": "x"}, "tools", "must be an array"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools", "letters, digits"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools", "must be an object"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "names a function twice"),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be 'none', 'auto', 'required'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "must name one of the tools"),
    ],
)  # fmt: skip
def test_bad_tools_are_refused_by_field(body, param, message):
    with pytest.raises(ToolError, match=message) as e:
        parse_tools(body, TEMPLATE)
    assert e.value.param == param


def test_a_template_without_tools_and_auto_without_hermes_are_refused():
    with pytest.raises(ToolError, match="does not render tools"):
        parse_tools({"tools": TOOLS}, "{{ messages }}")
    with pytest.raises(ToolError, match="Hermes") as e:
        parse_tools({"tools": TOOLS}, "{{ tools }}{{ messages }}")
    assert e.value.param == "tool_choice"
    assert parse_tools({"tools": TOOLS, "tool_choice": "required"}, "{{ tools }}").choice == "required"
    assert parse_tools({"tools": []}, None) is None


def test_forced_choices_are_schemas_that_accept_exactly_the_calls():
    required = parse_tools({"tools": TOOLS, "tool_choice": "required"}, TEMPLATE).structured()
    schema = json.loads(required.spec)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"zone": "UTC"}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = parse_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                        TEMPLATE)  # fmt: skip
    assert named.choice == "get_time" and json.loads(named.structured().spec) == TIME["parameters"]
    assert parse_tools({"tools": TOOLS}, TEMPLATE).structured() is None


def test_calls_are_read_back_from_answers():
    auto = ToolRequest((WEATHER, TIME), "auto")
    text = 'Let me check. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    content, calls = tool_calls_in(text, auto)
    assert content == "Let me check." and [c["function"]["name"] for c in calls] == ["get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"} and calls[0]["id"].startswith("call_")
    unknown = '<tool_call>{"name": "launch", "arguments": {}}</tool_call>'
    assert tool_calls_in(unknown, auto) == (unknown, [])  # not a known function: left as text
    assert tool_calls_in("just text", auto) == ("just text", [])
    content, calls = tool_calls_in('[{"name": "get_time", "parameters": {"zone": "CET"}}]',
                                   ToolRequest((WEATHER, TIME), "required"))  # fmt: skip
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"zone": "CET"}
    content, calls = tool_calls_in('{"zone": "CET"}', ToolRequest((WEATHER, TIME), "get_time"))
    assert calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "CET"}'}
    sent = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    m = assistant_message({"role": "assistant", "content": None, "tool_calls": [sent]})
    assert m["content"] == "" and m["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}


@pytest.fixture(scope="module")
def client(hermes_server):
    """The openai client of tests/serve's ``gqa serve --chat-template`` with the Hermes template (conftest)."""
    pytest.importorskip("xgrammar")
    openai = pytest.importorskip("openai")
    from tests.helpers.server_process import HERMES_KEY

    return openai.OpenAI(base_url=hermes_server.url + "/v1", api_key=HERMES_KEY, max_retries=0, timeout=60)


def test_tool_calls_through_gqa_serve_and_the_openai_client(client):
    """``--chat-template`` with tools: a required call and a named call validate against their parameters (streamed
    the same), the conversation goes on with the tool's result."""
    from tests.helpers.server_process import MODEL

    messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                       max_tokens=64, temperature=0)  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        f = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), f["parameters"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named,
                                       max_tokens=64, temperature=0)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["parameters"])
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named,
                                                 max_tokens=64, temperature=0, stream=True))  # fmt: skip
    streamed = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    assert streamed[0].function.name == "get_weather" and streamed[0].id.startswith("call_")
    assert len(streamed) > 2 and all(t.index == 0 and t.function.name is None for t in streamed[1:])  # pieces
    assert "".join(t.function.arguments for t in streamed) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    required = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                              max_tokens=64, temperature=0)  # fmt: skip
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                 tool_choice="required", max_tokens=64, temperature=0,
                                                 stream=True))  # fmt: skip
    merged: dict[int, list] = {}
    for t in (t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()):
        merged.setdefault(t.index, [t.function.name, ""])[1] += t.function.arguments
    want = [(c.function.name, json.loads(c.function.arguments)) for c in required.choices[0].message.tool_calls]
    assert [(name, json.loads(args)) for name, args in merged.values()] == want
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    follow = [*messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, tool_choice="none",
                                       max_tokens=16, temperature=0)  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.content


MESSAGES = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def answer(client, stream: bool, **request) -> tuple[str, list[tuple[str, str]], str]:
    """A chat answer through the openai client, whole or streamed (its deltas merged): the content ("" for none),
    ``(name, arguments)`` per call, the finish_reason."""
    from tests.helpers.server_process import MODEL

    request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0} | request
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.message.content or "", calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for t in choice.delta.tool_calls or ():
                calls.setdefault(t.index, [t.function.name, ""])[1] += t.function.arguments
            reason = choice.finish_reason or reason
    return content, [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize(("choice", "cuts"), [("required", (3, 26)), (NAMED, (3, 14))], ids=["required", "named"])
def test_forced_calls_are_json_whatever_the_stop_strings_and_say_length_when_cut(client, choice, cuts):
    """Issue 69: stop strings that a forced call's JSON holds cut it — "required" answered 500 plain text, a named
    function 200 ``"tool_calls"`` with arguments that are not JSON, streamed ``"stop"``. Stop strings do not apply to
    a forced call; ``max_tokens`` cuts it into its text so far with ``"length"`` (``cuts``: before a call has begun
    or within it, then inside its arguments); streamed and whole are the same."""
    full = answer(client, False, tool_choice=choice, stop=['"', ","], max_tokens=64)
    assert answer(client, True, tool_choice=choice, stop=['"', ","], max_tokens=64) == full
    content, calls, reason = full
    assert reason == "tool_calls" and content == "" and calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), {"get_weather": WEATHER, "get_time": TIME}[name]["parameters"])
    for max_tokens in cuts:
        cut = answer(client, False, tool_choice=choice, max_tokens=max_tokens)
        assert answer(client, True, tool_choice=choice, max_tokens=max_tokens) == cut
        assert cut[0] == "" and cut[2] == "length"
        for (name, arguments), (full_name, full_arguments) in zip(cut[1], calls, strict=False):
            assert name == full_name and full_arguments.startswith(arguments)
    assert cut[1] and cut[1][-1][1] != calls[len(cut[1]) - 1][1]  # the last cut is inside a call's arguments


def test_auto_answers_read_the_same_streamed_and_whole(client):
    """Issue 69: a call followed by text cut by ``max_tokens`` said ``"tool_calls"`` whole and ``"length"`` streamed;
    a block with text before its JSON was content whole and a call streamed. The model held by a regex to such
    answers: a call and text (``"tool_calls"``), the same cut (``"length"``, the call kept), text before the JSON."""
    call = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'
    text = " I will tell you the time in UTC as soon as the tool answers, which should not take long at all."
    held = {"extra_body": {"structured_outputs": {"regex": call + text.replace(".", r"\.")}}}
    full = answer(client, False, max_tokens=100, **held)
    assert full == (text.strip(), [("get_time", '{"zone": "UTC"}')], "tool_calls")
    assert answer(client, True, max_tokens=100, **held) == full
    cut = answer(client, False, max_tokens=30, **held)
    assert cut[1:] == (full[1], "length") and text.strip().startswith(cut[0]) and cut[0] != text.strip()
    assert answer(client, True, max_tokens=30, **held) == cut
    before = {"extra_body": {"structured_outputs": {"regex": r'<tool_call>Sure: \{"name": "get_time"\}</tool_call>'}}}
    whole = answer(client, False, max_tokens=40, **before)
    assert whole == ('<tool_call>Sure: {"name": "get_time"}</tool_call>', [], "stop")
    assert answer(client, True, max_tokens=40, **before) == whole


def logprob_tokens(client, stream: bool, **request) -> list[tuple[str, list[int]]]:
    """A chat answer's logprobs, whole or streamed (the chunks' lists joined): ``(token, bytes)`` per token."""
    from tests.helpers.server_process import MODEL

    request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "temperature": 0, "logprobs": True} | request
    if not stream:
        return [(t.token, t.bytes) for t in client.chat.completions.create(**request).choices[0].logprobs.content]
    chunks = client.chat.completions.create(stream=True, **request)
    return [(t.token, t.bytes) for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content or ()]


@pytest.mark.parametrize("choice", ["auto", "required", NAMED], ids=["auto", "required", "named"])
def test_streamed_tool_answers_carry_the_logprobs_the_whole_ones_do(client, choice):
    """A streamed answer that may call tools sent no logprobs at all while the whole one listed every token's: the
    tokens a chunk's text or calls came from go with it (those held back until a block closes, with the chunk after)."""
    call = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call> Done\.'
    held = {"extra_body": {"structured_outputs": {"regex": call}}} if choice == "auto" else {}
    whole = logprob_tokens(client, False, tool_choice=choice, max_tokens=48, **held)
    assert len(whole) > 5 and b"".join(bytes(b) for _, b in whole)
    assert logprob_tokens(client, True, tool_choice=choice, max_tokens=48, **held) == whole
