"""``gqa bench model``: the model as MHA, GQA and MQA (made by ``gqa.convert``), gqa and HF engines each in its own
process, JSON / markdown / PNG outputs, and clear errors for bad flags. Timings are not checked (see benchmarks/)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from helpers.checkpoints import tiny_dir

from gqa import kernels
from gqa.bench.model.benchmark import default_kv_heads
from gqa.bench.model.benchmark import main as bench_model
from gqa.bench.model.kv_caches import kv_bytes_per_token, kv_kind
from gqa.bench.model.report import kind
from gqa.cli import main as cli

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Llama, 8 query heads, 2 KV heads, head_dim 4, 2 layers, 64 positions."""
    return tiny_dir(tmp_path_factory.mktemp("bench-model") / "llama", "llama", 8, 2)


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """The same with head_dim 64: two 32-value blocks a row in a quantized KV cache."""
    return tiny_dir(tmp_path_factory.mktemp("bench-model") / "llama64", "llama", 8, 2, head_dim=64)


def test_default_head_counts_and_bytes():
    assert default_kv_heads(9, 3) == [9, 3, 1]
    assert default_kv_heads(8, 8) == [8, 1]
    assert default_kv_heads(4, 1) == [4, 1]
    assert kv_bytes_per_token(30, 3, 64, "fp32") == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(30, 1, 64, "bf16") == 2 * 30 * 64 * 2
    assert [kind(n, 9) for n in (9, 3, 1)] == ["MHA", "GQA", "MQA"]


def test_run_over_head_counts_writes_json_markdown_and_png(tiny, tmp_path, monkeypatch, capsys):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the converted models go, and must not stay
    out = tmp_path / "out"
    argv = ["--model", str(tiny), "--kv-heads", "8", "2", "1", "--contexts", "8", "20", "--new-tokens", "3",
            "--engines", "gqa", "hf", "--dtypes", "fp32", "--json", str(out / "m.json"),
            "--markdown", str(out / "m.md"), "--plot", str(out / "m.png")]  # fmt: skip
    assert bench_model(argv) == 0
    assert list(scratch.iterdir()) == []
    payload = json.loads((out / "m.json").read_text())
    assert payload["args"]["kv_heads"] == [8, 2, 1] and payload["config"]["num_heads"] == 8
    results = payload["results"]
    assert [(r["kv_heads"], r["engine"]) for r in results] == [(n, e) for n in (8, 2, 1) for e in ("gqa", "hf")]
    for r in results:
        assert r["model_kv_heads"] == r["kv_heads"]  # each worker really ran the converted model
        assert r["kv_bytes_per_token"] == 2 * 2 * r["kv_heads"] * 4 * 4
        assert [row["context"] for row in r["rows"]] == [8, 20]
        assert all(row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 for row in r["rows"])
        assert 50 < r["peak_rss_mib"] < 8000
        assert r["native_kernels"] is kernels.available()  # the workers load what this process loads
    md = (out / "m.md").read_text()
    assert "MHA (8 KV)" in md and "GQA (2 KV)" in md and "MQA (1 KV)" in md and "1.00x" in md
    assert md.strip() in capsys.readouterr().out
    assert (out / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-heads", "3"], "3"),  # does not divide 8 query heads
        (["--kv-heads", "0"], "--kv-heads must be positive"),
        (["--new-tokens", "1"], "--new-tokens must be >= 2"),
        (["--contexts", "100"], "max_position_embeddings 64"),
        (["--engines", "hf-static-compile"], "runs with --device cuda"),
        (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
        (["--device", "cuda"], "--device cuda"),  # CPU machine: no CUDA; a GPU one: --model is a CPU option
        (["--kv-cache-dtypes", "q5_0"], "argument --kv-cache-dtypes: invalid choice: 'q5_0'"),
        (
            ["--kv-cache-dtypes", "auto", "q8_0"],
            "--kv-cache-dtypes q8_0: a q8_0 KV cache needs a head dim that is a multiple of 32, got 4",
        ),
        (["--kv-cache-dtypes", "q4_0", "--batch", "2"], "--kv-cache-dtypes q4_0: a q4_0 KV cache needs a head dim"),
        (["--kv-cache-dtypes", "q4_0", "--tp", "2"], "--kv-cache-dtypes q4_0: a q4_0 KV cache needs a head dim"),
        (["--kv-cache-dtypes", "q8_0", "--device", "cuda"], "--kv-cache-dtypes: --window-caches and --device cuda "),
    ],
)
def test_bad_flags_give_clear_errors(tiny, flags, message, capsys):
    try:
        code = cli(["bench", "model", "--model", str(tiny), "--engines", "gqa", *flags])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_decode_rate_is_robust_to_one_slow_token():
    from gqa.bench.model.worker import _row

    row = _row(16, prefill=0.5, stamps=[0.0, 0.1, 0.2, 1.0, 1.1])  # the third interval hit a burst of other work
    assert row["decode_tok_s"] == pytest.approx(10.0)
    assert row["decode_mean_tok_s"] == pytest.approx(4 / 1.1)
    assert row["prefill_tok_s"] == pytest.approx(32.0)


