"""A request's output as text, handed out piece by piece as its tokens arrive, cut at the first stop string."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["TextStream"]


class TextStream:
    """The text of a growing list of token ids, handed out in pieces: a piece never ends in an incomplete UTF-8
    character or in what may be the start of a stop string, and the text ends before the first stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]) -> None:
        self.decode, self.stop = decode, stop
        self.sent = 0  # characters handed out
        self.text = ""
        self.stopped = False

    def update(self, ids: list[int], final: bool = False) -> str:
        """The next piece for output ids ``ids`` (all of them so far); ``final``: nothing more will come."""
        text = self.decode(ids)
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                text, self.stopped, final = text[:at], True, True
        self.text = text
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # a character whose bytes have not all arrived
                end -= 1
            for s in self.stop:  # hold back what could be the start of a stop string
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end -= k
                        break
        piece = text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece
