"""Tool calls streamed as they are generated: OpenAI's ``delta.tool_calls``, a call's id, type and name first, then its
``arguments`` text piece by piece (as OpenAI and vLLM stream them), instead of the whole answer at its end.

``ToolCallStream(request)`` is fed an answer's text deltas and returns ``(content, calls)`` deltas:

* ``"auto"`` (Hermes ``<tool_call>{...}</tool_call>``): text outside the blocks is content, stripped at both ends as
  ``tools.tool_calls_in`` strips it (trailing whitespace and anything that may open a block are held until the text
  goes on); inside a block, once the ``"name"`` of a known function is read and its ``"arguments"`` have begun as an
  object, the call starts, and the arguments stream as the model writes them (their text as written: the whole
  answer's ``arguments`` is the same JSON, re-serialised). A block that is no call of a known function and started
  no call goes out as content when it closes (as the whole answer keeps it);
* ``"required"`` (a JSON array of ``{"name", "parameters"}``, held to that by the grammar): each element a call, its
  ``parameters`` streamed;
* a named function: the answer is the arguments, streamed as they come.

``JsonObjectScanner`` reads one JSON object's text incrementally: its top-level keys, a string value (the name) once
complete, where another value (the arguments) begins and ends.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .tools import ToolRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class JsonObjectScanner:
    """The text of one JSON object, fed in pieces: ``name`` (the string value of key ``"name"``, once complete), and
    the span ``[args_start, args_end)`` of key ``args_key``'s value (``args_end`` None while it is open); ``done`` once
    the object closes, ``end`` the index after its ``}``."""

    def __init__(self, args_key: str) -> None:
        self.args_key = args_key
        self.text = ""
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.done = False
        self.end: int | None = None
        self._depth = 0
        self._in_string = self._escaped = False
        self._string_start = 0
        self._key: str | None = None  # the depth-1 key whose value is being read
        self._last_string: str | None = None
        self._expecting = False  # a depth-1 ':' was read: the value comes next
        self._value_start: int | None = None

    def feed(self, piece: str) -> None:
        start = len(self.text)
        self.text += piece
        for i in range(start, len(self.text)):
            if self.done:
                return
            self._step(i, self.text[i])

    def _step(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if self._depth == 1:
                    literal = self.text[self._string_start : i + 1]
                    if self._value_start == self._string_start:  # a depth-1 string value
                        if self._key == "name":
                            self.name = json.loads(literal)
                        self._close_value(i + 1)
                    else:
                        self._last_string = json.loads(literal)
            return
        if c == '"':
            self._in_string, self._string_start = True, i
            self._begin_value(i)
        elif c in "{[":
            self._begin_value(i)
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1 and self._value_start is not None:
                self._close_value(i + 1)  # an object or array value of a key closed
            elif self._depth == 0:
                if self._value_start is not None:  # a number, true, false or null ended the object
                    self._close_value(i)
                self.done, self.end = True, i + 1
        elif self._depth == 1:
            if c == ":":
                self._key, self._expecting = self._last_string, True
            elif c == ",":
                if self._value_start is not None:
                    self._close_value(i)
            elif not c.isspace():
                self._begin_value(i)

    def _begin_value(self, i: int) -> None:
        if self._depth == 1 and self._expecting:
            self._expecting, self._value_start = False, i
            if self._key == self.args_key:
                self.args_start = i

    def _close_value(self, i: int) -> None:
        if self._key == self.args_key and self.args_start is not None and self.args_end is None:
            self.args_end = i
        self._value_start, self._key = None, None


class _Call:
    """A call being streamed: its scanner, index among the answer's calls (once started) and arguments sent."""

    def __init__(self, args_key: str) -> None:
        self.scanner = JsonObjectScanner(args_key)
        self.index: int | None = None
        self.sent = 0  # characters of the arguments' text already sent


