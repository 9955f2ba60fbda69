"""``gqa.loaders.gguf_reader`` against the ``gguf`` package's reader (every value type, multi-byte UTF-8 strings, the
shipped SmolLM2 file), and a fuzz test: mutated, truncated and spliced small GGUF files load or raise ``ValueError``
naming the problem, quickly, without other exceptions and without allocations the file's size does not allow."""

from __future__ import annotations

import re
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gqa.loaders import default_model_path, load_tokenizer, read_model
from gqa.loaders.gguf_reader import GGML_TYPES, GGUFFile

SCALARS = [
    (V.UINT8, 200),
    (V.INT8, -7),
    (V.UINT16, 65000),
    (V.INT16, -300),
    (V.UINT32, 4_000_000_000),
    (V.INT32, -2_000_000_000),
    (V.FLOAT32, 1.5),
    (V.BOOL, True),
    (V.STRING, "héllo wörld ✓ 分组 😀"),
    (V.UINT64, 2**63 + 5),
    (V.INT64, -(2**62)),
    (V.FLOAT64, 2.718281828459045),
]


def reference_contents(path: Path) -> dict:
    """Every metadata value as the ``gguf`` package reads it (arrays as lists)."""
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def test_every_value_type_as_gguf_reads_it(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    for kind, value in SCALARS:
        w.add_key_value(f"scalar.{kind.name}", value, kind)
        if kind != V.STRING:
            w.add_key_value(f"array.{kind.name}", [value, value, value], V.ARRAY, sub_type=kind)
    w.add_array("array.strings", ["", "a", "ß", "日本語", "👨‍👩‍👧", "x" * 300])
    w.add_array("array.empty", [])
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    path = tmp_path / "v.gguf"
    g, want = GGUFFile(path), reference_contents(path)
    assert set(g.metadata) == set(want)
    for key, value in want.items():
        got = plain(g.metadata[key])
        assert got == value or np.allclose(got, value), key
        if key.startswith("scalar."):
            assert type(got) is type(value), key
    (t,) = g.tensors
    assert (t.name, t.type.name, t.shape, t.n_elements) == ("t", "F32", (2, 32), 64)
    assert np.array_equal(g.data(t).view(np.float32), np.arange(64, dtype=np.float32))


def test_shipped_file_as_gguf_reads_it():
    path = default_model_path()
    g, reader = GGUFFile(path), gguf.GGUFReader(path)
    assert {k: plain(v) for k, v in g.metadata.items()} == reference_contents(path)
    assert len(g.tensors) == len(reader.tensors) == 272
    for mine, ref in zip(g.tensors, reader.tensors, strict=True):
        assert (mine.name, mine.type.id, mine.offset, mine.nbytes) == (
            ref.name,
            ref.tensor_type,
            ref.data_offset,
            ref.n_bytes,
        )
        assert mine.shape == tuple(reversed(ref.shape.tolist()))
    last = g.tensors[-1]
    assert bytes(g.data(last)[-64:]) == bytes(np.asarray(reader.tensors[-1].data).view(np.uint8).reshape(-1)[-64:])


def test_type_table_is_ggmls():
    for type_id, kind in GGML_TYPES.items():
        assert Q(type_id).name == kind.name
        assert gguf.GGML_QUANT_SIZES[Q(type_id)] == (kind.block, kind.block_bytes)


def test_views_of_the_file_are_copy_on_write(tmp_path):
    path = write_small(tmp_path / "m.gguf", "q8")
    before = path.read_bytes()
    g = GGUFFile(path)
    data = g.data(g.tensors[0])
    data[:] = 0  # writable, private to the process
    assert path.read_bytes() == before


def test_released_pages_read_the_file_again_and_leave_the_rest(tmp_path):
    """``release`` drops the process's (copy-on-write) pages under a view: a rewritten tensor reads the file's bytes
    again and leaves ``reordered``; bytes outside its whole pages and other tensors keep what was written; a tensor
    that is not a view of the map is ignored."""
    import mmap

    import torch

    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    big = np.arange(5 * mmap.PAGESIZE // 4, dtype=np.float32)
    w.add_tensor("a", big)
    w.add_tensor("b", np.ones(16, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()
    g = GGUFFile(path)
    a, b = (g.data(g.tensor(n)) for n in ("a", "b"))
    a[:], b[:] = 7, 7
    g.reordered |= {"a", "b"}
    assert g.release([torch.zeros(4096, dtype=torch.uint8)]) == 0
    dropped = g.release([torch.from_numpy(a)])
    assert dropped % mmap.PAGESIZE == 0 and 4 * mmap.PAGESIZE <= dropped <= 5 * mmap.PAGESIZE
    values = g.data(g.tensor("a")).view(np.float32)
    whole = np.flatnonzero(values == big)  # the whole pages: the file's numbers again
    assert len(whole) * 4 == dropped and (np.diff(whole) == 1).all()
    assert (g.data(g.tensor("a")).reshape(-1)[: whole[0] * 4] == 7).all()  # the part page before them: kept
    assert (b == 7).all() and g.reordered == {"b"}


# ---------------------------------------------------------------------------------------------------------------------
# Small valid files, and the fuzz test over them

VOCAB = [chr(c) for c in range(33, 127)] + ["Ġ", "Ġt", "he", "Ġthe", "ü", "<|end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]


def write_small(path: Path, kind: str) -> Path:
    """A tiny llama GGUF (2 layers, hidden 32, 4/2 heads) with a byte-level BPE tokenizer: ``kind`` "f32", "q8"
    (Q8_0 matrices, an F16 embedding) or "q4" (Q4_1 matrices)."""
    rng = np.random.default_rng(0)
    hidden, inter, vocab, layers = 32, 64, len(VOCAB), 2
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "block_count": layers, "context_length": 64, "embedding_length": hidden, "feed_forward_length": inter,
        "attention.head_count": 4, "attention.head_count_kv": 2, "vocab_size": vocab,
    }.items():  # fmt: skip
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(VOCAB)
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_token_merges(MERGES)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|end|>{% endfor %}")

    def add(name, shape, quant=None):
        x = rng.standard_normal(shape).astype(np.float32)
        if quant in (Q.Q8_0, Q.Q4_1):
            w.add_tensor(name, gguf.quants.quantize(x, quant), raw_dtype=quant)
        elif quant == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, x)

    matrix = {"f32": None, "q8": Q.Q8_0, "q4": Q.Q4_1}[kind]
    add("token_embd.weight", (vocab, hidden), Q.F16 if kind == "q8" else None)
    add("output_norm.weight", (hidden,))
    for i in range(layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (hidden,))
        add(b + "ffn_norm.weight", (hidden,))
        for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (16, hidden)), ("attn_v", (16, hidden))]:
            add(b + name + ".weight", shape, matrix)
        add(b + "attn_output.weight", (hidden, hidden), matrix)
        add(b + "ffn_gate.weight", (inter, hidden), matrix)
        add(b + "ffn_up.weight", (inter, hidden), matrix)
        add(b + "ffn_down.weight", (hidden, inter), matrix)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> list[bytes]:
    """The small files' bytes (and transformers imported: a file whose tokenizer model a mutation renamed goes to
    its GGUF converter, whose first import is not the load's time)."""
    import transformers  # noqa: F401

    folder = tmp_path_factory.mktemp("seeds")
    return [write_small(folder / f"{kind}.gguf", kind).read_bytes() for kind in ("f32", "q8", "q4")]


def load_everything(path: Path) -> None:
    """What a user's load does: the weights (dequantized and kept-quantized) and the tokenizer, with a chat."""
    read_model(path)
    read_model(path, keep_quantized=True)
    tok = load_tokenizer(path)
    tok.decode(tok.apply_chat([{"role": "user", "content": "the ü"}]))


def test_small_files_load(seeds, tmp_path):
    for i, data in enumerate(seeds):
        path = tmp_path / f"{i}.gguf"
        path.write_bytes(data)
        load_everything(path)
    tok = load_tokenizer(path)
    assert tok.decode(tok.encode("the the")) == "the the" and tok.token_id("<|end|>") == len(VOCAB) - 1


HUGE = [2**60, 2**63, 2**64 - 1, 2**32 - 1, 2**31, 10**12]


@st.composite
def damaged(draw, seeds_count: int) -> tuple[int, list]:
    """A seed index and a list of edits: byte flips, u64 overwrites with huge values, a truncation, a splice."""
    edits = draw(
        st.lists(
            st.one_of(
                st.tuples(st.just("flip"), st.floats(0, 1), st.integers(0, 255)),
                st.tuples(st.just("u64"), st.floats(0, 1), st.sampled_from(HUGE)),
                st.tuples(st.just("cut"), st.floats(0, 1), st.just(0)),
                st.tuples(st.just("splice"), st.floats(0, 1), st.floats(0, 1)),
            ),
            min_size=1,
            max_size=6,
        )
    )
    return draw(st.integers(0, seeds_count - 1)), edits


def apply(data: bytes, other: bytes, edits: list) -> bytes:
    out = bytearray(data)
    for kind, where, value in edits:
        i = int(where * max(len(out) - 1, 0))
        if kind == "flip" and out:
            out[i] = value
        elif kind == "u64":
            out[i : i + 8] = value.to_bytes(8, "little")
        elif kind == "cut":
            del out[i:]
        else:
            out = out[:i] + other[int(value * len(other)) :]
    return bytes(out)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=damaged(3))