def test_throughput_mode_runs_each_batch_and_the_budget_batch(tiny, tmp_path, capsys):
    out = tmp_path / "t.json"
    budget = 2 * 2 * 2 * 4 * 4 * (8 + 3) * 5 / 2**30  # exactly 5 sequences of 8 + 3 tokens at 2 KV heads (fp32)
    argv = ["--model", str(tiny), "--kv-heads", "2", "1", "--contexts", "8", "--new-tokens", "3", "--dtypes", "fp32",
            "--batch", "1", "2", "--kv-budget", str(budget), "--json", str(out)]  # fmt: skip
    assert bench_model(argv) == 0
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "model-throughput"
    by_heads = {r["kv_heads"]: r for r in payload["results"]}
    assert by_heads[2]["budget_batch"] == 5 and by_heads[1]["budget_batch"] == 10  # one KV head: twice the batch
    assert [row["batch"] for row in by_heads[2]["rows"]] == [1, 2, 5]
    for r in payload["results"]:
        for row in r["rows"]:
            assert row["decode_tok_s"] > 0 and row["fits_budget"] == (row["batch"] == r["budget_batch"])
            assert row["kv_cache_bytes"] == r["kv_bytes_per_token"] * row["batch"] * (8 + 3)
    text = capsys.readouterr().out
    assert "| 5 (largest in " in text and "MQA (1 KV)" in text and "x MHA's" not in text  # no 8-head run to compare


def test_llama_cpp_is_skipped_with_a_reason_for_a_float_model(tiny, capsys):
    argv = ["--model", str(tiny), "--kv-heads", "2", "--contexts", "8", "--new-tokens", "2", "--dtypes", "fp32",
            "--engines", "gqa", "llama.cpp"]  # fmt: skip
    assert bench_model(argv) == 0
    captured = capsys.readouterr()
    assert "skipping llama.cpp: the model is no quantized GGUF" in captured.err
    assert "| gqa |" in captured.out and "llama.cpp |" not in captured.out


def test_greedy_agreement_and_bandwidth_fraction_in_the_table():
    from gqa.bench.model.report import agreement, table

    base = {"kv_heads": 3, "kv_bytes_per_token": 10, "peak_rss_mib": 100, "dtype": "q4_1"}
    row = {"context": 4, "prefill_tok_s": 10.0, "decode_tok_s": 50.0, "weight_bytes": 10**8, "kv_bytes": 0}
    ours = base | {"engine": "gqa", "rows": [row], "greedy": [[1, 2, 3], [4, 5, 6], [7, 8]]}
    theirs = base | {
        "engine": "llama.cpp",
        "rows": [row | {"decode_tok_s": 25.0}],
        "greedy": [[1, 2, 3], [4, 9, 6], [7, 8]],
    }
    text = agreement([ours, theirs])
    assert "2 of 3 chat prompts identical" in text and "matching prefix 2.0 tokens on average" in text  # 3, 1, 2
    payload = {"results": [ours, theirs], "args": {"contexts": [4]}, "config": {"num_heads": 9}, "read_gbps": 10.0}
    md = table(payload)
    assert "| 2.00x vs llama.cpp | - | 50% |" in md  # 1e8 bytes x 50 tok/s = 5 GB/s of 10 (float KV: no "vs float")
    # with a q8_0 cache each: compared with llama.cpp's q8_0 run and with gqa's own float cache, greedy pair by pair
    q8 = {"kv_cache_dtype": "q8_0", "kv_dtype": "q8_0"}
    ours_q8 = ours | q8 | {"rows": [row | {"decode_tok_s": 60.0}], "greedy": [[1, 2, 3], [4, 5, 6], [7, 9]]}
    theirs_q8 = theirs | q8 | {"rows": [row | {"decode_tok_s": 20.0}]}
    payload["results"] += [ours_q8, theirs_q8]
    md = table(payload)
    assert "| q4_1 | q8_0 | GQA (3 KV) | 4 | 0.0 | gqa | 10 | 60.0 | 3.00x vs llama.cpp | 1.20x |" in md
    assert "| q4_1 | q8_0 | GQA (3 KV) | 4 | 0.0 | llama.cpp | 10 | 20.0 | 1.00x vs llama.cpp | 0.80x |" in md
    assert "gqa q4_1 vs llama.cpp on the same file: 2 of 3" in md
    assert "gqa q4_1, q8_0 KV cache vs llama.cpp on the same file: 1 of 3" in md


