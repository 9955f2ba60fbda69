"""The responses ``POST /v1/responses`` stored (``store``, the default): kept in memory for ``GET`` and ``DELETE`` and
for a next response's ``previous_response_id``, at most ``max_count`` of them and ``max_chars`` of their JSON text,
the oldest out first. A server restart forgets them."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .openai_api import to_json

__all__ = ["MAX_CHARS", "MAX_COUNT", "ResponseStore", "Stored"]

MAX_COUNT = 1024  # responses kept
MAX_CHARS = 64 * 2**20  # and the characters of their JSON (a response and its conversation) at most


@dataclass(frozen=True)
class Stored:
    """A response object and its conversation (chat messages, its own answer last; without the instructions)."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    chars: int


class ResponseStore:
    """Responses by id, oldest out first past the bounds (one per app; used from the event loop only)."""

    def __init__(self, max_count: int = MAX_COUNT, max_chars: int = MAX_CHARS) -> None:
        self.max_count, self.max_chars = max_count, max_chars
        self._kept: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, body: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Keep ``body`` (by its ``id``) and its conversation; one larger than ``max_chars`` alone is not kept."""
        chars = len(to_json(body)) + len(to_json(conversation))
        if chars > self.max_chars:
            return
        self._kept[body["id"]] = Stored(body, conversation, chars)
        self._chars += chars
        while len(self._kept) > self.max_count or self._chars > self.max_chars:
            self._chars -= self._kept.popitem(last=False)[1].chars

    def get(self, rid: str) -> Stored | None:
        return self._kept.get(rid)

    def delete(self, rid: str) -> bool:
        """Forget ``rid``; whether it was kept."""
        stored = self._kept.pop(rid, None)
        if stored is not None:
            self._chars -= stored.chars
        return stored is not None
