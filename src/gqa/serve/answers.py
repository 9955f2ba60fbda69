"""One answer as the APIs other than OpenAI's chat describe it (Anthropic's Messages, OpenAI's Responses): its text,
the tool calls read from it (``tools``' rules), why it ended (with the stop string that ended it) and its token
counts — whole (``whole_answer``), or as deltas while it streams (``AnswerDeltas``) that add up to the whole one
however the text comes cut. Each API writes these in its own shapes; nothing here is HTTP."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .openai_api import ParsedRequest
from .request import RequestOutput
from .tool_stream import ToolCallStream
from .tools import finish_reason, tool_calls_in

__all__ = ["Answer", "AnswerDeltas", "CallStarted", "MoreArguments", "Text", "whole_answer"]


@dataclass
class Answer:
    """``content``: the text outside the calls (``""`` for none); ``calls``: ``(id, name, arguments)`` each;
    ``reason``: ``"stop"`` (ended by itself or a stop string), ``"length"`` (``max_tokens``), ``"tool_calls"``
    (``tools.finish_reason``) or ``"error"``; ``stop``: the stop string that ended it, if one did."""

    content: str = ""
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    reason: str | None = None
    stop: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Text:
    text: str


@dataclass
class CallStarted:
    """A call begins: its index among the answer's calls, id, name, and its arguments so far."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass
class MoreArguments:
    index: int
    arguments: str


def stop_string(tokenizer, token_ids: list[int], text: str, stops: tuple[str, ...]) -> str | None:
    """The stop string that cut an answer to ``text`` (the detokenizer cut its tokens' text before the first one
    found), or ``None`` where none did."""
    if not stops:
        return None
    rest = tokenizer.decode(token_ids)[len(text) :]
    return next((s for s in stops if rest.startswith(s)), None)


def whole_answer(parsed: ParsedRequest, outputs: list[RequestOutput], tokenizer) -> Answer:
    """The answer made of ``outputs`` (one request's, to its last)."""
    last, text = outputs[-1], "".join(out.text for out in outputs)
    answer = Answer(prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens)
    content, calls = text, []
    if parsed.tools is not None and parsed.tools.choice != "none":
        content, calls = tool_calls_in(text, parsed.tools)
    answer.content = content or ""
    answer.calls = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    answer.reason = finish_reason([a for _, _, a in answer.calls], last.finish_reason)
    if last.finish_reason == "stop":
        ids = [t for out in outputs for t in out.token_ids]
        answer.stop = stop_string(tokenizer, ids, text, parsed.params.stop)
    return answer


class AnswerDeltas:
    """An answer's outputs, fed as they come, as ``Text`` / ``CallStarted`` / ``MoreArguments`` deltas; once the last
    is fed, ``end`` is the ``Answer`` with the whole one's reason, stop string and counts (its content and calls are
    left empty: they are the deltas, added up)."""

    def __init__(self, parsed: ParsedRequest, tokenizer) -> None:
        self.parsed, self.tokenizer = parsed, tokenizer
        tools = parsed.tools
        self.calling = ToolCallStream(tools) if tools is not None and tools.choice != "none" else None
        self.text, self.token_ids = "", []
        self.end: Answer | None = None

    def feed(self, out: RequestOutput) -> list[Text | CallStarted | MoreArguments]:
        self.text += out.text
        self.token_ids += out.token_ids
        if self.calling is None:
            deltas: list = [Text(out.text)] if out.text else []
        else:
            content, calls = self.calling.feed(out.text)
            if out.finished:
                more, last = self.calling.finish()
                content, calls = content + more, calls + last
            deltas = [Text(content)] if content else []
            deltas += [_call_delta(c) for c in calls]
        if out.finished:
            self.end = Answer(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens)
            arguments = self.calling.arguments if self.calling is not None else []
            self.end.reason = finish_reason(arguments, out.finish_reason)
            if out.finish_reason == "stop":
                self.end.stop = stop_string(self.tokenizer, self.token_ids, self.text, self.parsed.params.stop)
        return deltas


def _call_delta(call: dict[str, Any]) -> CallStarted | MoreArguments:
    """A ``ToolCallStream`` delta (OpenAI's ``delta.tool_calls`` item) as a ``CallStarted`` or ``MoreArguments``."""
    f = call["function"]
    if "id" in call:
        return CallStarted(call["index"], call["id"], f["name"], f["arguments"])
    return MoreArguments(call["index"], f["arguments"])
