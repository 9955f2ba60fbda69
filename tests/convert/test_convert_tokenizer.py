"""The tokenizer ``gqa convert`` writes from a GGUF file, in the form every reader of an HF folder takes:
``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` (not ``TokenizersBackend``, a class only transformers 5
has, so that transformers 4 and llama.cpp's ``convert_hf_to_gguf.py`` could not load the folder), holds the chat
template and the special tokens, and the folder encodes as the source does. The source: a tiny random Llama GGUF
carrying the embedded SmolLM2's tokenizer (every ``tokenizer.*`` key), a real vocabulary with a chat template."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import gqa
from gqa.convert import convert
from gqa.loaders import default_model_path
from gqa.loaders.gguf_reader import GGUFFile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

TEXTS = ["Hello world", "  leading spaces\nand\ttabs", "<|im_start|>user\nhi<|im_end|>", "Ünïcödé ✓ 分组 😀 12345"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is GQA?"}]


def write_tiny_gguf_with_smollm2_tokenizer(path: Path) -> Path:
    """A random 2-layer Llama (hidden 32, 4 query / 2 KV heads, tied embeddings) whose tokenizer metadata is the
    embedded SmolLM2 file's, copied key by key with its value types."""
    source = gguf.GGUFReader(default_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].contents())
    w = gguf.GGUFWriter(str(path), "llama")
    sizes = {"block_count": 2, "context_length": 64, "embedding_length": 32, "feed_forward_length": 64,
             "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 8,
             "vocab_size": vocab}  # fmt: skip
    for key, value in sizes.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), kind, sub_type=sub)
    rng = np.random.default_rng(0)

    def add(name: str, *shape: int) -> None:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.3)

    add("token_embd.weight", vocab, 32)
    add("output_norm.weight", 32)
    for i in range(2):
        for name, shape in [("attn_norm", (32,)), ("ffn_norm", (32,)), ("attn_q", (32, 32)), ("attn_k", (16, 32)),
                            ("attn_v", (16, 32)), ("attn_output", (32, 32)), ("ffn_gate", (64, 32)),
                            ("ffn_up", (64, 32)), ("ffn_down", (32, 64))]:  # fmt: skip
            add(f"blk.{i}.{name}.weight", *shape)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    """(the source GGUF, its conversion to 1 KV head: an HF folder)."""
    root = tmp_path_factory.mktemp("tokenizer")
    src = write_tiny_gguf_with_smollm2_tokenizer(root / "tiny.gguf")
    return src, convert(src, root / "out", kv_heads=1, method="mean")


@pytest.fixture(scope="module")
def reference(converted):
    """transformers' own tokenizer of the source GGUF (its GGUF converter: independent of gqa's)."""
    src, _ = converted
    return transformers.AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)


def test_the_tokenizer_config_is_one_transformers_4_reads(converted):
    src, out = converted
    cfg = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # transformers 4 has no TokenizersBackend
    assert isinstance(cfg.get("extra_special_tokens", {}), dict)  # 4 reads named tokens there; a list breaks it
    assert cfg["chat_template"] == GGUFFile(src).metadata["tokenizer.chat_template"]  # where every version looks
    assert not (out / "chat_template.jinja").exists()
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")


@pytest.mark.parametrize("loader", ["PreTrainedTokenizerFast", "AutoTokenizer"])
def test_the_written_folder_encodes_and_chats_as_the_source(converted, reference, loader):
    src, out = converted
    tok = getattr(transformers, loader).from_pretrained(out)
    ours = gqa.load_tokenizer(src)
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text) == ours.encode(text), text
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(tok, name) == getattr(reference, name), name
    want = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == want
    assert gqa.load_tokenizer(out).apply_chat(MESSAGES) == ours.apply_chat(MESSAGES)


def llama_cpp_converter() -> Path | None:
    """llama.cpp's ``convert_hf_to_gguf.py``: in ``$LLAMA_CPP_DIR``, on ``PATH`` or importable; None where absent."""
    candidates = [Path(os.environ["LLAMA_CPP_DIR"]) / "convert_hf_to_gguf.py"] if "LLAMA_CPP_DIR" in os.environ else []
    candidates.append(Path(shutil.which("convert_hf_to_gguf.py") or "convert_hf_to_gguf.py"))
    spec = importlib.util.find_spec("convert_hf_to_gguf")
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin))
    return next((c for c in candidates if c.is_absolute() and c.is_file()), None)


def test_llama_cpps_converter_reads_the_folder(converted, tmp_path):
    """Where llama.cpp is installed: its converter turns the folder back into a GGUF with the source's tokenizer."""
    script = llama_cpp_converter()
    if script is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py not found (set LLAMA_CPP_DIR to a llama.cpp checkout)")
    src, out = converted
    result = subprocess.run([sys.executable, str(script), str(out), "--outfile", str(tmp_path / "back.gguf"),
                             "--outtype", "f32"], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    back, source = GGUFFile(tmp_path / "back.gguf").metadata, GGUFFile(src).metadata
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"):  # fmt: skip
        assert np.array_equal(np.asarray(back[key]), np.asarray(source[key])), key
