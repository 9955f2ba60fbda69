"""Anthropic's Messages API shapes (``POST /v1/messages``, ``/v1/messages/count_tokens``): a request read and checked
(a bad field is an ``ApiError`` naming it, answered in Anthropic's error shape), translated to the chat request the
OpenAI path parses (``openai_api.parse_chat``), and answers written back as a message or its stream's events. No HTTP
here (``messages_routes`` does that).

The translation: ``system`` (a string or text blocks) is a system message first; a user message's ``tool_result``
blocks are ``tool`` messages (before the text beside them), an assistant message's ``tool_use`` blocks its
``tool_calls``; ``tools`` (``name``, ``description``, ``input_schema``) are functions, and ``tool_choice``'s
``auto`` / ``any`` / ``tool`` / ``none`` OpenAI's ``auto`` / ``required`` / a named function / ``none``, held by the
same grammars (``tools``). A last assistant message is a prefill: the answer continues it. ``max_tokens`` (required)
is cut to what the context and the KV cache leave (agents ask for more than a small model's context);
``temperature``, ``top_p`` and ``top_k`` are read from the body (where the SDK's ``extra_body`` puts them).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from .answers import Answer, CallStarted, MoreArguments, Text
from .openai_api import ApiError, ParsedRequest, _get, chat_prompt, parse_chat, to_json

__all__ = ["MessageEvents", "count_tokens", "error_body", "message_body", "parse_messages"]

MAX_STOP_SEQUENCES = 64  # each is looked for in the text after every token
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}  # fmt: skip
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_body(e: ApiError) -> dict[str, Any]:
    """``e`` in Anthropic's error shape (its ``type`` by the status, as Anthropic's API types its errors)."""
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _blocks(content: Any, name: str) -> list[dict[str, Any]]:
    """A message's ``content``: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise ApiError(f"{name}: must be a string or an array of content blocks", param="messages")
    return content


def _text(blocks: list[dict[str, Any]], name: str) -> str:
    """Text blocks' text, joined; any other block is refused."""
    for i, b in enumerate(blocks):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise ApiError(f"{name}[{i}]: only text blocks are supported here, got {str(b.get('type'))[:40]!r}",
                           param="messages")  # fmt: skip
    return "".join(b["text"] for b in blocks)


