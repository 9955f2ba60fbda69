"""A token's own bytes, read from the vocabulary: a byte-level BPE token's characters mapped back to the bytes GPT-2's
byte-to-unicode table wrote them as, a byte-fallback token's ``<0xNN>`` byte. Decoding a token alone cannot give them:
a piece of a multi-byte character decodes to U+FFFD. Joined in order, the tokens' bytes are the text's UTF-8."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

from .gguf_tokenizer import byte_alphabet

if TYPE_CHECKING:
    from tokenizers import Tokenizer as BackendTokenizer

__all__ = ["TokenBytes", "byte_decoder"]

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's token for one raw byte


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed (``gguf_tokenizer.byte_alphabet``): character -> the byte it writes."""
    return {c: b for b, c in byte_alphabet().items()}


class TokenBytes:
    """``token id -> bytes`` for the ``tokenizers`` ``backend``; ``decode`` (ids -> text) answers for the tokens the
    vocabulary does not spell in bytes: added tokens (a special one decodes to nothing, as in the text) and
    vocabularies of another kind (WordPiece, ...)."""

    def __init__(self, backend: BackendTokenizer, decode: Callable[[list[int]], str]) -> None:
        self.backend, self.decode = backend, decode
        steps = [] if backend.decoder is None else [json.loads(backend.decoder.__getstate__())]
        while steps and steps[0].get("type") == "Sequence":
            steps = steps[0].get("decoders", [])
        kinds = {step.get("type") for step in steps}
        self.byte_level = "ByteLevel" in kinds
        self.byte_fallback = "ByteFallback" in kinds
        # sentencepiece writes a space as U+2581, which its decoder (Metaspace, or Replace) turns back
        spaced = "Metaspace" in kinds or any(s.get("pattern", {}).get("String") == "\u2581" for s in steps)
        self.space = "\u2581" if spaced else None
        self.added = set(backend.get_added_tokens_decoder())
        self.cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        raw = self.cache.get(token)
        if raw is None:
            raw = self.cache[token] = self._bytes(token)
        return raw

    def _bytes(self, token: int) -> bytes:
        piece = None if token in self.added else self.backend.id_to_token(token)
        if piece is not None and self.byte_level:
            table = byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        elif piece is not None and self.byte_fallback and (byte := BYTE_FALLBACK.fullmatch(piece)):
            return bytes([int(byte[1], 16)])
        elif piece is not None and self.space is not None:
            return piece.replace(self.space, " ").encode("utf-8")
        return self.decode([token]).encode("utf-8")
