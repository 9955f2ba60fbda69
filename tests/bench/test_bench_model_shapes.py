"""``gqa bench model --shapes llama-*`` on the CPU: the random files written tensor by tensor and cached, the
llama.cpp tools called as they should be (stand-ins that log their arguments, so that no llama.cpp is needed), and the
table a tiny run gives. Timings are not checked."""

from __future__ import annotations

import json
import os
import stat
import sys
import tracemalloc

import gguf
import numpy as np
import pytest
import torch

from gqa.bench.model import random_files, shapes
from gqa.bench.model.benchmark import main as bench_model
from gqa.bench.model.processes import cached_bytes, drop_page_cache, timed_process
from gqa.bench.model.random_files import LLAMA_SHAPES, LlamaShape, model_file, write_random_f16

TINY = LLAMA_SHAPES["tiny"]

FAKE_QUANTIZE = """
import json, os, shutil, sys
with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
    f.write(json.dumps(["llama-quantize", *sys.argv[1:]]) + "\\n")
shutil.copy(sys.argv[1], sys.argv[2])  # the F16 file stands in for the Q4_K_M one
"""

FAKE_BENCH = """
import json, os, sys
with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
    f.write(json.dumps(["llama-bench", *sys.argv[1:]]) + "\\n")
argv = [a for a in sys.argv[1:] if a != "--no-warmup"]
args = dict(zip(argv[::2], argv[1::2]))
rows = []
for repack in map(int, args["--repack"].split(",")):
    for p in map(int, args["-p"].split(",")):
        rows.append({"n_prompt": p, "n_gen": 0, "repack": bool(repack), "avg_ts": 1000.0 + p + 100 * repack})
    if int(args["-n"]):
        rows.append({"n_prompt": 0, "n_gen": int(args["-n"]), "repack": bool(repack), "avg_ts": 50.0 - repack})
print(json.dumps(rows))
"""


def _tool(folder, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _flags(call: list[str]) -> dict[str, str]:
    """A logged llama-bench call's ``-flag value`` pairs."""
    argv = [a for a in call[1:] if a != "--no-warmup"]
    return dict(zip(argv[::2], argv[1::2], strict=True))


@pytest.fixture
def fake_llama(tmp_path, monkeypatch):
    """A folder of stand-in ``llama-quantize`` / ``llama-bench`` and the log of their calls."""
    folder = tmp_path / "llama-bin"
    folder.mkdir()
    _tool(folder, "llama-quantize", FAKE_QUANTIZE)
    _tool(folder, "llama-bench", FAKE_BENCH)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    return folder, log


def test_the_f16_file_holds_every_tensor_and_is_written_one_tensor_at_a_time(tmp_path):
    """Every tensor of ``LlamaShape.tensors()`` with its shape (F16 matrices, F32 norms) as ``gguf`` reads it, and
    the writer's peak allocation well under the model's size: the weights are never all in memory."""
    deep = LlamaShape("deep", 256, 8, 4, 2, 512, 512)  # 10 MB of weights, no tensor over 0.3 MB
    tracemalloc.start()
    path = write_random_f16(tmp_path / "m.F16.gguf", deep)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    reader = gguf.GGUFReader(path)
    got = {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name) for t in reader.tensors}
    want = {name: (dims, "F32" if len(dims) == 1 else "F16") for name, dims in deep.tensors()}
    assert got == want
    total = sum(int(t.n_bytes) for t in reader.tensors)
    biggest = max(int(t.n_bytes) for t in reader.tensors)
    assert peak < total / 4 and peak < 10 * biggest, (peak, total, biggest)
    data = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight").data.astype(np.float32)
    assert 0.015 < data.std() < 0.025  # N(0, 0.02)


def test_a_file_is_made_once_by_the_quantizer_then_taken_from_the_cache(tmp_path, fake_llama):
    folder, log = fake_llama
    tool = folder / "llama-quantize"
    first = model_file("tiny", tmp_path / "models", tool, threads=3)
    again = model_file("tiny", tmp_path / "models", tool, threads=3)
    assert first == again == tmp_path / "models" / "random-tiny.Q4_K_M.gguf" and first.exists()
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert call[0] == "llama-quantize" and call[2] == str(first) + ".part" and call[3:] == ["Q4_K_M", "3"]
    assert os.listdir(tmp_path / "models") == [first.name]  # the F16 file is gone
    with pytest.raises(FileNotFoundError, match="llama-quantize"):
        model_file("llama-8b", tmp_path / "models", None)


