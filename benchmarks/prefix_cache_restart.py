"""Time to first token of a long prompt after a restart with ``gqa serve --prefix-cache-dir``, against the cold one,
and what writing the blocks costs the streams being decoded meanwhile.

    python benchmarks/prefix_cache_restart.py [--tokens 2000] [--rounds 3] [--model PATH] [-- SERVE FLAGS]

Each round, in a fresh directory: start ``gqa serve --prefix-cache-dir DIR``, send the prompt (streamed completion,
greedy), stop the server, start it again and send the same prompt. ``cold``: the first server's time to first token
(the prompt prefilled, then its blocks written); ``restarted``: the second's (the blocks read from disk, the last
partial block prefilled); ``again``: the same prompt once more on the second server (the in-memory prefix cache). The
texts must be equal. Medians over the rounds.

``stall``: in this process, one request decoding while a long prompt is admitted, prefilled and its blocks written
on the writer thread: the median and the worst decode step of the decoding request while the writer runs, against
the same steps with no prefix directory.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import closing

SENTENCE = "Note {i}: the archive keeps record number {i} about the river, the bridge and the old mill. "


def prompt_text(tokens: int) -> str:
    """About ``tokens`` tokens of text that differ sentence by sentence (SmolLM2's tokenizer: ~24 per sentence)."""
    return "".join(SENTENCE.format(i=i) for i in range(tokens // 24))


def free_port() -> int:
    with closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, flags: list[str]) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "gqa", "serve", "--port", str(self.port), *flags],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gqa serve exited: {self.proc.stderr.read()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5) as r:
                    self.model = json.load(r)["data"][0]["id"]
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("gqa serve did not start")

    def first_token(self, prompt: str, max_tokens: int) -> tuple[float, str]:
        """Seconds until the first streamed text of a greedy completion of ``prompt``, and the whole text."""
        body = json.dumps(
            {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        )
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response, first, text = conn.getresponse(), None, ""
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read().decode()}")
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0]["text"]
            if piece and first is None:
                first = time.perf_counter() - start
            text += piece
        conn.close()
        return first, text

    def disk_hits(self) -> float:
        """``gqa_prefix_cache_disk_hits_total``: prompt blocks this server read from the directory."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("gqa_prefix_cache_disk_hits_total "):
                    return float(line.split()[1])
        raise RuntimeError("no gqa_prefix_cache_disk_hits_total in /metrics")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(120)


def restart_rounds(args: argparse.Namespace) -> None:
    prompt = prompt_text(args.tokens)
    model = ["--model", args.model] if args.model else []
    times: dict[str, list[float]] = {"cold": [], "restarted": [], "again": []}
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory() as directory:
            flags = [*model, "--prefix-cache-dir", directory, *args.serve_flags]
            first = Server(flags)
            cold, text = first.first_token(prompt, args.max_tokens)
            first.stop()  # the writer thread finishes the files before the process ends
            files = len(os.listdir(directory))
            second = Server(flags)
            restarted, text_restarted = second.first_token(prompt, args.max_tokens)
            read = second.disk_hits()  # what makes "restarted" a read from disk: blocks counted as read there
            again, text_again = second.first_token(prompt, args.max_tokens)
            second.stop()
        if not read:
            raise SystemExit(f"the restarted server read no block from the directory ({files} files there)")
        if not text == text_restarted == text_again:
            raise SystemExit(f"the texts differ: {text!r} / {text_restarted!r} / {text_again!r}")
        for name, t in (("cold", cold), ("restarted", restarted), ("again", again)):
            times[name].append(t)
        print(f"round {round_}: cold {cold * 1e3:.0f} ms, restarted {restarted * 1e3:.0f} ms ({files} block files, "
              f"{read:.0f} read), again {again * 1e3:.0f} ms", file=sys.stderr)  # fmt: skip
    cold = statistics.median(times["cold"])
    print(f"prompt ~{args.tokens} tokens, medians over {args.rounds} rounds:")
    for name, ts in times.items():
        t = statistics.median(ts)
        print(f"  {name:10s} time to first token {t * 1e3:8.1f} ms  ({t / cold:.3f}x cold)")


def stall(args: argparse.Namespace) -> None:
    """Decode steps of a running request while a long prompt's blocks are written, with and without a directory."""
    from gqa.serve import LLM, SamplingParams
    from gqa.serve.engine import Engine

    llm = LLM(args.model)
    tok = llm.tokenizer
    long_prompt, short = tok.encode(prompt_text(args.tokens)), tok.encode("Tell me a long story about a dragon.")
    for directory in (None, tempfile.mkdtemp()):
        engine = Engine(llm.model, tok, prefix_cache_dir=directory, max_running=4)
        steps, writing = [], []
        engine.add(short, SamplingParams(max_tokens=4000, ignore_eos=True))
        for _ in range(5):
            engine.step()
        engine.add(long_prompt, SamplingParams(max_tokens=1))
        while engine.stats().waiting or any(len(r.outputs) == 0 for r in engine.requests.values()):
            engine.step()  # admitted and prefilled: its blocks are queued for writing now
        queued = time.perf_counter()
        for _ in range(args.stall_steps):
            busy = engine.disk is not None and engine.disk._writer is not None
            start = time.perf_counter()
            engine.step()
            (writing if busy or directory is None else steps).append(time.perf_counter() - start)
        engine.close()
        label = "no prefix dir" if directory is None else "writer running"
        sample = writing if writing else steps
        print(f"stall: {label:15s} decode step median {statistics.median(sample) * 1e3:6.2f} ms, worst "
              f"{max(sample) * 1e3:6.2f} ms over {len(sample)} steps")  # fmt: skip
        if directory is not None:
            print(
                f"stall: {engine.disk.writes} blocks written in {time.perf_counter() - queued:.2f} s"
                + (f"; after: decode step median {statistics.median(steps) * 1e3:6.2f} ms" if steps else "")
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2000, help="prompt length, about")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--stall-steps", type=int, default=60, help="decode steps timed in the stall measurement")
    parser.add_argument("--no-stall", action="store_true", help="skip the in-process stall measurement")
    parser.add_argument("--no-restart", action="store_true", help="skip the servers (the stall measurement only)")
    parser.add_argument("serve_flags", nargs="*", help="more flags for gqa serve (after --)")
    args = parser.parse_args()
    if not args.no_restart:
        restart_rounds(args)
    if not args.no_stall:
        stall(args)


if __name__ == "__main__":
    main()
