"""``gqa bench model``: the model as MHA, GQA and MQA (made by ``gqa.convert``), gqa and HF engines each in its own
process, JSON / markdown / PNG outputs, and clear errors for bad flags. Timings are not checked (see benchmarks/)."""

from __future__ import annotations

import json
import tempfile

import pytest
from helpers.checkpoints import tiny_dir

from gqa import kernels
from gqa.bench.model.benchmark import default_kv_heads, kv_bytes_per_token
from gqa.bench.model.benchmark import main as bench_model
from gqa.bench.model.report import kind
from gqa.cli import main as cli

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Llama, 8 query heads, 2 KV heads, head_dim 4, 2 layers, 64 positions."""
    return tiny_dir(tmp_path_factory.mktemp("bench-model") / "llama", "llama", 8, 2)


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
    assert "2 of 3 chat prompts identical" in text and "matching prefix 2.0 tokens on average"  # 3, 1, 2 in text
    payload = {"results": [ours, theirs], "args": {"contexts": [4]}, "config": {"num_heads": 9}, "read_gbps": 10.0}
    md = table(payload)
    assert "| 2.00x vs llama.cpp | 50% |" in md  # 1e8 bytes x 50 tok/s = 5 GB/s of 10


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