def _messages(messages: list, system: Any) -> tuple[list[dict[str, Any]], str]:
    """The chat messages of ``system`` and ``messages``, and the prefill (a last assistant message's text)."""
    chat = []
    if system is not None:
        text = system if isinstance(system, str) else _text(_blocks(system, "system"), "system")
        chat.append({"role": "system", "content": text})
    prefill = ""
    for i, m in enumerate(messages):
        name = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{name}: must be an object", param="messages")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise ApiError(f"{name}.role: must be 'user' or 'assistant', got {json.dumps(role)[:40]}",
                           param="messages")  # fmt: skip
        blocks = _blocks(m.get("content"), f"{name}.content")
        if role == "user":
            results = 0
            for j, b in enumerate(blocks):
                if b.get("type") != "tool_result":
                    continue
                if not isinstance(b.get("tool_use_id"), str):
                    raise ApiError(f"{name}.content[{j}]: a tool_result needs a 'tool_use_id' string", param="messages")
                output = b.get("content", "")
                if not isinstance(output, str):
                    where = f"{name}.content[{j}].content"
                    output = _text(_blocks(output, where), where)
                chat.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": output})
                results += 1
            rest = [b for b in blocks if b.get("type") != "tool_result"]
            if rest or not results:
                chat.append({"role": "user", "content": _text(rest, f"{name}.content")})
            continue
        calls = []
        for b in blocks:
            if b.get("type") != "tool_use":
                continue
            if not all(isinstance(b.get(k), t) for k, t in (("id", str), ("name", str), ("input", dict))):
                raise ApiError(f"{name}.content: a tool_use needs an 'id', a 'name' and an 'input' object",
                               param="messages")  # fmt: skip
            arguments = json.dumps(b["input"], ensure_ascii=False)
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": arguments}})
        skipped = ("tool_use", "thinking", "redacted_thinking")  # the model's own reasoning is not shown to it again
        text = _text([b for b in blocks if b.get("type") not in skipped], f"{name}.content")
        if i == len(messages) - 1 and not calls:
            prefill = text
            continue
        chat.append({"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {}))
    return chat, prefill


def _tools(body: dict) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as the chat request's fields."""
    tools = _get(body, "tools", "an array")
    out: dict[str, Any] = {}
    if tools:
        functions = []
        for i, t in enumerate(tools):
            if not (isinstance(t, dict) and isinstance(t.get("name"), str)):
                raise ApiError(f"tools[{i}]: must be an object with a 'name'", param="tools")
            if t.get("type") not in (None, "custom"):
                raise ApiError(f"tools[{i}]: server tools ({str(t['type'])[:40]!r}) are not supported", param="tools")
            schema = t.get("input_schema")
            if not isinstance(schema, dict):
                raise ApiError(f"tools[{i}].input_schema: must be an object (a JSON schema)", param="tools")
            f = {"name": t["name"], "parameters": schema}
            if t.get("description") is not None:
                f["description"] = t["description"]
            functions.append({"type": "function", "function": f})
        out["tools"] = functions
    choice = _get(body, "tool_choice", "an object")
    if choice is not None:
        kind = choice.get("type")
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise ApiError(f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got {json.dumps(kind)[:40]}",
                           param="tool_choice")  # fmt: skip
    return out


def _chat(body: object) -> tuple[dict[str, Any], str]:
    """The chat request (OpenAI's fields) a messages request is, and its prefill."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    messages = _get(body, "messages", "an array", required=True)
    if not messages:
        raise ApiError("messages: at least one message is required", param="messages")
    chat_messages, prefill = _messages(messages, body.get("system"))
    if not chat_messages or chat_messages[-1]["role"] == "system":
        raise ApiError("messages: a conversation cannot be an assistant's prefill alone", param="messages")
    chat = {"messages": chat_messages, **_tools(body)}
    for name in ("model", "temperature", "top_p", "top_k", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    _get(body, "metadata", "an object")
    return chat, prefill


def parse_messages(body: object, tokenizer, models: list[str], context: int, pool: int | None = None) -> ParsedRequest:
    """``POST /v1/messages`` as the engine's request (the module docstring's translation)."""
    chat, prefill = _chat(body)
    max_tokens = _get(body, "max_tokens", "an integer", required=True)
    if max_tokens < 1:
        raise ApiError(f"max_tokens: must be >= 1, got {max_tokens}", param="max_tokens")
    stops = _get(body, "stop_sequences", "an array") or []
    if len(stops) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(f"stop_sequences: must be up to {MAX_STOP_SEQUENCES} non-empty strings", param="stop_sequences")
    parsed = parse_chat(chat, tokenizer, models, context, pool, prefill)  # max_tokens: what is left
    params = parsed.params
    forced = parsed.tools is not None and parsed.tools.structured() is not None  # its JSON is not cut (tools)
    parsed.params = dataclasses.replace(params, max_tokens=min(max_tokens, params.max_tokens),
                                        stop=params.stop if forced else tuple(stops))  # fmt: skip
    return parsed


def count_tokens(body: object, tokenizer, models: list[str]) -> int:
    """``POST /v1/messages/count_tokens``: the prompt's tokens, rendered as ``/v1/messages`` would render it."""
    chat, prefill = _chat(body)
    model = chat.get("model", models[0] if len(models) == 1 else None)
    if model not in models:
        raise ApiError(f"model: '{model}' does not exist; this server has {models}", 404, "model")
    return len(chat_prompt(chat, tokenizer, prefill)[0])


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    """A call's id (``tools.tool_call``'s ``call_...``) as Anthropic writes a tool use's: ``toolu_...``."""
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a tool use's ``input``: an object (``{}`` where they are not one: cut by max_tokens)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(answer: Answer) -> str | None:
    if answer.stop is not None:
        return "stop_sequence"
    return STOP_REASONS.get(answer.reason, answer.reason)


def message_body(rid: str, model: str, answer: Answer) -> dict[str, Any]:
    """The whole answer as a message."""
    content = [{"type": "text", "text": answer.content}] if answer.content else []
    content += [{"type": "tool_use", "id": tool_use_id(i), "name": n, "input": _input(a)} for i, n, a in answer.calls]
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(answer), "stop_sequence": answer.stop,
            "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens}}  # fmt: skip


def event(kind: str, body: dict[str, Any]) -> str:
    """A server-sent event as Anthropic's stream writes them: the type named twice."""
    return f"event: {kind}\ndata: {to_json({'type': kind, **body})}\n\n"


class MessageEvents:
    """A streamed answer's events: ``start`` (message_start, ping), ``deltas`` (content blocks opened, their deltas,
    closed as the next one opens) and ``end`` (the last block closed, message_delta with the stop reason and usage,
    message_stop). Text blocks and tool uses come in the order the answer wrote them."""

    def __init__(self, rid: str, model: str) -> None:
        self.rid, self.model = rid, model
        self.index = -1  # the open block's index (-1: none yet)
        self.open: str | None = None  # its type
        self.call: int | None = None  # the answer's call the open tool_use block is

    def start(self, prompt_tokens: int) -> list[str]:
        message = {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}  # fmt: skip
        return [event("message_start", {"message": message}), event("ping", {})]

    def deltas(self, deltas: list[Text | CallStarted | MoreArguments]) -> list[str]:
        events = []
        for d in deltas:
            if isinstance(d, Text):
                if self.open != "text":
                    events += self._open({"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": d.text}))
                continue
            if isinstance(d, CallStarted):
                events += self._open({"type": "tool_use", "id": tool_use_id(d.id), "name": d.name, "input": {}})
                self.call = d.index
            if d.arguments and d.index == self.call:
                events.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
        return events

    def end(self, answer: Answer) -> list[str]:
        events = self._close()
        delta = {"stop_reason": stop_reason(answer), "stop_sequence": answer.stop}
        use = {"input_tokens": answer.prompt_tokens, "output_tokens": answer.completion_tokens}
        return [*events, event("message_delta", {"delta": delta, "usage": use}), event("message_stop", {})]

    def _open(self, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.index += 1
        self.open, self.call = block["type"], None
        return [*events, event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]
