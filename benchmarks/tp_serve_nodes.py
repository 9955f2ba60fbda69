"""``gqa serve`` across two "machines" on one host: two torchrun invocations (``--nnodes 2 --node-rank 0/1``, one
process each, a static rendezvous on 127.0.0.1), rank 0 serving HTTP, against the same model served by one process.

    python benchmarks/tp_serve_nodes.py                  # the embedded SmolLM2 in float32, 4 prompts, 12 tokens
    python benchmarks/tp_serve_nodes.py --dtype bf16 --tokens 64

Printed: each prompt's greedy answer equal or not to one process's (the engine in this process), the seconds each
answer took, and both torchruns' exit codes after SIGTERM to rank 0's process (0 and 0: rank 0 stops rank 1; a
SIGTERM to torchrun itself is forwarded to rank 0 alike, but torchrun then exits 1). On real machines run
the same two lines with ``--master-addr`` the first machine's address (docs/usage.md, "Tensor-parallel serving").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.helpers

from tests.helpers.server_process import MODEL, get

PROMPTS = ["Name three planets of the solar system.", "What is the capital of France?", "Say hello in Spanish.",
           "Count from one to five."]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """The ids of ``pid``'s child processes (/proc)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


def chat(url: str, prompt: str, tokens: int) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0}
    request = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())["choices"][0]["message"]["content"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp32", help="gqa serve --dtype (fp32: the same text as one process)")
    parser.add_argument("--tokens", type=int, default=12, help="greedy tokens per answer")
    args = parser.parse_args()
    from gqa.serve import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, kv_cache_mib=64.0)
    alone = [llm.generate(p, SamplingParams(max_tokens=args.tokens, temperature=0), chat=True)[0].text for p in PROMPTS]
    port, master = free_port(), str(free_port())
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", master]
    serve = ["-m", "gqa", "serve", "--port", str(port), "--dtype", args.dtype, "--kv-cache-mib", "64"]
    env = os.environ | {"GQA_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1"}
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *common, "--node-rank", str(rank),
                               *serve], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if get(url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or any(n.poll() is not None for n in nodes):
                raise RuntimeError(f"the nodes did not serve: {[n.poll() for n in nodes]}")
            time.sleep(0.3)
        for prompt, expected in zip(PROMPTS, alone, strict=True):
            start = time.perf_counter()
            text = chat(url, prompt, args.tokens)
            print(f"{'equal' if text == expected else 'DIFFERS'} ({time.perf_counter() - start:.2f} s): {text!r}")
    finally:  # SIGTERM to rank 0's process (torchrun's child): torchrun itself exits 1 on a SIGTERM of its own
        for pid in children(nodes[0].pid) or [nodes[0].pid]:
            os.kill(pid, signal.SIGTERM)
        codes = []
        for n in nodes:
            try:
                codes.append(n.wait(60))
            except subprocess.TimeoutExpired:
                n.kill()
                codes.append(n.wait())
    print(f"exit codes after SIGTERM to rank 0: {codes}")
    for rank, n in enumerate(nodes):
        print(f"node {rank}'s last lines:", *n.stderr.read().splitlines()[-6:], sep="\n  ")
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())
