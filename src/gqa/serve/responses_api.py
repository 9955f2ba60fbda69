"""OpenAI's Responses API shapes (``POST /v1/responses``): a request read and checked (a bad field is an ``ApiError``
naming it, in OpenAI's error shape), translated to the chat request the chat path parses
(``openai_api.parse_chat``), and answers written back as a response object or its stream's events. No HTTP here
(``responses_routes`` does that; ``response_store`` keeps the responses).

The translation: ``input`` (a string: one user message; or items) and a previous response's conversation before it
(``previous_response_id``) are the chat's messages, ``instructions`` a system message first (not carried to the next
response, as OpenAI's are not); ``message`` items (``input_text``/``output_text`` parts or a string; ``developer``
is ``system``), ``function_call`` items an assistant's ``tool_calls``, ``function_call_output`` items ``tool``
messages. ``tools`` (function tools, flat) and ``tool_choice`` are chat's, held by the same grammars (``tools``);
``text.format`` (``json_schema``, ``json_object``) is chat's ``response_format``. ``max_output_tokens`` is cut to what
the context and the KV cache leave; without it the answer may fill them.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .answers import Answer, CallStarted, MoreArguments, Text
from .openai_api import ApiError, ParsedRequest, _get, json_type, parse_chat, to_json

__all__ = ["ResponseEvents", "Translated", "assistant_turn", "output_items", "parse", "response_body", "translate"]

# the chat request's fields that the response request's fields became, for errors that name them
FIELDS = {"messages": "input", "response_format": "text.format"}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Translated:
    """A responses request as a chat request (``chat``: OpenAI's chat fields), with what the response echoes
    (``echo``), the conversation to keep for a next response (without the instructions), ``max_output_tokens``
    and ``store``."""

    chat: dict[str, Any]
    conversation: list[dict[str, Any]]
    echo: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    store: bool = True


def _text(content: Any, name: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(f"'{name}' must be a string or an array of content parts", param="input")
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else json_type(part)
            raise ApiError(f"'{name}[{j}]': only text parts are supported, got {str(kind)[:40]!r}", param="input")
    return "".join(part["text"] for part in content)


def _messages(items: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiError(f"'input' must be a string or an array of items, got {json_type(items)}", param="input")
    chat: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        name = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"'{name}' must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise ApiError(f"'{name}.role' must be one of {sorted(ROLES)}, got {json.dumps(item.get('role'))[:40]}",
                               param="input")  # fmt: skip
            chat.append({"role": role, "content": _text(item.get("content"), f"{name}.content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ApiError(f"'{name}': a function_call needs 'call_id', 'name' and 'arguments' strings",
                               param="input")  # fmt: skip
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if chat and chat[-1]["role"] == "assistant":  # the calls of one turn are one assistant message
                chat[-1].setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ApiError(f"'{name}': a function_call_output needs a 'call_id' string", param="input")
            output = _text(item.get("output"), f"{name}.output")
            chat.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind != "reasoning":  # the model's own reasoning is not shown to it again
            raise ApiError(f"'{name}.type' {str(kind)[:40]!r} is not supported: give messages, function_call and "
                           "function_call_output items", param="input")  # fmt: skip
    if not chat:
        raise ApiError("'input' has no messages", param="input")
    return chat


def _tools(body: dict) -> dict[str, Any]:
    """``tools`` (flat function tools) and ``tool_choice`` as chat's fields."""
    out: dict[str, Any] = {}
    tools = _get(body, "tools", "an array")
    if tools:
        functions = []
        for i, t in enumerate(tools):
            if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)):
                raise ApiError(f"'tools[{i}]' must be a function tool ({{'type': 'function', 'name': ...}}): this "
                               "server has no built-in tools", param="tools")  # fmt: skip
            functions.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                               if t.get(k) is not None}})  # fmt: skip
        out["tools"] = functions
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ApiError(f"'tool_choice' must be 'none', 'auto', 'required' or a function, got "
                           f"{json.dumps(choice)[:80]}", param="tool_choice")  # fmt: skip
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        out["tool_choice"] = choice
    return out