def test_fuzz_damaged_files_load_or_raise_value_error(seeds, tmp_path, case):
    index, edits = case
    data = apply(seeds[index], seeds[(index + 1) % len(seeds)], edits)
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        load_everything(path)
    except ValueError as e:
        assert str(e).startswith(str(path)) or "chat template" in str(e), e  # names the file (or the template)
    finally:
        seconds = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert seconds < 1.0, (seconds, edits)
    assert peak < 64 * len(data) + (16 << 20), (peak, edits)  # numpy/Python allocations the file's size allows


@pytest.mark.parametrize(
    ("offset_of", "value", "message"),
    [
        ("tokens count", 2**60, "claims 1152921504606846976 elements, more than the rest of the file can hold"),
        ("tensor count", 2**60, "more than the file can hold"),
        ("first tensor offset", 2**40, "runs past the end of the file"),
    ],
)
def test_lying_sizes_are_refused_before_reading(tmp_path, offset_of, value, message):
    data = bytearray(write_small(tmp_path / "m.gguf", "f32").read_bytes())
    if offset_of == "tensor count":
        at = 8
    elif offset_of == "tokens count":
        key = b"tokenizer.ggml.tokens"
        at = data.index(key) + len(key) + 4 + 4  # after the key, its value type (array) and element type (string)
    else:
        name = b"token_embd.weight"
        at = data.index(name) + len(name) + 4 + 2 * 8 + 4  # after the name, n_dims, two dims and the type
    data[at : at + 8] = value.to_bytes(8, "little")
    path = tmp_path / "lie.gguf"
    path.write_bytes(bytes(data))
    tracemalloc.start()
    with pytest.raises(ValueError, match=message):
        GGUFFile(path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < (4 << 20)


def set_tensor_type(data: bytearray, name: str, qtype: Q) -> None:
    """Rewrite the ggml type of tensor ``name`` in the index of the GGUF bytes ``data`` (its offset left as it was)."""
    at = data.index(name.encode()) + len(name)  # after the name: n_dims (u32), the dims (u64 each), the type (u32)
    n_dims = int.from_bytes(data[at : at + 4], "little")
    at += 4 + 8 * n_dims
    data[at : at + 4] = int(qtype).to_bytes(4, "little")


@pytest.mark.parametrize(
    ("name", "qtype", "message"),
    [  # the q8 file: an F16 embedding, then F32 norms and Q8_0 matrices
        ("token_embd.weight", Q.F32, r"tensor 'output_norm\.weight' starts at data offset \d+, expected \d+, right "
         r"after tensor 'token_embd\.weight' \(F32, 12800 bytes and its padding\): they overlap"),
        ("blk.0.attn_q.weight", Q.Q4_0, r"tensor 'blk\.0\.attn_k\.weight' .* right after tensor "
         r"'blk\.0\.attn_q\.weight' \(Q4_0, 576 bytes and its padding\): a gap between them"),
        ("blk.1.ffn_down.weight", Q.F32, r"tensor 'blk\.1\.ffn_down\.weight' \(8192 bytes at data offset \d+\) runs "
         r"past the end of the file"),
    ],
)  # fmt: skip
def test_a_type_that_does_not_fit_the_offsets_names_the_tensor(tmp_path, name, qtype, message):
    """A tensor whose type was changed runs into the next one, leaves a gap before it, or runs past the end of the
    file: its size no longer matches the offsets (llama.cpp refuses such files too)."""
    data = bytearray(write_small(tmp_path / "m.gguf", "q8").read_bytes())
    set_tensor_type(data, name, qtype)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": truncated or malformed GGUF file: " + message):
        GGUFFile(path)


