"""Tool calls streamed piece by piece (``serve.tool_stream``): whatever the answer and however it is cut into pieces,
the content, the calls (names, ids once, the arguments' text) and the finish_reason the deltas add up to are exactly
what ``tools.tool_calls_in`` and ``tools.finish_reason`` read from the whole answer — checked on a table of answers
and on answers hypothesis builds from tricky pieces (blocks with text around their JSON, unclosed, invalid, unknown
names, several calls), cut anywhere by ``max_tokens`` or a stop string."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gqa.serve.tool_stream import JsonObjectScanner, ToolCallStream
from gqa.serve.tools import ToolRequest, finish_reason, tool_calls_in

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}
AUTO = ToolRequest((WEATHER, TIME), "auto")
REQUIRED = ToolRequest((WEATHER, TIME), "required")
NAMED = ToolRequest((WEATHER, TIME), "get_weather")
CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'

ANSWERS = {
    "text only": (AUTO, "  The weather is fine < really >.\n"),
    "one call": (AUTO, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Lutetia\\" {x}"}}\n'
                       "</tool_call>"),
    "text, two calls, text": (AUTO, 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}'
                                    '\n</tool_call>\n<tool_call>{"arguments": {"city": "Oslo", "n": [1, {"a": 2}]},'
                                    ' "name": "get_weather"}</tool_call>\nDone.  '),
    "text before a call keeps its lead": (AUTO, "  Hi " + CALL + " "),
    "unknown function stays text": (AUTO, 'Hi <tool_call>{"name": "launch", "arguments": {}}</tool_call> there'),
    "string arguments stay text": (AUTO, '<tool_call>{"name": "get_time", "arguments": "UTC"}</tool_call>'),
    "broken block stays text": (AUTO, 'a <tool_call>{"name": "get_time", "arguments" </tool_call> b'),
    "text before the JSON stays text": (AUTO, '<tool_call>Sure: {"name": "get_time", "arguments": {}}</tool_call>'),
    "space JSON does not take stays text": (AUTO, '<tool_call>\x0c{"name": "get_time", "arguments": {}}</tool_call>'),
    "NaN arguments stay text": (AUTO, '<tool_call>{"name": "get_time", "arguments": {"n": NaN}}</tool_call>'),
    "a list for a name stays text": (AUTO, '<tool_call>{"name": ["get_time"], "arguments": {}}</tool_call>'),
    "unclosed block stays text": (AUTO, 'x <tool_call>{"name": "get_time", "arguments": {}}'),
    "required, two calls": (REQUIRED, '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", '
                                      '"parameters": {"zone": "CET"}}]'),
    "required, cut in the second call": (REQUIRED, '[{"name": "get_weather", "parameters": {"city": "Rome"}}, '
                                                   '{"name": "get_time", "parameters": {"zo'),
    "named": (NAMED, '{"city": "Lima", "deep": {"x": [1, 2]}}'),
    "none": (ToolRequest((WEATHER, TIME), "none"), 'text <tool_call>{"name": "get_time"}</tool_call>'),
}  # fmt: skip


def streamed(request: ToolRequest, pieces: list[str], reason: str = "stop") -> tuple[str, list[tuple], str | None]:
    """What the stream's deltas add up to: the content, ``(name, arguments)`` per call (merged by index), the
    finish_reason given the engine's ``reason``."""
    stream, content, calls = ToolCallStream(request), "", {}
    for piece in [*pieces, None]:
        more, deltas = stream.feed(piece) if piece is not None else stream.finish()
        content += more
        for d in deltas:
            if "id" in d:
                assert d["index"] not in calls and d["type"] == "function" and d["id"].startswith("call_")
                calls[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
            else:
                assert "name" not in d["function"]
                calls[d["index"]][1] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls))) == list(range(stream.calls))
    return content, [tuple(calls[i]) for i in sorted(calls)], stream.finish_reason(reason)


