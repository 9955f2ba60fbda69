"""Serving benchmark: OpenAI-compatible servers under concurrent streaming clients on localhost.

Each engine is started as a server process on a free port (``gqa serve``; llama-cpp-python's ``llama_cpp.server`` on
the same GGUF and threads when it is installed; llama.cpp's own ``llama-server`` with ``--llama-server PATH``), then
``--prompts`` chat prompts are sent by 1, 4, 16 and 64 concurrent clients (``--clients``), each request streamed with
``--max-tokens`` greedy tokens. Per load: output tok/s
(completion tokens over the wall time of the load), time to first token and inter-token latency (p50, p99), and the
server's peak resident memory. Every response under load is compared with the same request served alone (the
1-client pass): batching must change nothing. ``--kv-heads 9 3 1`` also serves the model converted to those KV head
counts (``gqa convert --method mean``, written once under ``--out``) under one KV budget (``--kv-budget-mib``): the
concurrent ``--kv-context``-token sequences that fit, and the throughput at the largest client count with responses
of ``--kv-max-tokens`` tokens (the preemptions the pool forced are counted). ``--structured`` serves the same loads
again with a JSON schema as ``response_format`` (xgrammar's masks in every step): the throughput it costs, and how many
answers parse and validate. ``--kv-cache-dtype q8_0`` (or ``q4_0``) runs every server with that KV cache: gqa serve's
pool stores the blocks (more token slots in the same ``--kv-cache-mib``), llama.cpp's servers the same type
(``-ctk`` / ``-ctv`` with flash attention, ``bench.llama_cpp_kv``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from ..options.common import KV_CACHE_DTYPES
from .llama_cpp_kv import cache_kind
from .serve_clients import TOPICS, ServerProcess, free_port, load, prompts, server_argv, stream_chat, valid

__all__ = ["SCHEMA", "TOPICS", "add_arguments", "prompts", "run", "server_argv", "stream_chat", "valid"]

HELP = "OpenAI-compatible servers under 1-64 concurrent streaming clients: tok/s, TTFT, ITL, memory"
DESCRIPTION = __doc__.split("\n\n")[1].replace("\n", " ")
ENGINES = ("gqa", "llama.cpp", "llama-server")
# --structured: each answer as {"topic": ..., "answer": ...}, bounded so that it ends within --max-tokens 64
SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 40}, "answer": {"type": "string", "maxLength": 100}},
    "required": ["topic", "answer"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file or HF folder (default: embedded SmolLM2)")
    parser.add_argument(
        "--shape", choices=("llama-1b", "llama-3b", "llama-8b"), default=None,
        help="instead of --model: a random Llama-shaped Q4_K_M file (gqa bench model --shapes) with the embedded "
        "SmolLM2's tokenizer and chat template, made once in --model-dir by llama.cpp's llama-quantize",
    )  # fmt: skip
    parser.add_argument("--model-dir", type=Path, default=None, metavar="DIR",
                        help="--shape: where the file is made and kept (default: gqa bench model's)")  # fmt: skip
    parser.add_argument("--llama-cpp", type=Path, default=None, metavar="DIR",
                        help="--shape: the folder of llama-quantize (default: found on PATH)")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="gqa serve's --device: cpu, or cuda (the Triton runner)")
    parser.add_argument(
        "--engines", nargs="+", choices=ENGINES, default=list(ENGINES),
        help="gqa serve, llama-cpp-python's server (skipped when llama_cpp.server is missing) and llama.cpp's "
        "llama-server (skipped without --llama-server) on the same file",
    )  # fmt: skip
    parser.add_argument(
        "--llama-server", type=Path, default=None, metavar="PATH",
        help="llama.cpp's llama-server binary (docs/performance.md says how to build it): run with --threads, as "
        "many parallel slots as the most --clients and 1024 tokens of context each",
    )  # fmt: skip
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64], metavar="N", help="concurrency")
    parser.add_argument("--prompts", type=int, default=48, help="requests per load")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per response")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads of each server")
    parser.add_argument("--kv-cache-mib", type=float, default=512, help="gqa serve's KV pool in the engine comparison")
    parser.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
        help="what every server's KV cache stores: gqa serve's --kv-cache-dtype (auto: the model's dtype), and the "
        "same type in llama.cpp's servers (-ctk/-ctv with flash attention; auto: their f16)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-heads", type=int, nargs="*", default=[], metavar="N",
        help="also serve the model converted to these KV head counts under --kv-budget-mib (e.g. 9 3 1)",
    )  # fmt: skip
    parser.add_argument("--kv-budget-mib", type=float, default=256, help="KV pool of the --kv-heads comparison")
    parser.add_argument("--kv-context", type=int, default=2048, help="context per sequence in that comparison")
    parser.add_argument(
        "--kv-max-tokens", type=int, nargs="+", default=None, metavar="N",
        help="greedy tokens per response in that comparison, one pass per value (default: --max-tokens; longer "
        "responses are where the budget binds)",
    )  # fmt: skip
    parser.add_argument("--eager", action="store_true",
                        help="--device cuda: one more gqa row served with --enforce-eager (every step eager) beside "
                        "the default CUDA-graph decode steps, its responses compared")  # fmt: skip
    parser.add_argument("--speculate", type=int, default=0, metavar="K",
                        help="also serve gqa's loads with gqa serve --speculate K (prompt-lookup drafts)")  # fmt: skip
    parser.add_argument("--tp", type=int, nargs="+", default=[1], metavar="N",
                        help="serve gqa's loads at each of these tensor-parallel sizes (gqa serve --tp N; one thread "
                        "per rank on 2 cores), responses compared with the first's")  # fmt: skip
    parser.add_argument("--replicas", type=int, nargs="+", default=[1], metavar="N",
                        help="serve gqa's loads at each of these replica counts too (gqa serve --replicas N, cores/N "
                        "threads each), responses compared with the first's")  # fmt: skip
    parser.add_argument(
        "--routing", nargs="*", default=None, choices=("prefix", "least-loaded", "round-robin"), metavar="POLICY",
        help="also run the shared-prefix workload (bench.replica_workload: 4 long system prompts, the largest "
        "--clients) on one engine and on --replicas' largest count with each of these routings (default: prefix "
        "round-robin): the prefix cache's hit rate and tok/s of each",
    )  # fmt: skip
    parser.add_argument("--structured", action="store_true",
                        help="also serve gqa's loads with a JSON schema as response_format")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench-serve"), help="folder for results.json and .md")


def bench_engine(
    engine: str, model_path: str | None, ns: argparse.Namespace, kv_mib: float, tag: str, schema: dict | None = None
) -> dict:
    port = free_port()
    ns.out.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(server_argv(engine, model_path, ns, port, kv_mib), port, ns.out / f"{tag}.log")
    kv = getattr(ns, "kv_cache_dtype", "auto")  # gqa's auto is the model's dtype, llama.cpp's f16
    row: dict = {"engine": engine, "tag": tag, "kv_cache": kv if engine == "gqa" else cache_kind(kv).name, "loads": []}
    try:
        texts = prompts(ns.prompts)
        stream_chat(port, server.model, texts[0], 4, schema)  # warm-up (and the grammar's compilation)
        alone = None  # the 1-client pass: each request served alone
        for clients in ns.clients:
            result = load(port, server.model, texts, clients, ns.max_tokens, schema)
            if clients == 1:
                alone = result["texts"]
            result["differ_from_alone"] = None
            if alone is not None:
                result["differ_from_alone"] = sum(a != b for a, b in zip(alone, result["texts"], strict=True))
            summary = f"{result['tok_s']:.1f} tok/s, TTFT p99 {result['ttft_p99_ms']:.0f} ms"
            if schema is not None:
                summary += f", {result['valid']}/{len(texts)} valid"
            print(f"[bench serve] {tag}: {clients} clients {summary}, differ from alone: {result['differ_from_alone']}",
                  file=sys.stderr, flush=True)  # fmt: skip
            row.setdefault("texts", result["texts"])  # the first load's, to compare rows (dropped before writing)
            del result["texts"]
            row["loads"].append(result)
        row["peak_rss_mib"] = server.peak_rss_mib()
        if engine == "gqa":
            m = server.metrics()
            row["kv_blocks_used_after"] = m["gqa_kv_blocks_used"]
            row["preemptions"] = m["gqa_preemptions_total"]
            row["kv_slots"] = (m["gqa_kv_blocks_free"] + m["gqa_kv_blocks_used"]) * m["gqa_kv_block_size"]
    finally:
        server.stop()
    return row


def shaped_model(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> str:
    """``--shape``'s file: made (or taken from ``--model-dir``) with the embedded model's tokenizer."""
    from ..loaders import default_model_path
    from .model.random_files import find_llama_tool, model_file
    from .model.shapes import default_model_dir

    if ns.model is not None:
        parser.error("--model and --shape exclude each other")
    tool = find_llama_tool("llama-quantize", ns.llama_cpp)
    try:
        path = model_file(ns.shape, ns.model_dir or default_model_dir(), tool, threads=ns.threads,
                          tokenizer=default_model_path())  # fmt: skip
    except FileNotFoundError as e:
        parser.error(f"--shape {ns.shape}: {e}")
    return str(path)


def server_line(out: Path, tag: str, marker: str) -> str:
    """The last line of row ``tag``'s server log (``out / f"{tag}.log"``) that holds ``marker``, or ``""``."""
    path = out / f"{tag}.log"
    lines = [ln for ln in path.read_text().splitlines() if marker in ln] if path.is_file() else []
    return lines[-1] if lines else ""


