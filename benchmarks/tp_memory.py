"""Tensor-parallel serving's memory split (issue 71's target): each rank's peak resident memory against one process's.

    python benchmarks/tp_memory.py [FILE.gguf] [--tp 1 2] [--kv-cache-mib 256|default] [--requests 4]

For each ``--tp``, ``gqa serve --model FILE --tp N`` (default: the embedded SmolLM2; dtype auto: a GGUF's quantized
weights stay blocks, each rank holding its shard of them; the KV pool of ``--kv-cache-mib`` split over the ranks by KV
heads; ``default``: the pool ``gqa serve`` sizes itself, as a user without the flag gets it) answers ``--requests``
greedy completions, then each process's peak resident memory (``VmHWM``: weights + KV pool + runtime) is read: the
server process (rank 0) and every rank under it. Prints a markdown table and one JSON line per ``--tp``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from gqa.bench.serve_clients import ServerProcess, free_port

PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def peaks(pid: int) -> list[tuple[int, float]]:
    """``(pid, VmHWM MiB)`` of ``pid`` and every process under it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
            hwm = next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))
            out.append((p, hwm))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return out


def complete(port: int, model: str, max_tokens: int) -> str:
    import http.client

    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = json.loads(response.read())
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data}")
    return data["choices"][0]["text"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, nargs="?", help="GGUF file or HF folder (default: the embedded SmolLM2)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--kv-cache-mib", default="256", help="MiB, or 'default': the server's own pool size")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    ns = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in ns.tp:
            port = free_port()
            model = ["--model", str(ns.model)] if ns.model else []
            pool = [] if ns.kv_cache_mib == "default" else ["--kv-cache-mib", str(float(ns.kv_cache_mib))]
            argv = [sys.executable, "-m", "gqa", "serve", *model, "--tp", str(tp), "--port", str(port), *pool]
            server = ServerProcess(argv, port, Path(tmp) / f"tp{tp}.log")
            try:
                texts = [complete(port, server.model, ns.max_tokens) for _ in range(ns.requests)]
                # rank 0 is the server process; the other ranks are its children's (the launcher's) workers
                procs = peaks(server.proc.pid)
                ranks = [procs[0][1]] + [m for _, m in procs[1:] if m > 200] if tp > 1 else [procs[0][1]]
            finally:
                server.stop()
            rows.append({"tp": tp, "rank_peaks_mib": [round(m) for m in ranks], "same_text": len(set(texts)) == 1})
    one = rows[0]["rank_peaks_mib"][0] if rows and rows[0]["tp"] == 1 else None
    print("| tp | each rank's peak RSS (MiB) | largest / tp 1's |")
    print("|---:|---|---:|")
    for r in rows:
        ratio = f"{max(r['rank_peaks_mib']) / one:.2f}x" if one else "-"
        print(f"| {r['tp']} | {', '.join(map(str, r['rank_peaks_mib']))} | {ratio} |")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