def test_window_caches_mode_compares_window_and_full_caches(tmp_path, capsys):
    """``--window-caches``: each context decoded over window-sized and full caches by the step generate takes; the
    window caches hold their 512-key windows only (counted from the model's layers here), the tokens agree."""
    out = tmp_path / "w.json"
    argv = ["--window-caches", "--contexts", "800", "40", "--new-tokens", "3", "--repeats", "1", "--json", str(out)]
    assert bench_model(argv) == 0
    payload = json.loads(out.read_text())
    rows = payload["results"]
    assert [(r["context"], r["window_caches"]) for r in rows] == [(800, True), (800, False), (40, True), (40, False)]
    slot = 2 * 256 * 4  # K and V of one token in one layer: 1 KV head of dim 256, fp32
    assert rows[1]["kv_bytes"] == 26 * 803 * slot
    assert rows[0]["kv_bytes"] == (22 * (512 + 256) + 4 * 803) * slot  # 22 sliding layers: 512 keys + 256 spare
    assert rows[2]["kv_bytes"] == rows[3]["kv_bytes"] == 26 * 43 * slot  # shorter than the window: no saving
    assert all(r["decode_tok_s"] > 0 and r["step"] == ("native" if kernels.vectorized() else "eager") for r in rows)
    text = capsys.readouterr().out
    assert "| 800 | window-sized on sliding layers |" in text and "One 32,768-token sequence" in text


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--batch", "2"], "--window-caches runs its own model"),
        (["--repeats", "0"], "--repeats >= 1"),
        (["--dtypes", "q4_1"], "one float dtype"),
        (["--device", "cuda"], "runs on the CPU at batch 1"),
        (["--tp", "2"], "runs on the CPU at batch 1"),
    ],
)
def test_window_caches_mode_refuses_what_it_does_not_run(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli(["bench", "model", "--window-caches", "--contexts", "16", *flags])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_kv_cache_dtypes_run_side_by_side_with_the_bytes_their_caches_hold(tiny64, tmp_path, capsys):
    """``--kv-cache-dtypes auto q8_0 q4_0 bf16``: gqa runs a float cache and each block type (the worker counts the
    bytes a token takes in the caches it decoded with: a row of 64 values is two blocks, 2 x 34 bytes in q8_0 and
    2 x 18 in q4_0, against bf16's 128), HF the float cache only, the skips said in the report; ``bf16`` is ``auto``'s
    cache here and runs once."""
    out = tmp_path / "kv.json"
    argv = ["--model", str(tiny64), "--kv-heads", "2", "--contexts", "8", "--new-tokens", "2", "--engines", "gqa",
            "hf", "--dtypes", "bf16", "--kv-cache-dtypes", "auto", "q8_0", "q4_0", "bf16",
            "--json", str(out)]  # fmt: skip
    assert bench_model(argv) == 0
    payload = json.loads(out.read_text())
    results = payload["results"]
    assert [(r["engine"], r["kv_cache_dtype"], r["kv_dtype"]) for r in results] == [
        ("gqa", "auto", "bf16"), ("gqa", "q8_0", "q8_0"), ("gqa", "q4_0", "q4_0"), ("hf", "auto", "bf16")
    ]  # fmt: skip
    per_token = {r["kv_dtype"]: r["kv_bytes_per_token"] for r in results if r["engine"] == "gqa"}
    assert per_token["bf16"] == 2 * 2 * 2 * 64 * 2 == kv_bytes_per_token(2, 2, 64, "bf16")  # K+V, 2 layers, 2 heads
    assert per_token["q8_0"] * 64 == per_token["bf16"] * 34 and per_token["q4_0"] * 64 == per_token["bf16"] * 18
    assert per_token["q8_0"] == kv_bytes_per_token(2, 2, 64, "bf16", "q8_0")
    for r in results[:3]:
        assert r["rows"][0]["kv_bytes"] == r["kv_bytes_per_token"] * 8  # the cache read at the context
    why = "transformers' caches are float here (its QuantizedCache needs quanto/HQQ, other formats)"
    assert payload["skipped"] == [f"hf bf16 with a {kv} KV cache: {why}" for kv in ("q8_0", "q4_0")]
    text = capsys.readouterr().out
    assert "| bf16 | q8_0 | GQA (2 KV) | 8 | 0.0 | gqa |" in text and "| bf16 | q4_0 | GQA (2 KV) | 8 |" in text
    assert "Not run: hf bf16 with a q8_0 KV cache" in text


def test_throughput_budget_holds_more_sequences_with_a_q8_0_cache(tiny64, tmp_path, capsys):
    """``--batch`` with ``--kv-cache-dtypes auto q8_0``: the caches (filled with random blocks) hold 68 bytes a row
    against float32's 256, so the budget that holds 5 float sequences holds 18 of q8_0."""
    out = tmp_path / "t.json"
    budget = 2 * 2 * 2 * 64 * 4 * (8 + 2) * 5 / 2**30  # exactly 5 sequences of 8 + 2 tokens (fp32)
    argv = ["--model", str(tiny64), "--kv-heads", "2", "--contexts", "8", "--new-tokens", "2", "--dtypes", "fp32",
            "--kv-cache-dtypes", "auto", "q8_0", "--batch", "1", "--kv-budget", str(budget),
            "--json", str(out)]  # fmt: skip
    assert bench_model(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["kv_dtype"], r["budget_batch"]) for r in results] == [("fp32", 5), ("q8_0", 18)]
    for r in results:
        for row in r["rows"]:
            assert row["decode_tok_s"] > 0 and row["kv_cache_bytes"] == r["kv_bytes_per_token"] * row["batch"] * 10
    assert "| fp32 | q8_0 | GQA (2 KV) | 8 | 18 (largest in " in capsys.readouterr().out


