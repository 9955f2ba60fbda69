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
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

from ..options.common import KV_CACHE_DTYPES
from .llama_cpp_kv import cache_kind, llama_server_flags, server_flags

HELP = "OpenAI-compatible servers under 1-64 concurrent streaming clients: tok/s, TTFT, ITL, memory"
DESCRIPTION = __doc__.split("\n\n")[1].replace("\n", " ")
ENGINES = ("gqa", "llama.cpp", "llama-server")
TOPICS = (
    "the water cycle", "how a bicycle stays upright", "why the sky is blue", "what a compiler does", "photosynthesis",
    "the rules of chess", "how vaccines work", "the history of the printing press", "black holes", "how bread rises",
    "the French revolution", "how a refrigerator works", "plate tectonics", "what an API is", "the moon's phases",
    "how bees make honey",
)  # fmt: skip
ASKS = ("Explain {} in a few sentences.", "Write a short paragraph about {}.", "What should a child know about {}?")
# --structured: each answer as {"topic": ..., "answer": ...}, bounded so that it ends within --max-tokens 64
SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string", "maxLength": 40}, "answer": {"type": "string", "maxLength": 100}},
    "required": ["topic", "answer"],
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file or HF folder (default: embedded SmolLM2)")
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
    parser.add_argument("--speculate", type=int, default=0, metavar="K",
                        help="also serve gqa's loads with gqa serve --speculate K (prompt-lookup drafts)")  # fmt: skip
    parser.add_argument("--tp", type=int, nargs="+", default=[1], metavar="N",
                        help="serve gqa's loads at each of these tensor-parallel sizes (gqa serve --tp N; one thread "
                        "per rank on 2 cores), responses compared with the first's")  # fmt: skip
    parser.add_argument("--structured", action="store_true",
                        help="also serve gqa's loads with a JSON schema as response_format")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench-serve"), help="folder for results.json and .md")


