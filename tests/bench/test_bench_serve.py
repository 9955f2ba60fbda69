"""``gqa bench serve``: a real ``gqa serve`` (with a q8_0 KV pool) under 1 and 3 concurrent streaming clients,
responses compared with the 1-client pass, results written; the KV cache type on every server's command line; bad
flags are exit 2."""

from __future__ import annotations

import json

import pytest

from gqa import kernels
from gqa.bench import serve as bench_serve
from gqa.cli import main

pytestmark = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")


def test_the_cli_serves_the_embedded_model_to_concurrent_clients(tmp_path, capsys):
    """``--kv-cache-dtype q8_0`` reaches the server: its pool holds the token slots of 34-byte blocks in 64 MiB
    (SmolLM2: 30 layers, K and V of 3 KV heads of 64 values, 2 blocks each), 1.9x a bf16 pool's; a request served
    with two others is the one served alone."""
    code = main(["bench", "serve", "--engines", "gqa", "--clients", "1", "3", "--prompts", "3", "--max-tokens", "6",
                 "--kv-cache-mib", "64", "--kv-cache-dtype", "q8_0", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    result = json.loads((tmp_path / "results.json").read_text())
    (row,) = result["rows"]
    assert [x["clients"] for x in row["loads"]] == [1, 3]
    for x in row["loads"]:
        assert x["errors"] == [] and x["tokens"] == 3 * 6 and x["tok_s"] > 0 and x["differ_from_alone"] == 0
        assert 0 < x["ttft_p50_ms"] <= x["ttft_p99_ms"] and 0 < x["itl_p50_ms"] <= x["itl_p99_ms"]
    assert row["kv_blocks_used_after"] == 0 and row["preemptions"] == 0 and row["peak_rss_mib"] > 100
    q8_token = 2 * 30 * 3 * 2 * 34
    assert 64 * 2**20 // q8_token - 64 < row["kv_slots"] <= 64 * 2**20 // q8_token  # whole blocks of slots
    md = (tmp_path / "results.md").read_text()
    assert "| gqa | 3 |" in md and f"| gqa | q8_0 | {row['peak_rss_mib']:.0f} | {int(row['kv_slots'])} |" in md


def test_prompts_are_distinct_and_bad_flags_exit_2(tmp_path, capsys):
    assert len(set(bench_serve.prompts(48))) == 48
    for flags in (["--prompts", "0"], ["--clients", "0"], ["--max-tokens", "1"], ["--kv-max-tokens", "1"],
                  ["--speculate", "17"], ["--model", str(tmp_path / "x")],
                  ["--shape", "llama-3b", "--model", str(tmp_path)],  # one or the other
                  ["--shape", "llama-3b", "--model-dir", str(tmp_path), "--llama-cpp", str(tmp_path)]):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            main(["bench", "serve", *flags, "--out", str(tmp_path)])
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--kv-cache-dtype", "q5_0", "--out", str(tmp_path)])
    assert e.value.code == 2 and "argument --kv-cache-dtype: invalid choice: 'q5_0'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # before any row runs (the conversion refused it after the baseline rows)
        main(["bench", "serve", "--kv-heads", "3", "2", "0", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--kv-heads 2 0: each must divide the model's 9 query heads" in err
    assert not list(tmp_path.iterdir())  # nothing served, nothing written


def test_structured_loads_are_served_and_their_answers_validated(tmp_path, capsys):
    """``--structured``: a second gqa row whose answers are held to the JSON schema; every one validates (checked
    here by ``jsonschema`` as well as by the benchmark's own count)."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    code = main(["bench", "serve", "--engines", "gqa", "--clients", "2", "--prompts", "2", "--max-tokens", "64",
                 "--kv-cache-mib", "64", "--structured", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["tag"] for r in rows] == ["gqa", "gqa, json_schema"]
    assert rows[0]["loads"][0]["valid"] is None and rows[1]["loads"][0]["valid"] == 2
    assert "| gqa, json_schema | 2 |" in (tmp_path / "results.md").read_text()
    good = json.dumps({"topic": "bees", "answer": "They make honey."})
    jsonschema.validate(json.loads(good), bench_serve.SCHEMA)
    assert bench_serve.valid(good, bench_serve.SCHEMA)
    for bad in ('{"topic": "bees"}', '{"topic": "bees", "answer": 3}', "not json", json.dumps({"topic": "x" * 41,
                "answer": ""}), '{"topic": "a", "answer": "b", "extra": "c"}'):  # fmt: skip
        assert not bench_serve.valid(bad, bench_serve.SCHEMA), bad


def test_llama_server_needs_its_binary(tmp_path, capsys):
    """``--engines llama-server`` without ``--llama-server`` is skipped with a word; a path that is not an executable
    is exit 2; the command line is llama.cpp's (model, port, threads, one slot per client, 1024 tokens each)."""
    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--engines", "llama-server", "--llama-server", str(tmp_path / "nope"), "--out",
              str(tmp_path)])  # fmt: skip
    assert e.value.code == 2 and "not an executable file" in capsys.readouterr().err
    import argparse

    ns = argparse.Namespace(llama_server=tmp_path / "llama-server", clients=[1, 16], threads=2)
    argv = bench_serve.server_argv("llama-server", "m.gguf", ns, 8123, 64)
    assert argv[:3] == [str(tmp_path / "llama-server"), "-m", "m.gguf"]
    assert argv[argv.index("-np") + 1] == "16" and argv[argv.index("-c") + 1] == str(16 * 1024)
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("-t") + 1] == "2"


def test_speculate_row_counts_tokens_and_matches_the_plain_row(tmp_path, capsys):
    """``--speculate 7``: a second gqa row whose responses equal the plain row's (greedy verification is exact) and
    whose token count is the servers' usage (a chunk may carry several tokens), not its chunks."""
    code = main(["bench", "serve", "--engines", "gqa", "--clients", "1", "--prompts", "2", "--max-tokens", "24",
                 "--kv-cache-mib", "64", "--speculate", "7", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["tag"] for r in rows] == ["gqa", "gqa, --speculate 7"] and rows[1]["differ_from_plain"] == 0
    assert rows[0]["loads"][0]["tokens"] == rows[1]["loads"][0]["tokens"] and "texts" not in rows[0]


def test_every_server_runs_the_kv_cache_type(tmp_path):
    """``--kv-cache-dtype q8_0`` on each server's command line: gqa serve's flag; llama-cpp-python's server the ggml
    type id (8, as the ``gguf`` package numbers q8_0) with flash attention; llama-server ``-ctk/-ctv q8_0`` and ``-fa``
    as its ``--help`` says it takes it (``on`` since late 2025, a switch before). ``auto`` adds nothing."""
    import argparse

    gguf = pytest.importorskip("gguf")
    q8 = str(int(gguf.GGMLQuantizationType.Q8_0))
    ns = argparse.Namespace(clients=[1], threads=2, kv_cache_dtype="q8_0", llama_server=tmp_path / "llama-server")
    gqa_argv = bench_serve.server_argv("gqa", None, ns, 8123, 64)
    assert gqa_argv[gqa_argv.index("--kv-cache-dtype") + 1] == "q8_0"
    py_argv = bench_serve.server_argv("llama.cpp", "m.gguf", ns, 8123, 64)
    assert py_argv[-6:] == ["--type_k", q8, "--type_v", q8, "--flash_attn", "True"]
    for usage, flash in (("-fa, --flash-attn [on|off|auto]", ["-fa", "on"]), ("-fa, --flash-attn", ["-fa"])):
        ns.llama_server.write_text(f"#!/bin/sh\necho '{usage}'\n")
        ns.llama_server.chmod(0o755)
        argv = bench_serve.server_argv("llama-server", "m.gguf", ns, 8123, 64)
        assert argv[-4 - len(flash) :] == ["-ctk", "q8_0", "-ctv", "q8_0", *flash]
    ns.kv_cache_dtype = "auto"
    assert "--kv-cache-dtype" not in bench_serve.server_argv("gqa", None, ns, 8123, 64)
    assert "--type_k" not in bench_serve.server_argv("llama.cpp", "m.gguf", ns, 8123, 64)
    assert "-ctk" not in bench_serve.server_argv("llama-server", "m.gguf", ns, 8123, 64)


def test_replicas_and_the_shared_prefix_workload(tmp_path, capsys):
    """``--replicas 2 --routing prefix``: the replicas' row (their pools half the engine's, summed back to its token
    slots) answers as one engine, and the shared-prefix rows report a hit rate from the servers' metrics."""
    code = main(["bench", "serve", "--engines", "gqa", "--clients", "2", "--prompts", "4", "--max-tokens", "4",
                 "--kv-cache-mib", "64", "--replicas", "1", "2", "--routing", "prefix",
                 "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    rows = {r["tag"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    one, two = rows["gqa"], rows["gqa, --replicas 2"]
    assert two["differ_from_plain"] == 0 and abs(two["kv_slots"] - one["kv_slots"]) <= 2 * 16
    shared = [r for tag, r in rows.items() if tag.startswith("shared prefixes")]
    assert [r["tag"] for r in shared] == ["shared prefixes: one engine", "shared prefixes: 2 replicas, prefix routing"]
    for r in shared:
        assert 0 <= r["prefix_hit_rate"] <= 1 and r["differ_from_one_engine"] == 0 and r["loads"][0]["errors"] == []


def test_the_eager_row_serves_with_enforce_eager_and_the_cli_turns_graphs_off():
    """``gqa bench serve --eager``'s row starts ``gqa serve --enforce-eager``, which sets ``cuda_graphs=False``; by
    default the flag is absent and the engine config keeps CUDA graphs."""
    import argparse

    from gqa.cli import serve as serve_cli

    ns = argparse.Namespace(clients=[1], threads=2, device="cuda")
    assert "--enforce-eager" not in bench_serve.server_argv("gqa", None, ns, 8123, 64)
    ns.gqa_eager = True
    assert "--enforce-eager" in bench_serve.server_argv("gqa", None, ns, 8123, 64)
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    assert serve_cli.engine_config(parser.parse_args([])).cuda_graphs is True
    assert serve_cli.engine_config(parser.parse_args(["--enforce-eager"])).cuda_graphs is False


def test_server_line_reads_the_last_marked_line_of_a_rows_log(tmp_path):
    """What ``--tp``'s all-reduce share and the CUDA graphs' capture are read from: the server's own log lines."""
    captured = "gqa serve: CUDA graphs for decode batches of 1, 2 rows"
    (tmp_path / "gqa.log").write_text(f"gqa serve: loading\n{captured}\n")
    assert bench_serve.server_line(tmp_path, "gqa", "CUDA graphs") == captured
    assert bench_serve.server_line(tmp_path, "gqa", "all-reduces") == ""
    assert bench_serve.server_line(tmp_path, "gqa, --tp 2", "all-reduces") == ""  # no log: nothing, no error
