"""Tool calls streamed as they are generated: OpenAI's ``delta.tool_calls``, a call's id, type and name first, then its
``arguments`` text, instead of the whole answer at its end.

``ToolCallStream(request)`` is fed an answer's text deltas and returns ``(content, calls)`` deltas that add up, however
the text is cut into pieces, to exactly what ``tools.tool_calls_in`` reads from the whole answer (the rules are in
``tools``' docstring), and ``finish_reason`` is the whole answer's:

* a named function: the answer is the arguments, streamed as they come;
* ``"required"`` (a JSON array of ``{"name", "parameters"}``, held to that by the grammar): each element a call once
  its name is read and its ``parameters`` have begun, then the parameters' text as it is written;
* ``"auto"`` (Hermes ``<tool_call>{...}</tool_call>``): text outside the blocks is content as soon as it cannot open a
  block (whitespace that the whole answer may drop is held until text follows); a block is held until its
  ``</tool_call>``, then goes out as one call (id, name and arguments in one delta) if it is a valid call, else as
  content. The model writes a block unconstrained, so whether it is a call is known only at its end: a call started
  earlier could not be taken back from a block that then breaks.
"""

from __future__ import annotations

from typing import Any

from .json_scan import JsonObjectScanner
from .tools import CLOSE, OPEN, ToolRequest, finish_reason, hermes_call, started, tool_call

__all__ = ["JsonObjectScanner", "ToolCallStream"]


class _Element:
    """A "required" array element being streamed: its scanner, index among the answer's calls (once started) and
    the arguments' characters sent."""

    def __init__(self) -> None:
        self.scanner = JsonObjectScanner("parameters")
        self.index: int | None = None
        self.sent = 0


def _held_tail(text: str, marker: str) -> int:
    """How many characters at ``text``'s end may be the start of ``marker`` (held until the text goes on)."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)


class ToolCallStream:
    """An answer's tool calls as stream deltas (module docstring). ``feed(text)`` and, at the answer's end,
    ``finish()`` return ``(content, calls)``: content text to send (``""`` for none) and ``delta.tool_calls`` items;
    ``arguments`` holds each started call's arguments sent so far."""

    def __init__(self, request: ToolRequest) -> None:
        self.request = request
        self.names = {f["name"] for f in request.functions}
        self.arguments: list[str] = []
        self._buffer = ""  # auto: text not yet judged (it may open or close a block); required: the array's text
        self._block: str | None = None  # auto: the open block's text after <tool_call>
        self._content_started = False
        self._lead = ""  # whitespace before any content: dropped if a call comes first
        self._held_space = ""  # content whitespace held until more content comes (or dropped at the end)
        self._array_pos = 0  # required: where scanning of the array resumes
        self._element: _Element | None = None

    @property
    def calls(self) -> int:
        """The calls started."""
        return len(self.arguments)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        choice = self.request.choice
        if choice == "none":
            return text, []
        if choice == "required":
            return "", self._feed_required(text)
        if choice != "auto":  # a named function: the answer is its arguments
            calls = [] if self.calls else [self._start(choice)]
            return "", [*calls, self._more(0, text)] if text else calls
        return self._feed_auto(text)

    def finish_reason(self, reason: str | None) -> str | None:
        """The answer's ``finish_reason`` given the engine's (``tools.finish_reason``)."""
        return finish_reason(self.arguments, reason)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is held at the answer's end: an unclosed block's text as content, and the held whitespace if no call
        was made (the whole answer keeps it then)."""
        if self.request.choice != "auto":
            return "", []
        content = self._content(("" if self._block is None else OPEN + self._block) + self._buffer)
        self._block, self._buffer = None, ""
        if not self.calls:  # an answer without calls is its text as written
            content += (self._lead if not self._content_started else "") + self._held_space
        self._held_space = self._lead = ""
        return content, []

    def _start(self, name: str, arguments: str = "") -> dict[str, Any]:
        """A new call's first delta: its index, id, type and name."""
        self.arguments.append(arguments)
        return {"index": self.calls - 1, **tool_call(name, arguments)}

    def _more(self, index: int, arguments: str) -> dict[str, Any]:
        """More of call ``index``'s arguments."""
        self.arguments[index] += arguments
        return {"index": index, "function": {"arguments": arguments}}

    # -- "auto": Hermes blocks in the text --------------------------------------------------------------------------

    def _feed_auto(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content, calls = "", []
        self._buffer += text
        while self._buffer:
            if self._block is None:
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = len(self._buffer) - _held_tail(self._buffer, OPEN)
                    content += self._content(self._buffer[:keep])
                    self._buffer = self._buffer[keep:]
                    break
                content += self._content(self._buffer[:at])
                self._buffer, self._block = self._buffer[at + len(OPEN) :], ""
                continue
            end = self._buffer.find(CLOSE)
            if end < 0:
                keep = len(self._buffer) - _held_tail(self._buffer, CLOSE)
                self._block += self._buffer[:keep]
                self._buffer = self._buffer[keep:]
                break
            block, self._block = self._block + self._buffer[:end], None
            self._buffer = self._buffer[end + len(CLOSE) :]
            call = hermes_call(block, self.names)
            if call is None:  # not a call: the block is content, as written
                content += self._content(OPEN + block + CLOSE)
            else:
                calls.append(self._start(*call))
        return content, calls

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
                self._element, self._array_pos = _Element(), at
            element, s = self._element, self._element.scanner
            before = len(s.text)
            s.feed(self._buffer[self._array_pos :])
            if element.index is None and started(s, self.names):
                element.index = self.calls
                out.append(self._start(s.name))
            if element.index is not None:
                piece = s.args[element.sent :]
                if piece:
                    element.sent += len(piece)
                    out.append(self._more(element.index, piece))
            if not s.done:
                self._array_pos = len(self._buffer)
                break
            self._array_pos += s.end - before
            self._element = None
        return out