def whole(request: ToolRequest, text: str, reason: str = "stop") -> tuple[str, list[tuple], str | None]:
    """What the whole answer reads as, in ``streamed``'s form (no content is ``""`` streamed)."""
    content, calls = tool_calls_in(text, request)
    arguments = [c["function"]["arguments"] for c in calls]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    return (
        content or "",
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
        finish_reason(arguments, reason),
    )


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
    for reason in ("stop", "length"):
        assert streamed(request, pieces_of(text, how, random.Random(len(text))), reason) == whole(request, text, reason)


def test_what_the_whole_answer_reads():
    """The rules (``tools``' docstring) on the cases the issue found: a call, then text cut by ``max_tokens``, is a
    call with ``length``; a block with text before its JSON is content; a cut forced call is its text so far."""
    assert whole(AUTO, CALL + " The time is", "length") == ("The time is", [("get_time", '{"zone": "UTC"}')], "length")
    assert whole(AUTO, CALL + "\n", "stop") == ("", [("get_time", '{"zone": "UTC"}')], "tool_calls")
    assert whole(AUTO, "  Hi " + CALL + " ", "stop")[0] == "  Hi"  # the lead is dropped only before a first call
    assert whole(AUTO, " \n" + CALL + " Hi", "stop")[0] == "Hi"
    text = ANSWERS["text before the JSON stays text"][1]
    assert whole(AUTO, text, "stop") == (text, [], "stop")
    cut = ANSWERS["required, cut in the second call"][1]
    assert whole(REQUIRED, cut, "length") == ("", [("get_weather", '{"city": "Rome"}'), ("get_time", '{"zo')], "length")
    assert whole(REQUIRED, '[{"name": "get_wea', "length") == ("", [], "length")
    assert whole(NAMED, '{"city": "Li', "length") == ("", [("get_weather", '{"city": "Li')], "length")
    assert whole(NAMED, '{"city": "Li', "stop")[2] == "stop"  # never "tool_calls" with arguments that are not JSON
    assert whole(NAMED, '{"city": "Lima"}', "stop")[2] == "tool_calls"


def test_an_auto_call_goes_out_whole_when_its_block_closes():
    """A Hermes block is judged at its ``</tool_call>`` (the model writes it unconstrained): the call's id, name and
    arguments in one delta then; text before it goes out as soon as it cannot open a block."""
    stream = ToolCallStream(AUTO)
    assert stream.feed('Sure. <tool_call>{"name": "get_weather", ') == ("Sure.", [])
    assert stream.feed('"arguments": {"city": "Paris"}}</tool_') == ("", [])
    content, (delta,) = stream.feed("call> ")
    assert content == "" and delta["index"] == 0 and delta["id"].startswith("call_")
    assert delta["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert stream.finish() == ("", []) and stream.finish_reason("stop") == "tool_calls"


def test_forced_calls_stream_their_arguments_as_they_come():
    stream = ToolCallStream(REQUIRED)
    assert stream.feed('[{"name": "get_time", ') == ("", [])
    (start, more) = stream.feed('"parameters": {"zo')[1]
    assert start["function"] == {"name": "get_time", "arguments": ""} and more["function"] == {"arguments": '{"zo'}
    assert stream.feed('ne": "UTC"}}]')[1] == [{"index": 0, "function": {"arguments": 'ne": "UTC"}'}}]


def test_the_scanner_reads_keys_in_any_order_and_nested_values():
    s = JsonObjectScanner("arguments")
    text = '{"arguments": {"a": "}", "b": [1, {"c": "\\""}]}, "x": 1.5, "name": "f"} trailing'
    for c in text:
        s.feed(c)
    assert s.name == "f" and s.done and s.text[s.end - 1] == "}"
    assert json.loads(s.text[s.args_start : s.args_end]) == {"a": "}", "b": [1, {"c": '"'}]}


# -- any answer, any pieces ---------------------------------------------------------------------------------------

# what Hermes answers are made of: text, whitespace JSON does and does not take, the markers and their beginnings,
# block contents that are calls and that are not
TEXT = ["Let me check.", "ok", " ", "\n", "\t", "\x0c", "\xa0", "  \n ", "<", "<tool", "</tool_", "<tool_call>",
        "</tool_call>", "é😀", "}", "[[[", '"']  # fmt: skip
INSIDE = ['{"name": "get_time", "arguments": {"zone": "UTC"}}', '{"name": "get_time"}',
          '\n{"arguments": {"n": [1, {"a": "</tool_call>"}]}, "name": "get_weather"}\n',
          '{"name": "get_weather", "arguments": {"city": "Oslo \\"x\\" <tool_call>"}}',
          'Sure {"name": "get_time", "arguments": {}}', '{"name": "get_time", "arguments": {}} ok',
          '{"name": "launch", "arguments": {}}', '{"name": "get_time", "arguments": "UTC"}',
          '{"name": "get_time", "arguments": {"x": NaN}}', '{"name": ["get_time"], "arguments": {}}',
          '{"name": "get_time", "arguments": {"zone": ', "[" * 3000, ""]  # fmt: skip
block = st.builds(lambda a, inside, b: f"<tool_call>{a}{inside}{b}</tool_call>", st.sampled_from(["", "\n", " \x0c"]),
                  st.sampled_from(INSIDE), st.sampled_from(["", "\n", "\t "]))  # fmt: skip
hermes = st.lists(st.one_of(st.sampled_from(TEXT), block, st.text(max_size=4)), max_size=10).map("".join)
# what a grammar's JSON holds (no NaN or Infinity: they are not JSON)
scalar = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6)
)
JSON = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
                    max_leaves=8)  # fmt: skip
