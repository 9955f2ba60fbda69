"""The native GGUF tokenizer (``gqa.loaders.gguf_tokenizer``) against transformers' GGUF tokenizer: identical ids on a
corpus of 10,000+ strings (languages, emoji, whitespace runs, digits, code, special and chat tokens), the same decoded
text and the same chat-template rendering; and on GGUF files the test writes with other split regexes, BOS/EOS flags,
user-defined tokens and tokens outside the byte alphabet."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from gqa.loaders import default_model_path, load_tokenizer
from gqa.loaders.gguf_reader import GGUFFile
from gqa.loaders.gguf_tokenizer import byte_alphabet
from gqa.loaders.tokenizer import Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

FRAGMENTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Grouped-query attention shares K/V heads across query heads.",
    "I'm sure they'll say it's what we'd've done",
    "Ça va? Größenverhältnisse, naïve café, Ærøskøbing, ½ ¾ µ",
    "Привет, как дела? Съешь же ещё этих мягких французских булок.",
    "分组查询注意力让键值缓存变小。多头注意力与多查询注意力是它的两个特例。",
    "日本語の文章です。カタカナとひらがなと漢字。",
    "한국어 문장도 있습니다.",
    "مرحبا بالعالم، هذا نص عربي.",
    "नमस्ते दुनिया, यह हिंदी है।",
    "שלום עולם",
    "Ελληνικά γράμματα: αβγδε",
    "ไทย ภาษา",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✅",
    "    four spaces, then\ttab\t\tand\n\nnewlines\r\nCRLF   \n",
    "3.14159 2718281828 1,000,000 0x1F 1e-9 -42 +7 100% 12:30",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>gqa<file_sep>main.py<filename>",
    "<|im_start|><|im_start|>x<|im_end|>",
    "a<|im_end|>b <|endoftext|> c",
    "https://example.com/path?q=1&r=two#frag",
    "e-mail: someone@example.org",
    "  leading and trailing spaces  ",
    "ALL CAPS TEXT AND MiXeD cAsE",
    "\u00a0non-breaking\u2009thin\u200bzero-width\u3000ideographic",
    "combining: e\u0301 a\u0308 n\u0303",
    "",
    " ",
    "\n",
    "tokenization's edge-cases: don't, won't, O'Neil",
]


def corpus(n: int = 10_000, seed: int = 0) -> list[str]:
    """``n`` distinct strings: every fragment alone, then random splices of fragments, slices of them, random code
    points (no surrogates) and whitespace runs."""
    rng = random.Random(seed)
    out = dict.fromkeys(FRAGMENTS)
    seps = ["", " ", "  ", "\n", "\t", "\r\n", "   \n\n", "\u3000"]
    while len(out) < n:
        kind = rng.random()
        if kind < 0.5:
            parts = [rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 4))]
            text = "".join(p + rng.choice(seps) for p in parts)
        elif kind < 0.7:
            f = rng.choice(FRAGMENTS)
            i, j = sorted(rng.randint(0, len(f)) for _ in range(2))
            text = f[i:j]
        elif kind < 0.85:
            cps = [rng.choice([rng.randint(32, 0x7E), rng.randint(0xA0, 0x2FFF), rng.randint(0x3000, 0xD7FF)])]
            cps += [rng.randint(0xE000, 0x10FFFF) if rng.random() < 0.1 else rng.randint(32, 0x4FFF) for _ in range(20)]
            text = "".join(chr(c) for c in cps[: rng.randint(1, 21)])
        else:
            text = "".join(rng.choice([" ", "\t", "\n", "x", "1", "22", "a b"]) for _ in range(rng.randint(1, 30)))
        out[text] = None
    return list(out)


@pytest.fixture(scope="module")
def smollm() -> tuple[Tokenizer, object]:
    path = default_model_path()
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    return load_tokenizer(path), hf


def test_corpus_ids_identical_to_transformers(smollm):
    tok, hf = smollm
    texts = corpus()
    assert len(set(texts)) == len(texts) >= 10_000
    want = hf(texts, add_special_tokens=True)["input_ids"]
    got = [tok.encode(t) for t in texts]
    bad = [(t, g, w) for t, g, w in zip(texts, got, want, strict=True) if g != w]
    assert not bad, f"{len(bad)} strings differ, first: {bad[0]}"
    assert sum(len(w) for w in want) > 200_000  # the corpus exercises the merges, not only single bytes


def test_decode_identical_to_transformers(smollm):
    tok, hf = smollm
    for text in corpus(600, seed=1):
        ids = hf.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), text


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        [
            {"role": "user", "content": "Bonjour 😀"},
            {"role": "assistant", "content": "Salut !"},
            {"role": "user", "content": "  spaces\n\nand lines  "},
        ],
    ],
)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_identical_to_transformers(smollm, messages, gen):
    tok, hf = smollm
    want = hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
    assert tok.render_chat(messages, add_generation_prompt=gen) == want
    assert tok.apply_chat(messages, add_generation_prompt=gen) == hf.encode(want, add_special_tokens=False)


def test_special_ids_and_native(smollm):
    tok, hf = smollm
    assert repr(tok).startswith("Tokenizer(native")
    assert tok.eos_token_ids == [hf.eos_token_id] and tok.bos_token_id == hf.bos_token_id
    assert tok.pad_token_id == hf.pad_token_id and tok.vocab_size == len(hf)
    assert tok.token_id("<|im_end|>") == 2 and tok.token_id("<|not a token|>") is None
    assert tok.hf.encode("Hello <|im_end|>") == hf.encode("Hello <|im_end|>")  # the transformers view of it


def test_no_transformers_import_on_the_path():
    code = (
        "import sys; from gqa.loaders import load_tokenizer; t = load_tokenizer(None); t.apply_chat('hi'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch', 'gqa')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "'transformers" not in out.stdout, out.stdout


# ---------------------------------------------------------------------------------------------------------------------
# Files the test writes: the SmolLM2 vocabulary and merges under other settings


def write_tokenizer_gguf(path: Path, base: GGUFFile, **changes) -> Path:
    """A GGUF file with ``base``'s tokenizer arrays and ``changes`` (``pre``, ``add_bos``, ``add_eos``, ``extra``:
    tokens appended with their token type), and no tensors."""
    tokens = list(base.metadata["tokenizer.ggml.tokens"])
    types = base.metadata["tokenizer.ggml.token_type"].tolist()
    for token, kind in changes.get("extra", []):
        tokens.append(token)
        types.append(kind)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(changes.get("pre", "smollm"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(base.metadata["tokenizer.ggml.merges"]))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(changes.get("add_bos", False))
    w.add_add_eos_token(changes.get("add_eos", False))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


VARIANTS = {
    "qwen2 split": {"pre": "qwen2"},
    "llama3 split + bos": {"pre": "llama-bpe", "add_bos": True},
    "gpt-4o split + bos + eos": {"pre": "gpt-4o", "add_bos": True, "add_eos": True},
    "user-defined and odd control tokens": {
        "extra": [("<think>", 4), ("</think>", 4), ("ĠDefinitely", 4), ("<|ctl|>", 3), ("é control", 3), ("naïve", 1)]
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_written_files_match_transformers(tmp_path, variant):
    base = GGUFFile(default_model_path())
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", base, **VARIANTS[variant])
    tok = load_tokenizer(path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name, local_files_only=True)
    texts = [*corpus(1500, seed=2), "<think>why</think> Definitely naïve <|ctl|> é control"]
    for text in texts:
        assert tok.encode(text) == hf.encode(text), (variant, text)
    assert tok.vocab_size == len(hf)


def test_byte_alphabet_is_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_alphabet() == bytes_to_unicode()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("tokenizer.ggml.merges", ["a b c"], "merge 'a b c' is not two tokens separated by one space"),
        ("tokenizer.ggml.token_type", np.array([1, 2, 3]), "3 token types for 49152 tokens"),
        ("tokenizer.ggml.token_type", ["1", "2"], "token_type must be an array of integers"),
        ("tokenizer.ggml.bos_token_id", 10**6, "tokenizer.ggml.bos_token_id = 1000000 is not a token"),
        ("tokenizer.ggml.pre", 7, "'tokenizer.ggml.pre' must be str, got int"),
        ("tokenizer.ggml.model", "llama", "tokenizer model 'llama' is not built natively"),
    ],
)
def test_bad_tokenizer_metadata_is_a_value_error(tmp_path, key, value, message):
    g = GGUFFile(default_model_path())
    g.metadata[key] = value
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_gguf(g)
