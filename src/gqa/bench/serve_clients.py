"""What ``gqa bench serve`` drives servers with: a server command as a child process on a free port, streamed chat
requests from concurrent clients and their summary (tok/s, TTFT, ITL), the prompts, and each engine's command line."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

from .llama_cpp_kv import llama_server_flags, server_flags

__all__ = ["ASKS", "TOPICS", "ServerProcess", "free_port", "load", "prompts", "server_argv", "stream_chat", "valid"]

TOPICS = (
    "the water cycle", "how a bicycle stays upright", "why the sky is blue", "what a compiler does", "photosynthesis",
    "the rules of chess", "how vaccines work", "the history of the printing press", "black holes", "how bread rises",
    "the French revolution", "how a refrigerator works", "plate tectonics", "what an API is", "the moon's phases",
    "how bees make honey",
)  # fmt: skip
ASKS = ("Explain {} in a few sentences.", "Write a short paragraph about {}.", "What should a child know about {}?")


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
        """The server's peak resident memory, summed over its process and every process under it (replicas, ranks):
        each one's own peak, so an upper bound of the tree's."""
        pids, total = [self.proc.pid], 0.0
        while pids:
            pid = pids.pop()
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) / 1024
                for task in Path(f"/proc/{pid}/task").iterdir():
                    pids += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
        return total or float("nan")

    def metrics(self) -> dict[str, float]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        values = {k: float(v) for k, v in (ln.split() for ln in text.splitlines() if ln and not ln.startswith("#"))}
        # behind gqa serve --replicas: the replicas' totals under the plain names
        return values | {k.replace('{replica="all"}', ""): v for k, v in values.items() if '{replica="all"}' in k}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def stream_chat(
    port: int, model: str, prompt: str, max_tokens: int, schema: dict | None = None, system: str | None = None
) -> dict:
    """One streamed greedy chat request (``schema``: its answer held to that JSON schema; ``system``: a system
    message first): its text, token count (chunks with content) and arrival times."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    request = {"model": model, "messages": messages, "max_tokens": max_tokens,
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


def load(
    port: int, model: str, texts: list[str], clients: int, max_tokens: int, schema: dict | None = None,
    systems: list[str] | None = None,
) -> dict:  # fmt: skip
    """``texts`` sent by ``clients`` concurrent clients (``systems``: each with that system message); the load's
    summary and each response's text (``schema``: held to it, and counted where they parse and validate)."""
    start = time.perf_counter()
    systems = systems or [None] * len(texts)
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p, s: stream_chat(port, model, p, max_tokens, schema, s), texts, systems))
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
        if getattr(ns, "gqa_replicas", 1) > 1:
            argv += ["--replicas", str(ns.gqa_replicas), "--replica-routing", getattr(ns, "gqa_routing", "prefix")]
        if getattr(ns, "gqa_speculate", 0):
            argv += ["--speculate", str(ns.gqa_speculate)]
        if getattr(ns, "gqa_eager", False):
            argv += ["--enforce-eager"]
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
