"""``gqa bench model --shapes llama-3b llama-8b`` on the CPU: random Llama-shaped Q4_K_M files (``random_files``,
made once and cached) run by gqa and by llama.cpp's ``llama-bench`` on the same file and threads, side by side.

Rows per shape:

* decode tok/s: gqa's median time between new tokens after a 128-token prompt (``worker``), llama-bench's ``tg``
  (``-n``, from an empty context); and gqa's share of the bandwidth ceiling (weights + KV read per token, times
  tok/s, over ``x.sum()``'s read GB/s);
* prompt processing tok/s at each ``--contexts`` (default 128 512 2048), warm: gqa's median of ``--repeats`` forwards
  after an untimed one, llama-bench's mean of ``--repeats`` after its own warm-up;
* load to first token, exec to exit of a fresh process that loads the file and processes a 16-token prompt (gqa:
  ``python -c 'import gqa; gqa.load_model(...)'`` + ``generate(max_new_tokens=1)``; llama.cpp: ``llama-bench -p 16
  -n 0 -r 1 --no-warmup``), with the file's pages dropped from the page cache first (cold: ``posix_fadvise
  DONTNEED``, its resident bytes checked with ``fincore`` where installed) and with them cached (warm);
* peak RSS of the benchmark processes (``wait4``'s ``ru_maxrss``; the pages of the file they touch count), beside
  the file's size and the runtime's fixed overhead (``import torch`` + gqa's native kernels loaded, no model).

llama.cpp runs ``--repack 0`` and ``1``, the faster kept per row (``llama_bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from ..._paths import cache_root
from .llama_bench import llama_bench, llama_first_token_cmd
from .processes import cached_bytes, drop_page_cache, timed_process
from .random_files import LLAMA_SHAPES, find_llama_tool, model_file
from .report import ceiling_share

__all__ = ["default_model_dir", "run_shapes", "shapes_table"]

FIRST_PROMPT = 16  # tokens of the load-to-first-token prompt
_FIRST_TOKEN = """
import time
t0 = time.perf_counter()
import json, torch
t1 = time.perf_counter()
import gqa
model = gqa.load_model({path!r}, tokenizer=False)
model.generate(list(range(10, 10 + {prompt})), max_new_tokens=1, eos_token_ids=[])
print(json.dumps({{"import_torch_s": t1 - t0, "in_process_s": time.perf_counter() - t1}}))
"""
_OVERHEAD = "import torch, gqa.kernels; gqa.kernels.available()"


def default_model_dir() -> Path:
    """Where the random model files are made and kept: ``cache_root() / "bench-models"``."""
    return cache_root() / "bench-models"


def _gqa_rows(path: Path, contexts: list[int], new: int, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "gqa.bench.model.worker", "gqa", "--dtype", "gguf", "--model", str(path),
           "--new-tokens", str(new), "--prefill-repeats", str(repeats), "--contexts", *map(str, contexts)]  # fmt: skip
    run = timed_process(cmd, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    return json.loads(run["stdout"].strip().splitlines()[-1]) | {"process_peak_rss_mib": run["peak_rss_mib"]}


def _first_tokens(path: Path, llama: Path | None, threads: int, repack: int) -> dict:
    """Load to first token, cold then warm, per engine: ``{engine: {"cold": run, "warm": run}}`` (a run: wall_s,
    peak_rss_mib, and for cold the file's bytes still cached before it)."""
    cmds = {"gqa": [sys.executable, "-c", _FIRST_TOKEN.format(path=str(path), prompt=FIRST_PROMPT)]}
    if llama is not None:
        cmds["llama.cpp"] = llama_first_token_cmd(llama, path, FIRST_PROMPT, threads, repack)
    out: dict = {}
    for engine, cmd in cmds.items():
        drop_page_cache(path)
        left = cached_bytes(path)
        cold = timed_process(cmd) | {"cached_before_bytes": left}
        warm = timed_process(cmd)
        out[engine] = {"cold": cold, "warm": warm}
        for run in (cold, warm):
            out_text = run.pop("stdout").strip()
            if engine == "gqa":  # the snippet's own split: import torch, then gqa's import + load + first token
                run.update(json.loads(out_text.splitlines()[-1]))
    return out


def run_shapes(ns: argparse.Namespace) -> dict:
    """Every shape of ``ns.shapes`` measured (files made on first use in ``ns.model_dir``); the payload's results."""
    threads = torch.get_num_threads()
    folder = ns.model_dir or default_model_dir()
    bench = find_llama_tool("llama-bench", ns.llama_cpp)
    quantizer = find_llama_tool("llama-quantize", ns.llama_cpp)
    if bench is None:
        print("[bench model] no llama-bench (PATH or --llama-cpp DIR): gqa alone", file=sys.stderr, flush=True)
    overhead = timed_process([sys.executable, "-c", _OVERHEAD])["peak_rss_mib"]
    results = []
    for name in ns.shapes:
        path = model_file(name, folder, quantizer, threads=threads)
        print(f"[bench model] {name}: {path} ({path.stat().st_size / 2**30:.2f} GiB), gqa ...", file=sys.stderr,
              flush=True)  # fmt: skip
        ours = _gqa_rows(path, ns.contexts, ns.new_tokens, ns.repeats)
        theirs = None
        if bench is not None:
            print(f"[bench model] {name}: llama-bench ...", file=sys.stderr, flush=True)
            theirs = llama_bench(bench, path, ns.contexts, ns.new_tokens, threads, ns.repeats)
        repack = theirs["decode"]["repack"] if theirs else 0
        print(f"[bench model] {name}: load to first token, cold and warm ...", file=sys.stderr, flush=True)
        first = _first_tokens(path, bench, threads, repack)
        results.append({"shape": name, "label": LLAMA_SHAPES[name].label, "file": str(path),
                        "file_bytes": path.stat().st_size, "gqa": ours, "llama.cpp": theirs, "first_token": first,
                        "fixed_overhead_mib": overhead, "load_avg": os.getloadavg()})  # fmt: skip
    return {"threads": threads, "results": results}


def _ratio(a: float | None, b: float | None, higher_better: bool = True) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x" if higher_better else f"{b / a:.2f}x"


def shapes_table(payload: dict, read_gbps: float | None) -> str:
    """Markdown: a table per shape, a row per measurement, gqa beside llama.cpp and their ratio (speed-up: above 1
    is gqa ahead, for times too)."""
    parts = []
    for r in payload["results"]:
        ours, theirs, first = r["gqa"], r["llama.cpp"], r["first_token"]
        mib = r["file_bytes"] / 2**20
        lines = [f"**{r['shape']}** ({r['label']}), {r['file']}: {mib:,.0f} MiB; load average "
                 f"{' '.join(f'{x:.2f}' for x in r['load_avg'])}", "",
                 "| measurement | gqa | llama.cpp | gqa vs llama.cpp |", "|---|---:|---:|---:|"]  # fmt: skip
        row0 = ours["rows"][0]
        their_tg = theirs["decode"] if theirs else None
        share = ceiling_share(row0, read_gbps)
        ceiling = "" if share is None else f" ({share:.0%} of the {read_gbps:.0f} GB/s ceiling)"
        lines.append(
            f"| decode tok/s (gqa after {row0['context']} tokens; llama.cpp tg{ours['rows'][0]['new_tokens']}) | "
            f"{row0['decode_tok_s']:.2f}{ceiling} | {_fmt(their_tg)} | "
            f"{_ratio(row0['decode_tok_s'], their_tg and their_tg['tok_s'])} |"
        )
        for row in ours["rows"]:
            tp = theirs["prefill"].get(row["context"]) if theirs else None
            lines.append(f"| prompt processing {row['context']} tok/s | {row['prefill_tok_s']:.1f} | {_fmt(tp)} | "
                         f"{_ratio(row['prefill_tok_s'], tp and tp['tok_s'])} |")  # fmt: skip
        for when in ("warm", "cold"):
            a = first["gqa"][when]["wall_s"]
            b = first.get("llama.cpp", {}).get(when, {}).get("wall_s")
            cached = first["gqa"][when].get("cached_before_bytes")
            note = f"; {cached / 2**20:.0f} MiB cached before" if cached is not None else ""
            lines.append(f"| load to first token, {when} page cache{note} (s) | {a:.2f} | "
                         f"{'-' if b is None else f'{b:.2f}'} | {_ratio(a, b, higher_better=False)} |")  # fmt: skip
            inner = first["gqa"][when].get("in_process_s")
            if inner is not None:  # what is gqa's own: the process less python's start and import torch
                lines.append(f"| ... of which import gqa + load + first token, {when} (s) | {inner:.2f} | - | "
                             f"{_ratio(inner, b, higher_better=False)} |")  # fmt: skip
        their_rss = theirs["peak_rss_mib"] if theirs else None
        lines.append(f"| peak RSS MiB (benchmark process) | {ours['process_peak_rss_mib']:,.0f} | "
                     f"{'-' if their_rss is None else f'{their_rss:,.0f}'} | - |")  # fmt: skip
        for when in ("warm",):
            a = first["gqa"][when]["peak_rss_mib"]
            b = first.get("llama.cpp", {}).get(when, {}).get("peak_rss_mib")
            lines.append(f"| peak RSS MiB (load + {FIRST_PROMPT}-token prompt) | {a:,.0f} | "
                         f"{'-' if b is None else f'{b:,.0f}'} | - |")  # fmt: skip
        budget = mib * 1.1 + r["fixed_overhead_mib"]
        lines += ["", f"Peak RSS target (file + 10% + the runtime's fixed {r['fixed_overhead_mib']:.0f} MiB: "
                  f"`import torch` + the kernels): {budget:,.0f} MiB."]  # fmt: skip
        if theirs:
            lines.append(f"llama.cpp: `{theirs['command']}` (repack per row: the faster of 0 and 1).")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def _fmt(row: dict | None) -> str:
    return "-" if not row else f"{row['tok_s']:.2f} (repack {row['repack']})"