def _format(body: dict) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (``None``: plain text)."""
    text = _get(body, "text", "an object", {})
    spec = text.get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") not in ("text", "json_object", "json_schema"):
        raise ApiError("'text.format.type' must be 'text', 'json_object' or 'json_schema'", param="text.format")
    if spec["type"] == "json_schema":
        if not isinstance(spec.get("schema"), dict):
            raise ApiError("'text.format' of type json_schema needs a 'schema' object", param="text.format")
        return {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": spec["schema"]}}
    return {"type": spec["type"]}


# Responses fields that change the answer or its shape and that this server does not serve, with the values that
# mean "off": anything else is refused with a 400 naming the field, never served as if it had not been asked
UNSERVED: dict[str, tuple] = {
    "prompt": (),  # a stored prompt template (OpenAI's dashboard)
    "conversation": (),  # a stored conversation (previous_response_id is served)
    "reasoning": ({}, {"effort": None}, {"effort": None, "summary": None}),  # no reasoning models here
    "truncation": ("disabled",),
    "max_tool_calls": (),
}


LOGPROBS = "message.output_text.logprobs"  # the one ``include`` item served: the output text's tokens' logprobs


def _refuse_unserved(body: dict) -> None:
    for name, off in UNSERVED.items():
        value = body.get(name)
        if value is not None and not any(value == o and type(value) is type(o) for o in off):
            raise ApiError(f"'{name}' is not supported by this server (got {json.dumps(value)[:80]})", param=name)
    include = _get(body, "include", "an array", [])
    for item in include:
        if item != LOGPROBS:
            raise ApiError(f"'include' item {json.dumps(item)[:80]} is not supported by this server (only "
                           f"'{LOGPROBS}')", param="include")  # fmt: skip


def _logprobs(body: dict) -> dict[str, Any]:
    """``include: ["message.output_text.logprobs"]`` and ``top_logprobs`` (0-20 alternatives, OpenAI's; given
    alone it asks for the logprobs too) as chat's ``logprobs`` / ``top_logprobs``."""
    top = _get(body, "top_logprobs", "an integer", 0)
    if LOGPROBS not in (body.get("include") or []) and not top:
        return {}
    return {"logprobs": True, "top_logprobs": top}


def translate(body: object, history: list[dict[str, Any]] | None = None) -> Translated:
    """The request ``body`` as a chat request; ``history``: the previous response's conversation."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    if body.get("input") is None:
        raise ApiError("'input' is required", param="input")
    if body.get("background"):
        raise ApiError("'background' responses are not supported", param="background")
    _refuse_unserved(body)
    conversation = [*(history or []), *_messages(body["input"])]
    instructions = _get(body, "instructions", "a string")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    chat = {"messages": messages, **_tools(body), **_logprobs(body)}
    response_format = _format(body)
    if response_format is not None:
        chat["response_format"] = response_format
    for name in ("model", "temperature", "top_p", "stream"):
        if body.get(name) is not None:
            chat[name] = body[name]
    max_tokens = _get(body, "max_output_tokens", "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(f"'max_output_tokens' must be >= 1, got {max_tokens}", param="max_output_tokens")
    store = _get(body, "store", "a boolean", True)
    echo = {
        "instructions": instructions, "max_output_tokens": max_tokens,
        "metadata": _get(body, "metadata", "an object", {}),
        "parallel_tool_calls": _get(body, "parallel_tool_calls", "a boolean", True),
        "previous_response_id": body.get("previous_response_id"), "store": store,
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [], "truncation": "disabled",
    }  # fmt: skip
    return Translated(chat, conversation, echo, max_tokens, store)


def parse(t: Translated, tokenizer, models: list[str], context: int, pool: int | None = None) -> ParsedRequest:
    """The translated request as the engine's, ``max_output_tokens`` cut to what is left (errors name the
    responses request's fields)."""
    try:
        parsed = parse_chat(t.chat, tokenizer, models, context, pool)  # max_tokens: what is left
    except ApiError as e:
        e.param = FIELDS.get(e.param, e.param)
        e.message = e.message.replace("'response_format'", "'text.format'").replace("'messages'", "'input'")
        raise
    if t.max_tokens is not None:
        parsed.params = dataclasses.replace(parsed.params, max_tokens=min(t.max_tokens, parsed.params.max_tokens))
    return parsed


