"""A GGUF file's sentencepiece tokenizer: built by transformers the first time (slow: merges derived from scores),
then read back from gqa's cache without transformers — encoding and decoding exactly as transformers' tokenizer does
on a multilingual corpus, special, control and user-defined tokens included; a changed vocabulary is another entry;
a damaged entry is built again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from gqa.loaders import load_tokenizer, tokenizer_cache
from gqa.loaders.gguf_reader import GGUFFile
from tests.loaders.test_gguf_tokenizer import corpus

transformers = pytest.importorskip("transformers")

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "token", "cache", "piece",
         "sentence", "naive", "café", "über", "return", "def", "class", "import", "print", "value", "model", "head",
         "query", "key", "group", "attention")  # fmt: skip
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def spm_gguf(path: Path, extra_words: tuple[str, ...] = (), retype: int | None = None) -> Path:
    """A llama-style sentencepiece vocabulary: special tokens, the 256 byte tokens, ``▁``, letters and digits, every
    prefix of ``▁word`` and of ``word`` for a few words (so merges can be derived), control and user-defined tokens,
    scores falling with the id; a chat template."""
    tokens, types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    tokens += [f"<0x{i:02X}>" for i in range(256)]
    types += [6] * 256
    pieces = dict.fromkeys(["▁", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"()"])
    for word in (*WORDS, *extra_words):
        for start in ("▁", ""):
            for end in range(1, len(word) + 1):
                pieces[start + word[:end]] = None
    pieces = [p for p in pieces if p not in tokens]
    tokens += pieces
    types += [1] * len(pieces)
    tokens += ["<|im_start|>", "<|im_end|>", "<think>"]
    types += [3, 3, 4]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) for i in range(len(tokens))])
    if retype is not None:  # one token in the middle of the vocabulary typed as control
        types[retype] = 3
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GQA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizers"


def test_the_second_load_reads_the_cache_and_equals_transformers(tmp_path, cache):
    path = spm_gguf(tmp_path / "spm.gguf")
    cold = load_tokenizer(path)
    assert cold._hf is not None  # built by transformers
    entries = list(cache.iterdir())
    assert len(entries) == 1 and entries[0].name == f"{tokenizer_cache.cache_key(GGUFFile(path))}.json"
    warm = load_tokenizer(path)
    assert warm._hf is None  # the bare tokenizers object
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    texts = [*corpus(1500, seed=4), "<|im_start|>user\n<think>naive café</think><|im_end|>", " the  world\t"]
    for text in texts:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert warm.encode(text, add_special_tokens=special) == ids == cold.encode(text, add_special_tokens=special)
            for skip in (True, False):
                assert warm.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert warm.encode("the quick brown fox")[0] == 1  # BOS, as the file says
    assert warm.decode(warm.encode("hello world, the lazy dog")) == "hello world, the lazy dog"
    assert (warm.eos_token_ids, warm.bos_token_id, warm.vocab_size) == (cold.eos_token_ids, cold.bos_token_id,
                                                                        cold.vocab_size)  # fmt: skip
    messages = [{"role": "user", "content": "hello"}]
    assert warm.apply_chat(messages) == cold.apply_chat(messages)


def test_a_warm_load_does_not_import_transformers(tmp_path, cache):
    path = spm_gguf(tmp_path / "spm.gguf")
    load_tokenizer(path)
    code = ("import sys, gqa; tok = gqa.load_tokenizer(sys.argv[1]); "
            "print(tok.encode('hello world'), 'transformers' in sys.modules)")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GQA_CACHE_DIR": str(cache.parent)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    ids, imported = done.stdout.rsplit(" ", 1)
    assert imported.strip() == "False"
    assert json.loads(ids) == load_tokenizer(path).encode("hello world")


def test_another_vocabulary_is_another_entry_and_a_damaged_one_is_rebuilt(tmp_path, cache):
    a = spm_gguf(tmp_path / "a.gguf")
    b = spm_gguf(tmp_path / "b.gguf", extra_words=("zebra",))
    assert tokenizer_cache.cache_key(GGUFFile(a)) != tokenizer_cache.cache_key(GGUFFile(b))
    many = tuple(x + y for x in "abcdefghijklmnopqrstuvwxyz" for y in "abcdefghijklmnopqrstuvwxyz")  # > 1,000 tokens
    big, retyped = spm_gguf(tmp_path / "big.gguf", many), spm_gguf(tmp_path / "re.gguf", many, retype=1000)
    assert len(GGUFFile(big).metadata["tokenizer.ggml.token_type"]) > 1500
    # one type changed in the middle of the array (numpy's repr would elide it)
    assert tokenizer_cache.cache_key(GGUFFile(big)) != tokenizer_cache.cache_key(GGUFFile(retyped))
    load_tokenizer(a)
    load_tokenizer(b)
    assert len(list(cache.iterdir())) == 2
    entry = cache / f"{tokenizer_cache.cache_key(GGUFFile(a))}.json"
    entry.write_text('{"format": 1, "tokenizer": "{not json')
    again = load_tokenizer(a)
    assert again._hf is not None  # built again through transformers
    assert json.loads(entry.read_text())["format"] == tokenizer_cache.FORMAT  # and the entry rewritten
    assert load_tokenizer(a)._hf is None


def test_a_tokenizer_the_bare_object_would_change_is_not_cached(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(tokenizer_cache, "agrees", lambda a, b: False)
    path = spm_gguf(tmp_path / "spm.gguf")
    load_tokenizer(path)
    assert not cache.exists() or not list(cache.iterdir())
    assert load_tokenizer(path)._hf is not None


def test_the_probe_tells_a_different_tokenizer_apart(tmp_path, cache):
    from gqa.loaders.tokenizer import Tokenizer

    tok = load_tokenizer(spm_gguf(tmp_path / "spm.gguf"))
    same = Tokenizer(tok.backend, chat_template=tok.chat_template, special_tokens=tok.special_tokens)
    assert tokenizer_cache.agrees(tok, same)
    other_eos = Tokenizer(tok.backend, special_tokens={**tok.special_tokens, "eos_token": "<|im_end|>"})
    assert not tokenizer_cache.agrees(tok, other_eos)
