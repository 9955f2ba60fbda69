"""Shared-CPU benchmark: decode speed when other work runs on the same cores, as a server or a laptop has it.

Each engine decodes ``--new-tokens`` tokens after a ``--context``-token prompt alone, then beside one and beside two
busy processes (``--beside``), each a 2-thread torch matmul loop (``--busy torch``, like a training job or a test
suite) or a pure-Python loop (``--busy python``); the table shows decode tok/s (new tokens over the wall time from the
first to the last, so stalls count) and the share of its alone speed each engine keeps. Engines run one at a time in
fresh processes (``gqa.bench.model.worker``), taking turns in every round (``--rounds``, median shown), so a busy
spell of the machine hits them alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

HELP = "decode tok/s alone and beside busy processes: the share of its alone speed each engine keeps"
DESCRIPTION = __doc__.split("\n\n")[1].replace("\n", " ")

BUSY = {
    "torch": "import torch\ntorch.set_num_threads(2)\na = torch.randn(384, 384)\nwhile True:\n a = torch.tanh(a @ a)",
    "python": "x = 0\nwhile True:\n    x = (x + 1) % 1000003",
}
ENGINES = ("gqa", "llama.cpp", "hf")
DTYPE = {"gqa": "q4_1", "llama.cpp": "q4_1", "hf": "fp32"}  # each engine as it runs the embedded Q4_1 GGUF


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file (default: embedded SmolLM2)")
    parser.add_argument(
        "--engines", nargs="+", choices=ENGINES, default=list(ENGINES),
        help="gqa and llama.cpp on the file's Q4_1 blocks, hf (transformers) in fp32; llama.cpp is skipped when not "
        "installed (make llama-cpp)",
    )  # fmt: skip
    parser.add_argument("--beside", type=int, nargs="+", default=[0, 1, 2], metavar="N", help="busy processes")
    parser.add_argument("--busy", choices=tuple(BUSY), default="torch", help="what each busy process runs")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens before decoding")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per engine and load; the table shows the median")
    parser.add_argument("--out", type=Path, default=Path("bench-shared"), help="folder for results.json and .md")


class Busy:
    """``n`` busy processes for the duration of a ``with`` block (started, given a second to ramp up, killed)."""

    def __init__(self, n: int, kind: str) -> None:
        self.n, self.kind = n, kind
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Busy:
        for _ in range(self.n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", BUSY[self.kind]], stdout=subprocess.DEVNULL))
        if self.n:
            time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait(timeout=30)


def decode_tok_s(model: str | None, engine: str, context: int, new_tokens: int) -> float:
    """Tokens per second from the first to the last new token, in a fresh worker process."""
    from .model.benchmark import _run_worker

    row = _run_worker(model, engine, DTYPE[engine], [context], new_tokens)["rows"][0]
    return row["decode_mean_tok_s"]


def table(rows: list[dict], beside: list[int], kind: str) -> str:
    head = " | ".join(f"beside {n} {kind} loop{'s' if n > 1 else ''}" if n else "alone" for n in beside)
    lines = [f"| engine | {head} |", "|---|" + "---:|" * len(beside)]
    for r in rows:
        alone = r["tok_s"].get(0)
        cells = []
        for n in beside:
            t = r["tok_s"][n]
            share = f" ({t / alone:.0%})" if alone and n else ""
            cells.append(f"{t:.1f} tok/s{share}")
        lines.append(f"| {r['engine']} ({DTYPE[r['engine']]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from . import write_results
    from .model.benchmark import llama_cpp_available

    if ns.rounds < 1 or ns.context < 1 or ns.new_tokens < 2 or min(ns.beside) < 0:
        parser.error("--rounds and --context must be >= 1, --new-tokens >= 2, --beside counts >= 0")
    if ns.model is not None and not Path(ns.model).is_file():
        parser.error(f"--model {ns.model}: no such file (a .gguf file)")
    engines = list(dict.fromkeys(ns.engines))
    if "llama.cpp" in engines and not llama_cpp_available():
        print("[bench shared] skipping llama.cpp: llama-cpp-python is not installed (make llama-cpp)", file=sys.stderr)
        engines.remove("llama.cpp")
    samples: dict[str, dict[int, list[float]]] = {e: {n: [] for n in ns.beside} for e in engines}
    for n in ns.beside:
        with Busy(n, ns.busy):
            for round_index in range(ns.rounds):
                for engine in engines:
                    samples[engine][n].append(decode_tok_s(ns.model, engine, ns.context, ns.new_tokens))
                print(f"[bench shared] beside {n}: round {round_index + 1} of {ns.rounds}", file=sys.stderr, flush=True)
    rows = [{"engine": e, "tok_s": {n: statistics.median(s) for n, s in samples[e].items()}, "samples": samples[e]}
            for e in engines]  # fmt: skip
    write_results(ns.out, "shared", {"busy": BUSY[ns.busy], "rows": rows}, table(rows, ns.beside, ns.busy))
    return 0