def _delta(index: int, name: str | None = None, arguments: str = "") -> dict[str, Any]:
    if name is None:
        return {"index": index, "function": {"arguments": arguments}}
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """An answer's tool calls as stream deltas (module docstring). ``feed(text)`` and, at the answer's end,
    ``finish()`` return ``(content, calls)``: content text to send (``""`` for none) and ``delta.tool_calls`` items;
    ``calls`` counts the calls started."""

    def __init__(self, request: ToolRequest) -> None:
        self.request = request
        self.names = {f["name"] for f in request.functions}
        self.calls = 0
        self._buffer = ""  # auto: text not yet judged (it may open a block); required: the array's text
        self._block: _Call | None = None  # auto: the open block's call
        self._block_text = ""
        self._content_started = False
        self._lead = ""  # whitespace before any content: dropped if a call comes first
        self._held_space = ""  # content whitespace held until more content comes (or dropped at the end)
        self._array_pos = 0  # required: where scanning of the array resumes
        self._element: _Call | None = None
        self._text = ""  # required, named: the whole answer (judged whole at its end)
        self._broken = False  # auto: a started call's block did not close into a valid call

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        choice = self.request.choice
        if choice == "none":
            return text, []
        self._text += text
        if choice == "required":
            return "", self._feed_required(text)
        if choice != "auto":  # a named function: the answer is its arguments
            calls = [] if self.calls else [_delta(0, choice)]
            self.calls = 1
            return "", [*calls, _delta(0, arguments=text)] if text else calls
        return self._feed_auto(text)

    def finish_reason(self, reason: str | None) -> str | None:
        """The answer's ``finish_reason`` given the engine's: ``"tool_calls"`` when it made calls and every one of
        them is whole and valid (as the whole answer reads them: ``tools.tool_calls_in``); a call cut by
        ``max_tokens`` keeps ``"length"``, as the whole answer does."""
        if not self.calls or reason == "length":
            return reason
        choice = self.request.choice
        if choice == "auto":
            whole = not self._broken and (self._block is None or self._block.index is None)
        else:
            try:
                parsed = json.loads(self._text)
                whole = isinstance(parsed, list) if choice == "required" else True
            except ValueError:
                whole = False
        return "tool_calls" if whole else reason

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is held at the answer's end: an unclosed block's text as content (no call started from it), and the
        held whitespace if no call was made (the whole answer keeps it then)."""
        if self.request.choice != "auto":
            return "", []
        content = ""
        if self._block is not None and self._block.index is None:
            content += self._content(self._block_text)
        content += self._content(self._buffer)
        self._buffer = ""
        if not self.calls:  # an answer without calls is its text as written
            content += (self._lead if not self._content_started else "") + self._held_space
        self._held_space = self._lead = ""
        return content, []

    # -- "auto": Hermes blocks in the text --------------------------------------------------------------------------

    def _feed_auto(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content, calls = "", []
        self._buffer += text
        while self._buffer:
            if self._block is None:
                at = self._buffer.find(OPEN)
                if at < 0:  # hold a tail that may be the start of OPEN
                    keep = next((k for k in range(min(len(OPEN) - 1, len(self._buffer)), 0, -1)
                                 if OPEN.startswith(self._buffer[-k:])), 0)  # fmt: skip
                    content += self._content(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content += self._content(self._buffer[:at])
                self._buffer = self._buffer[at + len(OPEN) :]
                self._block, self._block_text = _Call("arguments"), OPEN
                continue
            end = self._buffer.find(CLOSE)
            inside = self._buffer if end < 0 else self._buffer[:end]
            if end < 0:  # hold a tail that may be the start of CLOSE
                keep = next((k for k in range(min(len(CLOSE) - 1, len(inside)), 0, -1)
                             if CLOSE.startswith(inside[-k:])), 0)  # fmt: skip
                inside = inside[: len(inside) - keep]
            self._block_text += inside
            calls += self._advance(self._block, inside)
            self._buffer = self._buffer[len(inside) :]
            if end < 0:
                break
            self._buffer = self._buffer[len(CLOSE) :]
            content += self._close_block(self._block_text + CLOSE, calls)
            self._block = None
        return content, calls

    def _close_block(self, block: str, calls: list[dict[str, Any]]) -> str:
        """A block's end: a call that never started is started whole if the block is a valid call (else the block is
        content, as the whole answer keeps it)."""
        call = self._block
        try:
            parsed = json.loads(block[len(OPEN) : -len(CLOSE)])
        except ValueError:
            parsed = None
        valid = (isinstance(parsed, dict) and parsed.get("name") in self.names
                 and isinstance(parsed.get("arguments", {}), dict))  # fmt: skip
        if call.index is not None:
            self._broken |= not valid  # sent already: the answer ends without "tool_calls"
            return ""
        if not valid:
            return self._content(block)
        calls.append(_delta(self.calls, parsed["name"], json.dumps(parsed.get("arguments", {}), ensure_ascii=False)))
        self.calls += 1
        return ""

    def _content(self, text: str) -> str:
        """Content as the whole answer has it: stripped around calls, as it is without any. Leading whitespace is
        held until the content starts (sent with it if no call came first), trailing whitespace until more comes."""
        if not self._content_started:
            lead = len(text) - len(text.lstrip())
            self._lead += text[:lead]
            text = text[lead:]
            if not text:
                return ""
            self._content_started = True
            if not self.calls:
                text = self._lead + text
        stripped = text.rstrip()
        if not stripped:
            self._held_space += text
            return ""
        out = self._held_space + stripped
        self._held_space = text[len(stripped) :]
        return out

    # -- a call's name and arguments ---------------------------------------------------------------------------------

    def _advance(self, call: _Call, text: str) -> list[dict[str, Any]]:
        """Feed ``call``'s scanner; the deltas that are now known: the start once the name of a known function is
        read and its arguments have begun as an object, then the arguments' text as far as it is written."""
        s = call.scanner
        s.feed(text)
        out = []
        if call.index is None:  # a call starts once it is sure to be one: a known name, an object of arguments
            if s.name not in self.names or s.args_start is None or s.text[s.args_start] != "{":
                return out
            call.index, self.calls = self.calls, self.calls + 1
            out.append(_delta(call.index, s.name))
        upto = s.args_end if s.args_end is not None else len(s.text)
        piece = s.text[s.args_start + call.sent : upto]
        if piece:
            call.sent += len(piece)
            out.append(_delta(call.index, arguments=piece))
        return out

    # -- "required": a JSON array of calls ---------------------------------------------------------------------------

    def _feed_required(self, text: str) -> list[dict[str, Any]]:
        self._buffer += text
        out = []
        while self._array_pos < len(self._buffer):
            if self._element is None:
                at = self._buffer.find("{", self._array_pos)
                if at < 0:
                    self._array_pos = len(self._buffer)
                    break
                self._element, self._array_pos = _Call("parameters"), at
            piece = self._buffer[self._array_pos :]
            before = len(self._element.scanner.text)
            out += self._advance(self._element, piece)
            if self._element.scanner.done:
                self._array_pos += self._element.scanner.end - before
                self._element = None
            else:
                self._array_pos = len(self._buffer)
        return out
