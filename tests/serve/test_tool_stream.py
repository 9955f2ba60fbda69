"""Tool calls streamed piece by piece (``serve.tool_stream``): whatever the pieces, the content and the calls they
add up to are what ``tools.tool_calls_in`` reads from the whole answer (names, ids once, the arguments' JSON), and
the calls start as soon as they are known."""

from __future__ import annotations

import json
import random

import pytest

from gqa.serve.tool_stream import JsonObjectScanner, ToolCallStream
from gqa.serve.tools import ToolRequest, tool_calls_in

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}
AUTO = ToolRequest((WEATHER, TIME), "auto")

ANSWERS = {
    "text only": (AUTO, "  The weather is fine < really >.\n"),
    "one call": (AUTO, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Lutetia\\" {x}"}}\n'
                       "</tool_call>"),
    "text, two calls, text": (AUTO, 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
                                    '\n</tool_call>\n<tool_call>{"arguments": {"city": "Oslo", "n": [1, {"a": 2}]},'
                                    ' "name": "get_weather"}</tool_call>\nDone.  '),
    "unknown function stays text": (AUTO, 'Hi <tool_call>{"name": "launch", "arguments": {}}</tool_call> there'),
    "string arguments stay text": (AUTO, '<tool_call>{"name": "get_time", "arguments": "UTC"}</tool_call>'),
    "broken block stays text": (AUTO, 'a <tool_call>{"name": "get_time", "arguments" </tool_call> b'),
    "required, two calls": (ToolRequest((WEATHER, TIME), "required"),
                            '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", '
                            '"parameters": {"zone": "CET"}}]'),
    "named": (ToolRequest((WEATHER, TIME), "get_weather"), '{"city": "Lima", "deep": {"x": [1, 2]}}'),
    "none": (ToolRequest((WEATHER, TIME), "none"), 'text <tool_call>{"name": "get_time"}</tool_call>'),
}  # fmt: skip


def streamed(request: ToolRequest, pieces: list[str]) -> tuple[str, list[dict]]:
    """The content and the calls (merged by index) the stream's deltas add up to."""
    stream, content, calls = ToolCallStream(request), "", {}
    for piece in [*pieces, None]:
        more, deltas = stream.feed(piece) if piece is not None else stream.finish()
        content += more
        for d in deltas:
            if "id" in d:
                assert d["index"] not in calls and d["type"] == "function" and d["id"].startswith("call_")
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}
            else:
                assert "name" not in d["function"]
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls))) == list(range(stream.calls))
    return content, [calls[i] for i in sorted(calls)]


def pieces_of(text: str, how: str, rng: random.Random) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 7)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("how", ["whole", "chars", "random"])
@pytest.mark.parametrize("case", list(ANSWERS))
def test_the_pieces_add_up_to_the_whole_answer(case, how):
    request, text = ANSWERS[case]
    content, calls = streamed(request, pieces_of(text, how, random.Random(len(text))))
    want_content, want_calls = tool_calls_in(text, request)
    assert [c["name"] for c in calls] == [c["function"]["name"] for c in want_calls]
    for got, want in zip(calls, want_calls, strict=True):
        assert json.loads(got["arguments"]) == json.loads(want["function"]["arguments"])
    assert content == (want_content or ""), (content, want_content)


def test_a_call_starts_as_soon_as_its_name_and_arguments_begin():
    stream = ToolCallStream(AUTO)
    assert stream.feed('Sure. <tool_call>{"name": "get_weather", ') == ("Sure.", [])
    content, deltas = stream.feed('"arguments": {"ci')
    assert content == "" and deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[1]["function"] == {"arguments": '{"ci'}
    assert stream.feed('ty": "Paris"}}')[1] == [{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]
    assert stream.feed("</tool_call>") == ("", []) and stream.finish() == ("", [])


def test_a_block_broken_inside_its_arguments_has_started_its_call():
    """What streaming cannot take back (vLLM's neither): a call starts once its arguments begin; if the model then
    breaks the block, the whole answer keeps the block as text while the stream has sent the call's start."""
    text = 'a <tool_call>{"name": "get_time", "arguments": {"zone": </tool_call> b'
    content, calls = streamed(AUTO, [text])
    assert tool_calls_in(text, AUTO) == (text, [])
    assert [c["name"] for c in calls] == ["get_time"] and content == "a  b"


def test_the_scanner_reads_keys_in_any_order_and_nested_values():
    s = JsonObjectScanner("arguments")
    text = '{"arguments": {"a": "}", "b": [1, {"c": "\\""}]}, "x": 1.5, "name": "f"} trailing'
    for c in text:
        s.feed(c)
    assert s.name == "f" and s.done and s.text[s.end - 1] == "}"
    assert json.loads(s.text[s.args_start : s.args_end]) == {"a": "}", "b": [1, {"c": '"'}]}


@pytest.mark.parametrize(
    ("request_", "text", "reason", "want"),
    [
        (AUTO, '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', "stop", "tool_calls"),
        (AUTO, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "U', "length", "length"),  # cut
        (AUTO, '<tool_call>{"name": "get_time", "arguments": {"zone": "U"}, "x": oops}</tool_call>', "stop", "stop"),
        (AUTO, "no calls", "stop", "stop"),
        (ToolRequest((WEATHER, TIME), "get_time"), '{"zone": "U', "length", "length"),
        (ToolRequest((WEATHER, TIME), "get_time"), '{"zone": "UTC"}', "stop", "tool_calls"),
        (ToolRequest((WEATHER, TIME), "required"), '[{"name": "get_time", "parameters": {}}]', "stop", "tool_calls"),
    ],
)
def test_the_finish_reason_is_the_whole_answers(request_, text, reason, want):
    """``tool_calls`` only where every call the stream started is whole and valid; a cut call keeps ``length``."""
    stream = ToolCallStream(request_)
    stream.feed(text)
    stream.finish()
    assert stream.finish_reason(reason) == want