def prompts(n: int) -> list[str]:
    return [ASKS[i % len(ASKS)].format(TOPICS[i % len(TOPICS)]) for i in range(n)]


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server command on a free port, ready once ``/v1/models`` answers; stopped with SIGTERM (then killed)."""

    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{argv[:4]} exited {self.proc.returncode}; see {log}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/v1/models")
                model = json.loads(conn.getresponse().read())["data"][0]["id"]
                self.model = model
                return
            except (OSError, ValueError, KeyError, IndexError):
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"{argv[:4]} did not answer in 300 s; see {log}")

    def peak_rss_mib(self) -> float:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def metrics(self) -> dict[str, float]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        return {k: float(v) for k, v in (ln.split() for ln in text.splitlines() if ln and not ln.startswith("#"))}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def stream_chat(port: int, model: str, prompt: str, max_tokens: int, schema: dict | None = None) -> dict:
    """One streamed greedy chat request (``schema``: its answer held to that JSON schema): its text, token count
    (chunks with content) and arrival times."""
    request = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if schema is not None:
        request["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    body = json.dumps(request)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        return {"error": f"HTTP {response.status}: {response.read()[:200]!r}", "text": "", "times": [], "start": start}
    text, times, tokens = [], [], None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        if "error" in chunk:
            return {"error": str(chunk["error"]), "text": "".join(text), "times": times, "start": start}
        for choice in chunk.get("choices", []):
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                text.append(piece)
                times.append(time.perf_counter())
        if chunk.get("usage"):
            tokens = chunk["usage"].get("completion_tokens")
    # the tokens the server counted (a chunk can carry several: speculation), else the chunks with content
    return {"text": "".join(text), "times": times, "start": start, "tokens": tokens or len(times)}


def load(port: int, model: str, texts: list[str], clients: int, max_tokens: int, schema: dict | None = None) -> dict:
    """``texts`` sent by ``clients`` concurrent clients; the load's summary and each response's text (``schema``: held
    to it, and counted where they parse and validate)."""
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: stream_chat(port, model, p, max_tokens, schema), texts))
    wall = time.perf_counter() - start
    ttft = [r["times"][0] - r["start"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)]
    tokens = sum(r.get("tokens", len(r["times"])) for r in results)

    def pct(xs: list[float], q: float) -> float:
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs or [0.0])[0]

    return {
        "clients": clients, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
        "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
        "errors": [r["error"] for r in results if "error" in r], "texts": [r["text"] for r in results],
        "valid": None if schema is None else sum(valid(r["text"], schema) for r in results),
    }  # fmt: skip


def valid(text: str, schema: dict) -> bool:
    """Whether ``text`` is JSON that ``schema`` (``SCHEMA``'s kind: required string fields with maxLength) accepts."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    fields = schema["properties"]
    return (isinstance(value, dict) and set(schema["required"]) <= set(value) and set(value) <= set(fields)
            and all(isinstance(value[k], str) and len(value[k]) <= fields[k]["maxLength"] for k in value))  # fmt: skip


def server_argv(engine: str, model_path: str | None, ns: argparse.Namespace, port: int, kv_mib: float) -> list[str]:
    """The command line of ``engine``'s server on ``port``, its KV cache storing ``ns.kv_cache_dtype``."""
    kv = getattr(ns, "kv_cache_dtype", "auto")
    if engine == "gqa":
        argv = [sys.executable, "-m", "gqa", "serve", "--port", str(port), "--kv-cache-mib", str(kv_mib)]
        if kv != "auto":
            argv += ["--kv-cache-dtype", kv]
        if getattr(ns, "device", "cpu") != "cpu":
            argv += ["--device", ns.device]
        if getattr(ns, "gqa_tp", 1) > 1:
            argv += ["--tp", str(ns.gqa_tp)]
        if getattr(ns, "gqa_speculate", 0):
            argv += ["--speculate", str(ns.gqa_speculate)]
        return argv + (["--model", model_path] if model_path else [])
    from ..loaders import default_model_path

    if engine == "llama-server":
        slots = min(64, max(ns.clients))
        return [str(ns.llama_server), "-m", str(model_path or default_model_path()), "--host", "127.0.0.1", "--port",
                str(port), "-t", str(ns.threads), "-np", str(slots), "-c", str(1024 * slots),
                *llama_server_flags(kv, ns.llama_server)]  # fmt: skip
    # --interrupt_requests: by default a new request cuts the running one short
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path or default_model_path()), "--port",
            str(port), "--n_threads", str(ns.threads), "--n_ctx", "4096", "--interrupt_requests", "False",
            *server_flags(kv)]  # fmt: skip


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
        rows.append(bench_engine("gqa", ns.model, sharded, ns.kv_cache_mib, f"gqa, --tp {tp}"))
        plain = next(r for r in rows if r["tag"] == "gqa")
        rows[-1]["differ_from_plain"] = sum(a != b for a, b in zip(plain["texts"], rows[-1]["texts"], strict=True))
        share = [ln for ln in (ns.out / f"gqa, --tp {tp}.log").read_text().splitlines() if "all-reduces" in ln]
        print(f"[bench serve] --tp {tp}: {rows[-1]['differ_from_plain']} responses differ from tp 1's; "
              f"{share[-1] if share else ''}", file=sys.stderr)  # fmt: skip
    if ns.speculate and "gqa" in engines:
        drafting = argparse.Namespace(**{**vars(ns), "gqa_speculate": ns.speculate})
        rows.append(bench_engine("gqa", ns.model, drafting, ns.kv_cache_mib, f"gqa, --speculate {ns.speculate}"))
        plain = next(r for r in rows if r["tag"] == "gqa")
        rows[-1]["differ_from_plain"] = sum(a != b for a, b in zip(plain["texts"], rows[-1]["texts"], strict=True))
        print(f"[bench serve] --speculate {ns.speculate}: {rows[-1]['differ_from_plain']} responses differ from gqa's "
              "without drafts (greedy verification is exact: 0)", file=sys.stderr)  # fmt: skip
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