def test_a_file_for_servers_takes_the_embedded_models_tokenizer_and_chat_template(tmp_path, fake_llama, monkeypatch):
    """``tokenizer=``: every ``tokenizer.*`` key of SmolLM2's file copied (its 49,152 tokens, merges, ChatML
    template), the embeddings and output sized to that vocabulary, and gqa loads it with a tokenizer that encodes
    text and renders chats as SmolLM2's does; named ``-chat`` in the cache."""
    from gqa import load_model
    from gqa.loaders import default_model_path, load_tokenizer

    small = LlamaShape("small", 64, 1, 2, 1, 128, 512)  # its 49,152-row embeddings and output: 6 MiB each in F16
    monkeypatch.setitem(random_files.LLAMA_SHAPES, "tiny", small)
    source = {key: value for key, value, _, _ in random_files.tokenizer_fields(default_model_path())}
    path = write_random_f16(tmp_path / "chat.F16.gguf", small, tokenizer=default_model_path())
    reader = gguf.GGUFReader(path)  # (each read of a 49k-token vocabulary: ~2 s)
    assert len(source) > 5 and sorted(k for k in reader.fields if k.startswith("tokenizer.")) == sorted(source)
    for key, value in source.items():
        assert reader.fields[key].contents() == value, key
    vocab = len(source["tokenizer.ggml.tokens"])
    dims = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    assert vocab == 49152 and dims["token_embd.weight"] == dims["output.weight"] == (vocab, small.hidden)
    ours, smol = load_model(path).tokenizer, load_tokenizer(default_model_path())
    text = "Grouped-query attention shares K/V across heads."
    assert ours.encode(text) == smol.encode(text) and len(ours.encode(text)) > 5
    chat = [{"role": "user", "content": "hi"}]
    assert ours.render_chat(chat) == smol.render_chat(chat) and "<|im_start|>user" in ours.render_chat(chat)
    made = model_file("tiny", tmp_path / "models", fake_llama[0] / "llama-quantize", tokenizer=default_model_path())
    assert made.name == "random-tiny-chat.Q4_K_M.gguf" and os.listdir(tmp_path / "models") == [made.name]
    with pytest.raises(ValueError, match=r"no tokenizer\.ggml\.tokens"):
        write_random_f16(tmp_path / "x.gguf", TINY, tokenizer=_no_vocab(tmp_path))


def _no_vocab(tmp_path):
    """A GGUF file with no tokenizer keys."""
    w = gguf.GGUFWriter(str(tmp_path / "empty.gguf"), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return tmp_path / "empty.gguf"


def test_page_cache_drop_and_a_process_peak_of_its_own(tmp_path):
    path = write_random_f16(tmp_path / "m.gguf", TINY)
    path.read_bytes()
    drop_page_cache(path)
    left = cached_bytes(path)
    assert left is None or left < path.stat().st_size // 2
    big = timed_process([sys.executable, "-c", "b = bytearray(200 * 2**20); print('x')"])
    small = timed_process([sys.executable, "-c", "print('y')"])
    assert big["stdout"] == "x\n" and big["peak_rss_mib"] > 200 and small["peak_rss_mib"] < 100
    with pytest.raises(RuntimeError, match="exited 3"):
        timed_process([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_a_tiny_shape_runs_end_to_end_beside_llama_bench(tmp_path, fake_llama, monkeypatch, capsys):
    """The CLI with ``--shapes llama-1b`` (its shape made tiny here): the file made and run by gqa's worker, the
    stand-in llama-bench asked for every context with ``--repack 0,1`` and the same threads, the faster kept per row,
    load to first token cold and warm, and every row in the table and the JSON."""
    folder, log = fake_llama
    monkeypatch.setitem(random_files.LLAMA_SHAPES, "llama-1b", TINY)
    monkeypatch.setattr(shapes, "_OVERHEAD", "pass")  # import torch's memory is not what is tested: its seconds
    out = tmp_path / "r.json"
    argv = ["--shapes", "llama-1b", "--model-dir", str(tmp_path / "models"), "--llama-cpp", str(folder), "--contexts",
            "8", "16", "--new-tokens", "3", "--repeats", "2", "--json", str(out)]  # fmt: skip
    assert bench_model(argv) == 0
    text = capsys.readouterr().out
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c[0] for c in calls] == ["llama-quantize", "llama-bench", "llama-bench", "llama-bench"]
    main_run = _flags(calls[1])
    assert main_run["-p"] == "8,16" and main_run["-n"] == "3" and main_run["-r"] == "2"
    assert main_run["--repack"] == "0,1" and main_run["-t"] == str(torch.get_num_threads())
    assert [_flags(c)["-p"] for c in calls[2:]] == ["16", "16"]  # cold, warm first token
    result = json.loads(out.read_text())["results"][0]
    assert result["llama.cpp"]["prefill"]["16"] == {"all": {"0": 1016.0, "1": 1116.0}, "tok_s": 1116.0, "repack": 1}
    assert result["llama.cpp"]["decode"]["repack"] == 0
    assert [r["context"] for r in result["gqa"]["rows"]] == [8, 16]
    assert set(result["first_token"]["gqa"]) == {"cold", "warm"}
    rows = ("decode tok/s", "prompt processing 8 tok/s", "prompt processing 16 tok/s", "peak RSS MiB",
            "load to first token, warm page cache", "load to first token, cold page cache")  # fmt: skip
    for row in rows:
        assert row in text, row
    assert "1116.00 (repack 1)" in text


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--shapes", "smollm2"], "smollm2 is the default --model"),
        (["--shapes", "llama-3b", "--model", "x.gguf"], "no --model"),
        (["--shapes", "llama-3b", "--repeats", "0"], "--repeats >= 1"),
    ],
)
def test_shapes_flags_are_checked(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_model(flags)
    assert message in capsys.readouterr().err
