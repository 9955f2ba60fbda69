"""What a cold load of a model costs through ``gqa serve``'s router (several models, ``--max-loaded 1``) beside the
first request to a server that loaded the model at its start (one model, today's path).

    python benchmarks/model_router.py                     # the embedded SmolLM2, 5 cold loads
    python benchmarks/model_router.py --model M.gguf --rounds 9

One server serves the model alone: the time of its first chat request (max_tokens 1) once ``/health`` answers. A
second serves the same file under two names with room for one: every request alternates names, so each one unloads
the other copy and loads its own (a cold load; the file is in the page cache, as it is after the first), and its time
is load + first request. Printed: both medians, their difference (what a cold load adds), the router's own load time
(``gqa_model_load_seconds``) and each server's RSS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers: the server as a child process

from tests.helpers.server_process import Server


def chat(url: str, model: str) -> float:
    """Seconds of one greedy chat request of one token."""
    body = {"model": model, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 1}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as r:
        r.read()
    return time.perf_counter() - start


def rss_mib(server: Server) -> float:
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--rounds", type=int, default=5, help="fresh single-model servers, and cold loads")
    args = parser.parse_args()
    from gqa.loaders import default_model_path

    path = args.model or str(default_model_path())
    firsts, single_rss = [], []
    for _ in range(args.rounds):  # a fresh server each: only its first request is today's first-request cost
        server = Server("--model", path, "--served-model-name", "m", kv_cache_mib=None)
        try:
            firsts.append(chat(server.url, "m"))
            single_rss.append(rss_mib(server))
        finally:
            server.stop()
    server = Server("--model", path, "--model", path, "--served-model-name", "a", "--served-model-name", "b",
                    "--max-loaded", "1", kv_cache_mib=None)  # fmt: skip
    try:
        chat(server.url, "b")  # the first load also imports what loading needs: not a cold load's cost afterwards
        colds, loads, router_rss = [], [], []
        for i in range(args.rounds):
            name = "ab"[i % 2]
            colds.append(chat(server.url, name))
            loads.append(server.metrics()[f'gqa_model_load_seconds{{model="{name}"}}'])
            router_rss.append(rss_mib(server))
    finally:
        server.stop()
    first, cold = statistics.median(firsts), statistics.median(colds)
    print(f"model: {path}")
    print(f"single-model server, first request: median {first:.3f} s  ({', '.join(f'{t:.3f}' for t in firsts)}); "
          f"RSS {statistics.median(single_rss):.0f} MiB")  # fmt: skip
    print(f"router, request with a cold load:  median {cold:.3f} s  ({', '.join(f'{t:.3f}' for t in colds)}); "
          f"RSS {statistics.median(router_rss):.0f} MiB")  # fmt: skip
    print(f"router's load alone (gqa_model_load_seconds): median {statistics.median(loads):.3f} s")
    print(f"a cold load adds {cold - first:+.3f} s to the first request")


if __name__ == "__main__":
    main()