FAKE_LLAMA_CPP = '''
import json, os


class Llama:
    """llama-cpp-python's ``Llama`` as far as the benchmark worker calls it: it writes down its arguments."""

    def __init__(self, model_path, **kwargs):
        with open(os.environ["FAKE_LLAMA_LOG"], "a") as f:
            f.write(json.dumps(kwargs) + "\\n")
        self.metadata = {"general.architecture": "llama", "llama.attention.head_count_kv": "3"}

    def n_vocab(self):
        return 49152

    def eval(self, ids):
        pass

    def reset(self):
        pass

    def token_eos(self):
        return 2

    def generate(self, ids, **kwargs):
        while True:
            yield 7
'''


def test_llama_cpp_runs_with_the_same_kv_cache_type(tmp_path, monkeypatch):
    """The llama.cpp worker with ``--kv-cache-dtype q8_0``: ``Llama(type_k=8, type_v=8, flash_attn=True)`` (ggml's
    q8_0, as the ``gguf`` package numbers it; a quantized V needs its flash attention), with ``auto`` none of them
    (its own f16 cache); a stand-in ``llama_cpp`` module records the arguments. The benchmark counts llama.cpp's
    bytes as those types'."""
    import subprocess
    import sys

    gguf = pytest.importorskip("gguf")
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "__init__.py").write_text(FAKE_LLAMA_CPP)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
                        "FAKE_LLAMA_LOG": str(tmp_path / "calls.jsonl")}  # fmt: skip
    for kv in ("auto", "q8_0"):
        argv = [sys.executable, "-m", "gqa.bench.model.worker", "llama.cpp", "--dtype", "q4_1", "--kv-cache-dtype", kv,
                "--contexts", "8", "--new-tokens", "2", "--greedy"]  # fmt: skip
        result = json.loads(subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout)
        assert result["kv_cache_dtype"] == kv and result["greedy"] == [[7] * 32] * 6
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    q8 = int(gguf.GGMLQuantizationType.Q8_0)
    assert [{k: c.get(k) for k in ("type_k", "type_v", "flash_attn")} for c in calls] == [
        {"type_k": None, "type_v": None, "flash_attn": None}, {"type_k": q8, "type_v": q8, "flash_attn": True}
    ]  # fmt: skip
    assert [kv_kind("llama.cpp", "q4_1", kv).name for kv in ("auto", "q8_0", "q4_0")] == ["fp16", "q8_0", "q4_0"]
