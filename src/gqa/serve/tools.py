"""OpenAI's function calling for chat requests: ``tools`` rendered by the model's chat template, calls read back
from the answer into ``tool_calls``.

``tool_choice``:
- ``"required"``: the answer is held (structured output) to a JSON array of calls, ``[{"name": ..., "parameters":
  {...}}, ...]``, each name one of the tools and its parameters valid for that tool's schema (vLLM's form);
- a named function (``{"type": "function", "function": {"name": ...}}``): the answer is held to that function's
  parameters schema, and is the one call's arguments;
- ``"auto"`` (the default with tools): the model decides; calls written in the Hermes form that Qwen2/2.5/3, SmolLM3
  and many fine-tunes use — ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` — are taken out of the text;
- ``"none"``: the tools are rendered, the answer is text.
A chat template that does not render tools cannot be given any (the model would never see them): 400.

``stop`` strings do not apply to a forced choice (required or named): its answer is the grammar's JSON from the first
token to the last, and a stop string could only cut it into arguments that are not JSON (OpenAI's ``stop`` ends
content, which a forced call has none of). They apply to an "auto" answer's whole text: a block they cut is no call.

What an answer comes back as, whole (``tool_calls_in``, ``finish_reason``) and streamed alike (``tool_stream`` sends
exactly this in pieces, whatever the pieces):
- calls: a named function's one call, its ``arguments`` the answer's text; "required": each array element whose name
  is read and whose ``parameters`` have begun, its ``arguments`` their text as written. "auto": each ``<tool_call>``
  block whose text is one JSON object ``{"name": one of the tools, "arguments": an object (or none)}`` (JSON's
  whitespace around it, nothing else; the arguments re-serialised); any other block — text before or after the JSON,
  invalid JSON (``NaN`` included), an unknown name, a block cut before its ``</tool_call>`` — is content, as written;
- content: ``None`` for a forced choice. "auto": the text outside the calls, as written where there are none; where
  there are, without the whitespace at its end, nor at its start when a call comes before any text (``None`` if
  nothing is left);
- ``finish_reason``: ``"tool_calls"`` when calls were made, the answer ended by itself (the engine's ``"stop"``) and
  every call's arguments are JSON; otherwise the engine's. So ``"length"`` when ``max_tokens`` cut the answer, calls
  or not: a forced call cut inside its JSON is still reported (its ``arguments`` the text written so far, as OpenAI
  returns a call cut by ``max_tokens``), and that ``"length"`` says they are cut.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .json_scan import JsonObjectScanner
from .structured import StructuredOutput

__all__ = [
    "ToolRequest",
    "assistant_message",
    "finish_reason",
    "hermes_call",
    "parse_tools",
    "tool_call",
    "tool_calls_in",
]

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES_BLOCK = re.compile(f"{OPEN}(.*?){CLOSE}", re.DOTALL)


class ToolError(ValueError):
    """A ``tools``/``tool_choice`` the server cannot take; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's functions (``{"name", "description"?, "parameters"?}``, in order) and ``choice``: "none",
    "auto", "required" or a function's name."""

    functions: tuple[dict[str, Any], ...]
    choice: str

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template takes them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def structured(self) -> StructuredOutput | None:
        """The grammar a forced choice holds the answer to (``None`` for "auto" and "none")."""
        if self.choice == "required":
            items = [{"type": "object", "properties": {"name": {"enum": [f["name"]]}, "parameters": _schema(f)},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for f in self.functions]  # fmt: skip
            return StructuredOutput("json_schema", {"type": "array", "minItems": 1, "items": {"anyOf": items}})
        if self.choice in ("auto", "none"):
            return None
        return StructuredOutput("json_schema", _schema(self.function(self.choice)))

    def function(self, name: str) -> dict[str, Any]:
        return next(f for f in self.functions if f["name"] == name)


def _schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def parse_tools(body: dict[str, Any], chat_template: str | None) -> ToolRequest | None:
    """``body``'s ``tools`` and ``tool_choice`` checked (``ToolError`` naming the field), or ``None`` without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolError("'tools' must be an array", "tools")
    functions = []
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not (isinstance(f, dict) and isinstance(f.get("name"), str) and NAME.match(f["name"])):
            raise ToolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}} with a name "
                            "of letters, digits, '_' or '-' (at most 64)", "tools")  # fmt: skip
        if not isinstance(f.get("parameters", {}), dict) or not isinstance(f.get("description", ""), str):
            raise ToolError(f"tools[{i}].function: 'parameters' must be an object, 'description' a string", "tools")
        functions.append({k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None})
    if len({f["name"] for f in functions}) < len(functions):
        raise ToolError("'tools' names a function twice", "tools")
    if not chat_template or "tools" not in chat_template:
        raise ToolError("this model's chat template does not render tools: the model would never see them", "tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        named = choice.get("function") if choice.get("type") == "function" else None
        name = named.get("name") if isinstance(named, dict) else None
        if name not in {f["name"] for f in functions}:
            raise ToolError(f"'tool_choice' must name one of the tools, got {json.dumps(choice)[:80]}", "tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        message = f"'tool_choice' must be 'none', 'auto', 'required' or a function, got {choice!r}"
        raise ToolError(message, "tool_choice")
    if choice == "auto" and "<tool_call>" not in chat_template:
        message = ("with 'tool_choice': 'auto' gqa reads calls in the Hermes <tool_call> form, which this model's "
                   "chat template does not use: name a function or give 'required'")  # fmt: skip
        raise ToolError(message, "tool_choice")
    return ToolRequest(tuple(functions), choice)


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """A call as ``tool_calls`` holds it: a new id, the function's name and its arguments' text."""
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def _json(text: str) -> Any:
    """``text`` as strict JSON (``NaN`` and ``Infinity`` are not JSON: a client's parser may refuse them); ValueError
    if it is not."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    try:
        return json.loads(text, parse_constant=refuse)
    except RecursionError as e:  # nested deeper than the parser goes: not a call anyone can read
        raise ValueError("nested too deep") from e


def hermes_call(inner: str, names: set[str]) -> tuple[str, str] | None:
    """A Hermes block's text between ``<tool_call>`` and ``</tool_call>`` as ``(name, arguments)`` if it is a call of
    one of ``names`` (a JSON object with that ``"name"`` and an object or no ``"arguments"``), else ``None``."""
    try:
        call = _json(inner)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"] in names):
        return None
    arguments = call.get("arguments", {})
    return (call["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None


def started(scanner: JsonObjectScanner, names: set[str]) -> bool:
    """Whether a "required" element read so far is a call: its name is one of ``names`` and its arguments have begun."""
    return scanner.name in names and scanner.args_start is not None


def tool_calls_in(text: str, request: ToolRequest) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer ``text`` as ``(content, tool_calls)`` (the module docstring's rules); never raises."""
    names = {f["name"] for f in request.functions}
    if request.choice == "none":
        return text, []
    if request.choice not in ("auto", "required"):  # a named function: the answer is its arguments
        return None, [tool_call(request.choice, text)]
    if request.choice == "required":
        calls, at = [], text.find("{")
        while at >= 0:
            element = JsonObjectScanner("parameters")
            element.feed(text[at:])
            if started(element, names):
                calls.append(tool_call(element.name, element.args))
            if not element.done:
                break
            at = text.find("{", at + element.end)
        return None, calls
    content, calls, pos, call_first = "", [], 0, False
    for block in HERMES_BLOCK.finditer(text):
        call = hermes_call(block.group(1), names)
        if call is None:  # not a call: the block stays in the content
            continue
        content += text[pos : block.start()]
        call_first = call_first or not (calls or content.strip())
        calls.append(tool_call(*call))
        pos = block.end()
    if not calls:
        return text, []
    content += text[pos:]
    return (content.strip() if call_first else content.rstrip()) or None, calls


def finish_reason(arguments: list[str], reason: str | None) -> str | None:
    """An answer's ``finish_reason`` given the engine's ``reason`` and its calls' ``arguments``: ``"tool_calls"`` when
    it made calls, ended by itself and every call's arguments are JSON, else ``reason``."""
    if not arguments or reason != "stop":
        return reason
    try:
        for a in arguments:
            _json(a)
    except ValueError:
        return reason
    return "tool_calls"


def assistant_message(m: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with ``tool_calls`` as chat templates take it: each call's ``arguments`` as an object
    (transformers' convention) where it is JSON text."""
    calls = []
    for call in m.get("tool_calls") or []:
        f = dict(call.get("function") or {}) if isinstance(call, dict) else {}
        if isinstance(f.get("arguments"), str):
            with contextlib.suppress(ValueError):  # not JSON: the template gets the text
                f["arguments"] = json.loads(f["arguments"])
        calls.append({"type": "function", "id": call.get("id") if isinstance(call, dict) else None, "function": f})
    return {"role": "assistant", "content": m.get("content") or "", "tool_calls": calls}