@pytest.mark.parametrize("fewer", [1, 2])
def test_a_tensor_count_short_of_the_index_is_refused(tmp_path, fewer):
    """A header counting fewer tensors than the file holds would read its data from the wrong start (the index
    shorter, so the data section begins earlier); the bytes left after the counted tensors show it."""
    data = bytearray(write_small(tmp_path / "m.gguf", "f32").read_bytes())
    count = int.from_bytes(data[8:16], "little")
    data[8:16] = (count - fewer).to_bytes(8, "little")
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"bytes follow the last tensor \('.+'\) of the {count - fewer} the header"):
        GGUFFile(path)


def test_files_the_gguf_package_writes_place_their_tensors_as_read(tmp_path):
    """The ``gguf`` package's offsets, every type in the small files: each tensor right after the one before."""
    for kind in ("f32", "q8", "q4"):
        path = write_small(tmp_path / f"{kind}.gguf", kind)
        ours, theirs = GGUFFile(path).tensors, gguf.GGUFReader(path).tensors
        assert [(t.name, t.offset, t.nbytes) for t in ours] == [(t.name, t.data_offset, t.n_bytes) for t in theirs]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a GGUF file: it starts with b''"),
        (b"GGUF", "the version needs 4 bytes"),
        (b"GGUF\x01\x00\x00\x00" + bytes(16), "GGUF version 1 is not supported"),
        (b"GGUF\x00\x00\x00\x03" + bytes(16), r"GGUF version 50331648 is not supported \(2 and 3 are\) \(a big-endian"),
        (b"GGUF\x03\x00\x00\x00" + bytes(8), "the metadata count needs 8 bytes"),
    ],
)
def test_headers_too_short_or_foreign(tmp_path, data, message):
    path = tmp_path / "h.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=message):
        GGUFFile(path)


@pytest.mark.parametrize("kind", ["f32", "q8", "q4"])
def test_weights_are_views_of_the_file(tmp_path, kind):
    from gqa.loaders.gguf_file import read_gguf

    g = GGUFFile(write_small(tmp_path / "m.gguf", kind))
    _, sd = read_gguf(g, keep_quantized=True)
    up = sd["model.layers.0.mlp.up_proj.weight"]
    up = up.blocks if kind != "f32" else up
    assert up.data_ptr() == g.data(g.tensor("blk.0.ffn_up.weight")).ctypes.data  # no copy: the mapped bytes
    norm = sd["model.layers.0.input_layernorm.weight"]
    assert norm.data_ptr() == g.data(g.tensor("blk.0.attn_norm.weight")).ctypes.data
