"""One JSON object's text read as it is written (``JsonObjectScanner``): where a call's name and arguments are, before
the object is complete. Function calling reads calls with it, streamed (``tool_stream``) and whole (``tools``), so
both find the same calls in the same text."""

from __future__ import annotations

import json

__all__ = ["JsonObjectScanner"]


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

    @property
    def args(self) -> str:
        """The text of key ``args_key``'s value as far as it is written (``""`` before it begins)."""
        if self.args_start is None:
            return ""
        return self.text[self.args_start : self.args_end if self.args_end is not None else len(self.text)]

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
                            self.name = _string(literal)
                        self._close_value(i + 1)
                    else:
                        self._last_string = _string(literal)
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


def _string(literal: str) -> str | None:
    """A JSON string literal's value; ``None`` for one that is not valid (a bad escape: not a key or name)."""
    try:
        return json.loads(literal)
    except ValueError:
        return None