def message_item(item_id: str, text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def status_of(answer: Answer) -> str:
    return "incomplete" if answer.reason == "length" else "completed"


def output_items(answer: Answer, logprobs: list | None = None) -> list[dict[str, Any]]:
    """The whole answer's output: a message with its text (also when it made no call and wrote nothing) and its
    tokens' ``logprobs`` (chat's ``logprobs.content`` items, where asked), then its function calls."""
    status = status_of(answer)
    message = [message_item(new_id("msg"), answer.content, status, logprobs)]
    items = message if answer.content or not answer.calls else []
    return items + [call_item(new_id("fc"), *call, status) for call in answer.calls]


def response_body(
    rid: str, created: int, model: str, echo: dict[str, Any], output: list[dict[str, Any]], answer: Answer | None
) -> dict[str, Any]:
    """The response object: in progress (``answer`` None) or done."""
    body = {"id": rid, "object": "response", "created_at": created, "model": model, "status": "in_progress",
            "error": None, "incomplete_details": None, "output": output, "usage": None, **echo}  # fmt: skip
    if answer is not None:
        body["status"] = status_of(answer)
        if answer.reason == "length":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        body["completed_at"] = int(time.time())
        body["usage"] = {"input_tokens": answer.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                         "output_tokens": answer.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                         "total_tokens": answer.prompt_tokens + answer.completion_tokens}  # fmt: skip
    return body


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the chat's assistant message (for the next response's conversation)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]  # fmt: skip
    return {"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {})


def event(body: dict[str, Any]) -> str:
    return f"event: {body['type']}\ndata: {to_json(body)}\n\n"


class ResponseEvents:
    """A streamed answer's events, each with its ``sequence_number``: ``start`` (response.created, .in_progress),
    ``deltas`` (an output item added as the answer begins it — a message with one output_text part, or a function
    call — and its text or arguments as they come; the one before is done when the next begins) and ``end`` (the
    last item done, then response.completed or response.incomplete with the whole response, whose ``output`` holds
    the items as streamed). ``output``: the items so far. ``logprobs(entries)``, where the request asked for them,
    turns the engine's token logprobs into the items a text delta carries (the tokens fed since the last one)."""

    def __init__(self, response: dict[str, Any], logprobs: Callable[[list], list] | None = None) -> None:
        self.response = response  # the response in progress (its output empty)
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.sequence = 0
        self.logprobs = logprobs
        self.pending: list = []  # token logprobs not sent yet (their text held back, or no text delta since)

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event(body)

    def start(self) -> list[str]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]  # fmt: skip

    def deltas(self, deltas: list[Text | CallStarted | MoreArguments], entries: Sequence = ()) -> list[str]:
        """The events of ``deltas``; ``entries``: the logprobs of the tokens they came from."""
        events = []
        self.pending += entries
        for d in deltas:
            if isinstance(d, Text):
                if self.open is None or self.open["type"] != "message":
                    events += self._add(message_item(new_id("msg"), "", "in_progress"))
                    part = {"type": "output_text", "text": "", "annotations": []}
                    events.append(self._event("response.content_part.added", **self._at(), content_index=0, part=part))
                self.open["content"][0]["text"] += d.text
                sent = self._take_logprobs()
                events.append(self._event("response.output_text.delta", **self._at(), content_index=0, delta=d.text,
                                          logprobs=sent))  # fmt: skip
                continue
            self.pending = []  # a call's tokens: logprobs go with the message text only
            if isinstance(d, CallStarted):
                events += self._add(call_item(new_id("fc"), d.id, d.name, "", "in_progress"))
            if d.arguments:
                self.open["arguments"] += d.arguments
                events.append(self._event("response.function_call_arguments.delta", **self._at(), delta=d.arguments))
        return events

    def end(self, answer: Answer) -> tuple[list[str], dict[str, Any]]:
        """The last events and the whole response."""
        events = self._done(status_of(answer))
        if not self.output:  # an answer of nothing is an empty message, as whole
            events += self._add(message_item(new_id("msg"), "", "in_progress"))
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(self._event("response.content_part.added", **self._at(), content_index=0, part=part))
            events += self._done(status_of(answer))
        body = self.response | response_body(self.response["id"], self.response["created_at"], self.response["model"],
                                             {}, self.output, answer)  # fmt: skip
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=body)], body

    def failed(self, message: str) -> str:
        """The event that ends a stream the engine failed."""
        error = {"code": "server_error", "message": message}
        return self._event("response.failed", response=self.response | {"status": "failed", "output": self.output,
                                                                          "error": error})  # fmt: skip

    def _take_logprobs(self) -> list:
        """The pending tokens' logprob items, added to the open message's part (none where none were asked)."""
        if self.logprobs is None or not self.pending:
            self.pending = []
            return []
        items, self.pending = self.logprobs(self.pending), []
        self.open["content"][0]["logprobs"] += items
        return items

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _add(self, item: dict[str, Any]) -> list[str]:
        events = self._done("completed")
        self.output.append(item)
        self.open = item
        added = item | ({"content": []} if item["type"] == "message" else {})  # its part is added next
        return [*events, self._event("response.output_item.added", output_index=len(self.output) - 1, item=added)]

    def _done(self, status: str) -> list[str]:
        item, events = self.open, []
        if item is None:
            return events
        item["status"] = status
        if item["type"] == "message":
            self._take_logprobs()  # tokens whose text never came (a stop string's): theirs too, as whole
            part = item["content"][0]
            events.append(self._event("response.output_text.done", **self._at(), content_index=0, text=part["text"],
                                      logprobs=part["logprobs"]))  # fmt: skip
            events.append(self._event("response.content_part.done", **self._at(), content_index=0, part=part))
        else:
            events.append(self._event("response.function_call_arguments.done", **self._at(), name=item["name"],
                                      arguments=item["arguments"]))  # fmt: skip
        events.append(self._event("response.output_item.done", output_index=len(self.output) - 1, item=item))
        self.open = None
        return events
