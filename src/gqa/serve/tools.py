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
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .structured import StructuredOutput

__all__ = ["ToolRequest", "assistant_message", "parse_tools", "tool_calls_in"]

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


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


def _call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def tool_calls_in(text: str, request: ToolRequest) -> tuple[str | None, list[dict[str, Any]]]:
    """The answer ``text`` as ``(content, tool_calls)``: a forced choice's JSON as calls (no content), or the Hermes
    calls of an "auto" answer taken out of its text (what is left, stripped, is the content; a block that is not a
    call of a known function stays in the text)."""
    if request.choice == "none":
        return text, []
    if request.choice == "required":
        return None, [_call(c["name"], c["parameters"]) for c in json.loads(text)]
    if request.choice != "auto":
        return None, [_call(request.choice, text)]
    calls, names = [], {f["name"] for f in request.functions}

    def take(match: re.Match) -> str:
        try:
            call = json.loads(match.group(1))
        except ValueError:
            return match.group(0)
        if not (isinstance(call, dict) and call.get("name") in names and isinstance(call.get("arguments", {}), dict)):
            return match.group(0)
        calls.append(_call(call["name"], call.get("arguments", {})))
        return ""

    content = HERMES_CALL.sub(take, text).strip()
    return (content or None) if calls else text, calls


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
