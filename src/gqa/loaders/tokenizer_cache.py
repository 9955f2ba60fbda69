"""A GGUF file's sentencepiece (or unigram, ...) tokenizer, kept after its first build so that the next load is fast.

Byte-level BPE vocabularies are built natively in milliseconds (``gguf_tokenizer``). The others go through
transformers' GGUF tokenizer conversion, which derives a sentencepiece vocabulary's merges from its scores: ~3.5 s
for a 32k vocabulary, on every load, plus the transformers import. After that first build the ``tokenizers`` object
(``tokenizer.json``), its special tokens and chat template are written to ``cache_root()/tokenizers/KEY.json``, KEY a
SHA-256 of every ``tokenizer.*`` field of the file and the transformers version that converted it; a later load of
any file with the same tokenizer reads that back (tens of milliseconds, no transformers import).

The entry is written only if the bare ``tokenizers`` object gives what transformers' tokenizer gives on a probe text
(ids with and without special tokens, decoded text with and without them, the BOS/EOS ids); a tokenizer whose
transformers class adds behaviour of its own is not cached and keeps loading through transformers. An unreadable or
foreign entry is ignored (and rewritten).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as BackendTokenizer

from .._atomic import write_json_atomic
from .._paths import cache_root
from .gguf_reader import GGUFFile
from .tokenizer import Tokenizer

FORMAT = 2
PROBE = (
    "Hello, world! The quick brown fox jumps over the lazy dog 1234567890.\n"
    "  Two spaces, a tab\there, ünïcödé, 日本語のテキスト, emoji 🙂, and <b>markup</b>.\n\n"
    "def f(x):\n    return x ** 2  # code\r\nEnd."
)


def cache_key(g: GGUFFile) -> str:
    """SHA-256 of the file's ``tokenizer.*`` metadata (names and values, in name order) and the transformers version
    that builds the tokenizer from them."""
    h = hashlib.sha256(f"gqa-tokenizer-{FORMAT}|transformers {_transformers_version()}".encode())
    for name in sorted(k for k in g.metadata if k.startswith("tokenizer.")):
        value = g.metadata[name]
        h.update(name.encode() + b"\0")
        if isinstance(value, np.ndarray):  # every element, exactly (repr would elide the middle of a long array)
            h.update(f"{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
        else:
            h.update(json.dumps(value, ensure_ascii=False, default=_scalar).encode())
    return h.hexdigest()


def _scalar(value: object) -> object:
    """A numpy scalar as its Python value; anything else JSON cannot hold raises ``TypeError`` (no key: no cache)."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot key a tokenizer field of type {type(value).__name__}")


def _transformers_version() -> str:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def entry_path(key: str) -> Path:
    return cache_root() / "tokenizers" / f"{key}.json"


def read_cached(key: str) -> Tokenizer | None:
    """The tokenizer kept under ``key``, or None (no entry, or one that cannot be read)."""
    path = entry_path(key)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        if entry.get("format") != FORMAT:
            return None
        backend = BackendTokenizer.from_str(entry["tokenizer"])
        return Tokenizer(backend, chat_template=entry.get("chat_template"), special_tokens=entry["special_tokens"])
    except Exception:  # a missing or damaged entry, or one tokenizers refuses: built afresh
        return None


def write_cached(key: str, tok: Tokenizer) -> bool:
    """Keep ``tok`` (transformers-built) under ``key`` if its bare ``tokenizers`` object agrees with it on ``PROBE``;
    whether it was kept. A cache that cannot be written is no error: the tokenizer still works."""
    native = Tokenizer(tok.backend, chat_template=tok.chat_template, special_tokens=tok.special_tokens)
    if not agrees(tok, native):
        return False
    special = {k: v for k, v in tok.special_tokens.items() if isinstance(v, str) or _strings(v)}
    if special != tok.special_tokens:
        return False  # special tokens that are not plain strings: not kept
    entry = {"format": FORMAT, "tokenizer": tok.backend.to_str(), "special_tokens": special,
             "chat_template": tok.chat_template}  # fmt: skip
    try:
        write_json_atomic(entry_path(key), entry)
    except OSError:
        return False
    return True


def _strings(v: object) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def agrees(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether ``a`` and ``b`` encode and decode ``PROBE`` alike and name the same BOS/EOS ids."""
    for special in (True, False):
        ids = a.encode(PROBE, add_special_tokens=special)
        if b.encode(PROBE, add_special_tokens=special) != ids:
            return False
        if any(a.decode(ids, skip_special_tokens=s) != b.decode(ids, skip_special_tokens=s) for s in (True, False)):
            return False
    return a.eos_token_ids == b.eos_token_ids and a.bos_token_id == b.bos_token_id