def differ_from_plain(rows: list[dict], row: dict) -> dict:
    """``row`` with ``differ_from_plain``: how many of its responses differ from the plain ``gqa`` row's."""
    plain = next(r for r in rows if r["tag"] == "gqa")
    row["differ_from_plain"] = sum(a != b for a, b in zip(plain["texts"], row["texts"], strict=True))
    return row


def converted(model_path: str | None, kv_heads: int, out: Path) -> str:
    """The model as ``kv_heads`` KV heads (``gqa convert --method mean``), written once under ``out``."""
    dst = out / f"kv{kv_heads}"
    if not (dst / "config.json").is_file():
        argv = [sys.executable, "-m", "gqa", "convert", *([model_path] if model_path else []), str(dst), "--kv-heads",
                str(kv_heads), "--method", "mean", "--no-conversations", "--force"]  # fmt: skip
        subprocess.run(argv, check=True)
    return str(dst)


def table(rows: list[dict]) -> str:
    head = ("| server | clients | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | differ from alone | errors "
            "| valid JSON |")  # fmt: skip
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        for x in r["loads"]:
            differ = "—" if x["differ_from_alone"] is None else x["differ_from_alone"]
            valid_json = "—" if x.get("valid") is None else x["valid"]
            lines.append(
                f"| {r['tag']} | {x['clients']} | {x['tok_s']:.1f} | {x['ttft_p50_ms']:.0f} / {x['ttft_p99_ms']:.0f} | "
                f"{x['itl_p50_ms']:.0f} / {x['itl_p99_ms']:.0f} | {differ} | {len(x['errors'])} | {valid_json} |"
            )
    lines.append("")
    lines.append("| server | KV cache | peak RSS (MiB) | KV token slots | sequences of the context that fit | "
                 "preemptions | blocks used after |")  # fmt: skip
    lines.append("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        slots = r.get("kv_slots")
        fit = f"{int(slots // r['context'])}" if slots and r.get("context") else "—"
        lines.append(f"| {r['tag']} | {r.get('kv_cache', 'auto')} | {r['peak_rss_mib']:.0f} | "
                     f"{int(slots) if slots else '—'} | {fit} | "
                     f"{int(r['preemptions']) if 'preemptions' in r else '—'} | "
                     f"{int(r['kv_blocks_used_after']) if 'kv_blocks_used_after' in r else '—'} |")  # fmt: skip
    return "\n".join(lines)


def run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from . import write_results

    if ns.prompts < 1 or ns.max_tokens < 2 or min(ns.clients) < 1 or ns.threads < 1:
        parser.error("--prompts and --clients must be >= 1, --max-tokens >= 2, --threads >= 1")
    if not 0 <= ns.speculate <= 16:
        parser.error(f"--speculate must be in [0, 16], got {ns.speculate}")
    if ns.kv_max_tokens is not None and min(ns.kv_max_tokens) < 2:
        parser.error("--kv-max-tokens must be >= 2")
    if ns.model is not None and not Path(ns.model).exists():
        parser.error(f"--model {ns.model}: no such file or folder (a .gguf file or an HF folder)")
    if ns.shape is not None:
        ns.model = shaped_model(parser, ns)
    if ns.kv_heads:  # checked before any row runs (gqa convert would refuse it after the baseline rows)
        from ..loaders import read_config

        heads = read_config(ns.model).num_heads
        bad = [k for k in ns.kv_heads if not (1 <= k <= heads and heads % k == 0)]
        if bad:
            parser.error(f"--kv-heads {' '.join(map(str, bad))}: each must divide the model's {heads} query heads")
    engines = list(dict.fromkeys(ns.engines))
    if "llama-server" in engines and ns.llama_server is None:
        print("[bench serve] skipping llama-server: no --llama-server PATH", file=sys.stderr)
        engines.remove("llama-server")
    elif "llama-server" in engines and not os.access(ns.llama_server, os.X_OK):
        parser.error(f"--llama-server {ns.llama_server}: not an executable file")
    if "llama.cpp" in engines:
        try:
            import llama_cpp.server.app  # noqa: F401
        except ImportError:
            print("[bench serve] skipping llama.cpp: llama_cpp.server is not installed", file=sys.stderr)
            engines.remove("llama.cpp")
    os.environ["OMP_NUM_THREADS"] = str(ns.threads)
    rows = [bench_engine(e, ns.model, ns, ns.kv_cache_mib, e) for e in engines]
    for tp in [t for t in dict.fromkeys(ns.tp) if t != 1] if "gqa" in engines else []:
        sharded = argparse.Namespace(**{**vars(ns), "gqa_tp": tp})
        rows.append(differ_from_plain(rows, bench_engine("gqa", ns.model, sharded, ns.kv_cache_mib, f"gqa, --tp {tp}")))
        share = server_line(ns.out, f"gqa, --tp {tp}", "all-reduces")
        print(f"[bench serve] --tp {tp}: {rows[-1]['differ_from_plain']} responses differ from tp 1's; {share}",
              file=sys.stderr)  # fmt: skip
    for replicas in [r for r in dict.fromkeys(ns.replicas) if r != 1] if "gqa" in engines else []:
        spread = argparse.Namespace(**{**vars(ns), "gqa_replicas": replicas})
        row = bench_engine("gqa", ns.model, spread, ns.kv_cache_mib / replicas, f"gqa, --replicas {replicas}")
        rows.append(differ_from_plain(rows, row))
        print(f"[bench serve] --replicas {replicas}: {rows[-1]['differ_from_plain']} responses differ from one "
              "engine's", file=sys.stderr)  # fmt: skip
    if ns.routing is not None and "gqa" in engines:
        from .replica_workload import routing_rows

        rows += routing_rows(ns, max(max(ns.replicas), 2), ns.routing or ["prefix", "round-robin"])
    if ns.speculate and "gqa" in engines:
        drafting = argparse.Namespace(**{**vars(ns), "gqa_speculate": ns.speculate})
        row = bench_engine("gqa", ns.model, drafting, ns.kv_cache_mib, f"gqa, --speculate {ns.speculate}")
        rows.append(differ_from_plain(rows, row))
        print(f"[bench serve] --speculate {ns.speculate}: {rows[-1]['differ_from_plain']} responses differ from gqa's "
              "without drafts (greedy verification is exact: 0)", file=sys.stderr)  # fmt: skip
    if "gqa" in engines and ns.device != "cpu":  # what the server captured at start
        plain = next(r for r in rows if r["tag"] == "gqa")
        plain["cuda_graphs"] = server_line(ns.out, "gqa", "CUDA graphs")
        print(f"[bench serve] {plain['cuda_graphs']}", file=sys.stderr)
    if ns.eager and "gqa" in engines and ns.device != "cpu":
        eager = argparse.Namespace(**{**vars(ns), "gqa_eager": True})
        row = bench_engine("gqa", ns.model, eager, ns.kv_cache_mib, "gqa, --enforce-eager")
        rows.append(differ_from_plain(rows, row))
        print(f"[bench serve] --enforce-eager: {rows[-1]['differ_from_plain']} responses differ from the CUDA-graph "
              "steps'", file=sys.stderr)  # fmt: skip
    if ns.structured and "gqa" in engines:
        rows.append(bench_engine("gqa", ns.model, ns, ns.kv_cache_mib, "gqa, json_schema", SCHEMA))
    for r in rows:
        r["context"] = ns.kv_context
    for tokens in ns.kv_max_tokens or [ns.max_tokens]:
        for heads in ns.kv_heads:
            path = converted(ns.model, heads, ns.out)
            settings = argparse.Namespace(**{**vars(ns), "clients": [max(ns.clients)], "max_tokens": tokens})
            row = bench_engine("gqa", path, settings, ns.kv_budget_mib,
                               f"gqa, {heads} KV heads, {ns.kv_budget_mib:g} MiB, {tokens} tokens")  # fmt: skip
            row["context"] = ns.kv_context
            rows.append(row)
    for r in rows:
        r.pop("texts", None)
    write_results(ns.out, "serve", {"rows": rows}, table(rows))
    return 0
