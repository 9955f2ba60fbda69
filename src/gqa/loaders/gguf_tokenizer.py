"""A byte-level BPE tokenizer (``tokenizer.ggml.model == "gpt2"``: SmolLM, Qwen2, Llama 3) built straight from a GGUF
file's vocabulary, merges and token types with the ``tokenizers`` library, without transformers.

It is the tokenizer transformers' GGUF converter makes (``GPT2Tokenizer`` over the file's vocabulary; the split
regex of the file's ``tokenizer.ggml.pre`` where one is known; control tokens special, user-defined tokens added
whole; BOS/EOS added per ``add_bos_token``/``add_eos_token``); ``tests/loaders/test_gguf_tokenizer.py`` holds the two to
identical ids on a multilingual corpus. Other tokenizer models (sentencepiece ``llama``, ...) are not built here.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from .gguf_reader import GGUFFile

__all__ = ["NATIVE_MODELS", "backend_from_gguf", "special_tokens_from_gguf"]

NATIVE_MODELS = frozenset({"gpt2"})
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMES = ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"]
_LLAMA3_NAMES += ["jina-v5-nano", "dbrx", "smaug-bpe"]
# tokenizer.ggml.pre -> the regex its merges were learned with; others split with GPT-2's (ByteLevel's own)
SPLITS = {
    **dict.fromkeys(_LLAMA3_NAMES, _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "tekken": _TEKKEN,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}
_SPECIAL_IDS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable Latin-1 bytes stand for themselves, the other 68 bytes
    for the code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def _field(g: GGUFFile, key: str, kind: type, default: Any = None) -> Any:
    value = g.metadata.get(key, default)
    if value is not default and not isinstance(value, kind):
        raise ValueError(f"{g.path}: GGUF metadata {key!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def special_tokens_from_gguf(g: GGUFFile) -> dict[str, str | None]:
    """``{"bos_token": ..., "eos_token": ..., "unk_token": ..., "pad_token": ...}``: the tokens the file's
    ``tokenizer.ggml.*_token_id`` name (``None`` where it names none); ``ValueError`` for an id outside the
    vocabulary."""
    tokens = _field(g, "tokenizer.ggml.tokens", list, [])
    out: dict[str, str | None] = {}
    for name, key in _SPECIAL_IDS.items():
        i = g.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and not (isinstance(i, int) and 0 <= i < len(tokens)):
            raise ValueError(f"{g.path}: tokenizer.ggml.{key}_token_id = {i!r} is not a token of the vocabulary")
        out[name] = None if i is None else tokens[i]
    return out


def backend_from_gguf(g: GGUFFile) -> BackendTokenizer:
    """The ``tokenizers.Tokenizer`` a byte-level BPE GGUF file describes.

    Raises
    ------
    ValueError
        No vocabulary or merges, a tokenizer model other than ``gpt2``, or arrays of the wrong types or lengths.
    """
    model = _field(g, "tokenizer.ggml.model", str)
    if model not in NATIVE_MODELS:
        raise ValueError(f"{g.path}: tokenizer model {model!r} is not built natively (only {', '.join(NATIVE_MODELS)})")
    tokens = _field(g, "tokenizer.ggml.tokens", list)
    merges = _field(g, "tokenizer.ggml.merges", list)
    if not tokens or merges is None:
        raise ValueError(f"{g.path}: a byte-level BPE tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.merges")
    types = g.metadata.get("tokenizer.ggml.token_type")
    if types is not None and not (isinstance(types, np.ndarray) and types.dtype.kind in "iu"):
        raise ValueError(f"{g.path}: tokenizer.ggml.token_type must be an array of integers")
    types = [0] * len(tokens) if types is None else types.tolist()
    if len(types) != len(tokens):
        raise ValueError(f"{g.path}: {len(types)} token types for {len(tokens)} tokens")
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):  # a token outside the byte alphabet is respelled in it, as transformers does
        vocab[token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))] = i
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or " " in right:
            raise ValueError(f"{g.path}: merge {merge!r} is not two tokens separated by one space")
        pairs.append((left, right))
    try:
        bpe = models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False, ignore_merges=False)
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of tokens not in the vocabulary
        raise ValueError(f"{g.path}: the GGUF vocabulary and merges do not make a BPE model ({e})") from None
    tok = BackendTokenizer(bpe)
    split = SPLITS.get(_field(g, "tokenizer.ggml.pre", str))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == CONTROL and set(t) <= alphabet]
    special = special_tokens_from_gguf(g)
    named = [t for t in special.values() if t is not None and t not in control]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(control + named)])
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    tok.post_processor = _bos_eos(g, special, vocab)
    return tok


def _bos_eos(g: GGUFFile, special: dict[str, str | None], vocab: dict[str, int]) -> processors.TemplateProcessing:
    """BOS/EOS around each sequence as ``tokenizer.ggml.add_bos_token``/``add_eos_token`` say (default: neither)."""
    parts: dict[str, list[str]] = {"bos": [], "eos": []}
    pinned: dict[str, int] = {}
    for end in parts:
        token = special[f"{end}_token"]
        if token is not None and _field(g, f"tokenizer.ggml.add_{end}_token", bool, False):
            parts[end].append(token)
            pinned[token] = vocab.get(token, g.metadata[f"tokenizer.ggml.{end}_token_id"])
    bos, eos = parts["bos"], parts["eos"]
    single = [*bos, "$A:0", *eos]
    pair = [*single, *bos, "$B:1", *eos]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(pinned.items()))