parameters = st.dictionaries(st.text(max_size=5), JSON, max_size=3)
layout = st.sampled_from([{}, {"indent": 1}, {"separators": (",", ":")}, {"ensure_ascii": False}])
name = st.sampled_from(["get_weather", "get_time"])
calls = st.lists(st.builds(lambda n, p: {"name": n, "parameters": p}, name, parameters), min_size=1, max_size=3)


def cut_and_split(data: st.DataObject, text: str) -> tuple[list[str], str, int]:
    """The answer cut where ``max_tokens`` or a stop string may cut it (or not), in random pieces."""
    end = data.draw(st.one_of(st.just(len(text)), st.integers(0, len(text))))
    reason = data.draw(st.sampled_from(["stop", "length"]))
    cuts = sorted(data.draw(st.sets(st.integers(1, end - 1), max_size=8))) if end > 1 else []
    text = text[:end]
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)], reason, end


@settings(max_examples=400, deadline=None)
@given(hermes, st.data())
def test_auto_answers_read_the_same_streamed_and_whole(text, data):
    pieces, reason, end = cut_and_split(data, text)
    assert streamed(AUTO, pieces, reason) == whole(AUTO, text[:end], reason)


@settings(max_examples=200, deadline=None)
@given(calls, layout, st.data())
def test_required_answers_read_the_same_streamed_and_whole(answer, how, data):
    text = json.dumps(answer, **how)
    pieces, reason, end = cut_and_split(data, text)
    got = streamed(REQUIRED, pieces, reason)
    assert got == whole(REQUIRED, text[:end], reason)
    if end == len(text):  # the whole array: its calls, their arguments as written
        assert [(name, json.loads(a)) for name, a in got[1]] == [(c["name"], c["parameters"]) for c in answer]
        assert got[2] == reason.replace("stop", "tool_calls")


@settings(max_examples=100, deadline=None)
@given(parameters, layout, st.data())
def test_named_answers_read_the_same_streamed_and_whole(arguments, how, data):
    text = json.dumps(arguments, **how)
    pieces, reason, end = cut_and_split(data, text)
    assert streamed(NAMED, pieces, reason) == whole(NAMED, text[:end], reason) == ("", [("get_weather", text[:end])],
        "tool_calls" if reason == "stop" and end == len(text) else reason)  # fmt: skip
