"""A token's own bytes (``Tokenizer.token_bytes``): joined in order they are the text's UTF-8, also where a token is
a piece of a multi-byte character (whose text alone is U+FFFD); checked against the text itself and against the
``tokenizers`` library's own decoding, for the embedded byte-level BPE vocabulary and a byte-fallback one."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from gqa.loaders import load_tokenizer
from gqa.loaders.tokenizer import Tokenizer

TEXTS = [
    "Plain ASCII, digits 0123 and tabs\tand\nnewlines.",
    "日本語の文章です。カタカナとひらがなと漢字。",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✅",
    "Ça va? Größenverhältnisse, naïve café, ½ ¾ µ, non-breaking\u00a0space, zero\u200bwidth",
    "Привет, мир; مرحبا بالعالم; नमस्ते; 한국어 문장",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_the_tokens_bytes_join_to_the_texts_utf8(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.token_bytes(t) for t in ids]
    assert b"".join(pieces) == text.encode("utf-8")
    if not text.isascii():  # the case the bytes are for: tokens that split a character
        assert any(_not_utf8(p) for p in pieces), pieces


def test_every_token_is_what_the_tokenizers_decoder_makes_of_it(tok):
    """Tokens that are whole characters: their bytes are their text alone; random runs of any tokens: their bytes
    decoded (invalid UTF-8 replaced, as the ByteLevel decoder does) are ``tokenizers``' decoding of the run."""
    added = set(tok.backend.get_added_tokens_decoder())
    for t in range(tok.vocab_size):
        alone = tok.decode([t])
        if t not in added and "\ufffd" not in alone:
            assert tok.token_bytes(t) == alone.encode("utf-8"), t
    rng = random.Random(0)
    plain = [t for t in range(tok.vocab_size) if t not in added]
    for _ in range(500):
        ids = rng.sample(plain, 6)
        joined = b"".join(tok.token_bytes(t) for t in ids)
        assert joined.decode("utf-8", errors="replace") == tok.backend.decode(ids), ids


def test_a_byte_fallback_vocabulary_spells_its_bytes_and_spaces():
    """Sentencepiece-style: ``▁`` for a space, ``<0xNN>`` tokens for the bytes of characters not in the vocabulary."""
    vocab = {"<unk>": 0, "a": 1, "b": 2, "\u2581": 3, "\u2581a": 4}
    vocab |= {f"<0x{b:02X}>": 5 + b for b in range(256)}
    backend = BackendTokenizer(models.BPE(vocab, [("\u2581", "a")], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(backend)
    text = "\u2581ab\u2581😀\u2581é"
    ids = backend.encode(text).ids
    assert any(t >= 5 for t in ids)  # the emoji and é went to byte tokens
    joined = b"".join(tok.token_bytes(t) for t in ids)
    assert joined == text.replace("\u2581", " ").encode("utf-8") and joined.decode() == backend.decode(ids)


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
