"""Startup benchmark: how long a user waits before anything happens, as process wall time.

Each case runs ``--runs`` times (default 5) in a fresh Python process, the cases taking turns (round-robin, so a busy
spell on a shared machine hits all of them alike), and the table shows the median (and min-max): ``import torch``
(the floor), ``import gqa``, ``gqa info``, ``gqa generate --max-new-tokens 1``, ``gqa.load_model()`` in-process (the
first call in a fresh process and a second, warm one, timed inside the process), and llama.cpp
(``llama-cpp-python``) importing, loading the same GGUF file and producing its first token, when it is installed.
Run ``gqa bench startup --help`` for the flags.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HELP = "process wall time of import gqa, gqa info, a first token and load_model, beside llama.cpp's"
DESCRIPTION = __doc__.split("\n\n")[1].replace("\n", " ")

_LOAD = """
import json, sys, time, torch
t0 = time.perf_counter()
import gqa
public = [getattr(gqa, name) for name in gqa.__all__]  # loaded on first use: all of them, as import gqa used to
t1 = time.perf_counter()
m = gqa.load_model(MODEL, dtype=DTYPE)
t2 = time.perf_counter()
m = gqa.load_model(MODEL, dtype=DTYPE)
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "cold": t2 - t1, "warm": t3 - t2}))
"""

_LLAMA_CPP = """
import json, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
t1 = time.perf_counter()
llm = Llama(model_path=MODEL, n_ctx=256, verbose=False)
t2 = time.perf_counter()
out = llm.create_completion("Hi", max_tokens=1, temperature=0.0)
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "first_token": t3 - t2}))
"""


@dataclass
class Case:
    """One row: a command line, or a Python snippet whose JSON line gives in-process times."""

    name: str
    argv: list[str]
    inner: str | None = None  # a key of the snippet's JSON to report instead of the process wall time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a .gguf file (default: embedded SmolLM2)")
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per case; the table shows the median")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "fp32", "bf16"], help="load_model's dtype in the in-process rows"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-startup"), help="folder for results.json and .md")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even when installed")


def cases(model: str | None, dtype: str, llama_cpp: bool) -> list[Case]:
    py = [sys.executable]
    model_flag = ["--model", model] if model else []
    torch_dtype = {"auto": "'auto'", "fp32": "torch.float32", "bf16": "torch.bfloat16"}[dtype]
    load = _LOAD.replace("MODEL", repr(model)).replace("DTYPE", torch_dtype)
    out = [
        Case("python -c 'import torch'", [*py, "-c", "import torch"]),
        Case("python -c 'import gqa'", [*py, "-c", "import gqa"]),
        Case("gqa info", [*py, "-m", "gqa", "info", *model_flag]),
        Case("gqa generate --max-new-tokens 1 Hi", [*py, "-m", "gqa", "generate", "--max-new-tokens", "1", "Hi"]),
        Case(f"load_model(dtype={dtype}), first in a process", [*py, "-c", load], inner="cold"),
        Case(f"load_model(dtype={dtype}), warm", [*py, "-c", load], inner="warm"),
    ]
    if llama_cpp:
        from ..loaders import resolve_model_path

        snippet = _LLAMA_CPP.replace("MODEL", repr(str(resolve_model_path(model))))
        out.append(Case("llama-cpp-python: import + load + first token", [*py, "-c", snippet]))
        out.append(Case("llama-cpp-python: load", [*py, "-c", snippet], inner="load"))
    return out


def measure(case: Case, runs: int, env: dict[str, str]) -> list[float]:
    """Seconds per run: the process's wall time, or the ``inner`` time the snippet printed."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(case.argv, capture_output=True, text=True, env=env, timeout=600)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{case.name} failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
        times.append(json.loads(done.stdout.strip().splitlines()[-1])[case.inner] if case.inner else wall)
    return times


def table(rows: list[dict]) -> str:
    lines = ["| what | median | min - max | runs |", "|---|---:|---:|---:|"]
    for r in rows:
        t = r["seconds"]
        lines.append(f"| {r['name']} | {statistics.median(t):.2f} s | {min(t):.2f} - {max(t):.2f} s | {len(t)} |")
    return "\n".join(lines)


def run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from . import write_results
    from .model.benchmark import llama_cpp_available

    if ns.runs < 1:
        parser.error(f"--runs must be >= 1, got {ns.runs}")
    if ns.model is not None and not Path(ns.model).is_file():
        parser.error(f"--model {ns.model}: no such file (a .gguf file)")
    llama_cpp = llama_cpp_available() and not ns.no_llama_cpp
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE=os.environ.get("PYTHONDONTWRITEBYTECODE", ""))
    todo = cases(ns.model, ns.dtype, llama_cpp)
    seconds: dict[str, list[float]] = {case.name: [] for case in todo}
    for run_index in range(ns.runs):  # round-robin: a busy spell on a shared machine hits every case alike
        for case in todo:
            seconds[case.name] += measure(case, 1, env)
        print(f"[bench startup] round {run_index + 1} of {ns.runs} done", file=sys.stderr, flush=True)
    rows = [{"name": name, "seconds": s, "median": statistics.median(s)} for name, s in seconds.items()]
    fields = {"load_average": os.getloadavg(), "llama_cpp": llama_cpp, "rows": rows}
    write_results(ns.out, "startup", fields, table(rows))
    return 0
