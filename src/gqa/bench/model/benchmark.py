"""Whole-model benchmark: KV-cache size, prefill and decode tokens/s of gqa vs HF transformers on the same weights,
for the model as MHA, GQA and MQA.

The source model (default: the embedded SmolLM2-135M-Instruct, 9 query / 3 KV heads) is run with each KV head count
of ``--kv-heads`` (default: ``H_q``, its own ``H_kv`` and 1 — for SmolLM2, MHA 9, GQA 3, MQA 1). Other counts are
made with ``gqa.convert`` into a temporary folder: more heads by exact expansion (the same model), fewer by the GQA
paper's mean-pooling (speed does not depend on the weights: generation never stops early). Every (head count, dtype,
KV cache dtype, engine) runs in its own subprocess (``gqa.bench.model.worker``), one after another, so each peak RSS
is its own. ``--kv-cache-dtypes auto q8_0 q4_0`` runs each with a float cache and with llama.cpp's blocks; an engine
that cannot hold a cache type is skipped with a note in the report. Run ``gqa bench model --help`` for the flags.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from ...cache.kv_dtypes import kv_bytes_per_token as kind_bytes_per_token
from ...loaders import read_config, resolve_model_path
from ...models.config import ModelConfig
from ...options.common import model_label
from .. import write_json_atomic, write_text_atomic
from ..attention.report import machine_description
from .arguments import CPU_CONTEXTS, CPU_ENGINES, DESCRIPTION, FILE_BLOCKS, add_arguments
from .kv_caches import check_kv_dtypes, kv_runs
from .report import check_plotting, plot_model, skipped_note, table
from .worker import DTYPES, gguf_format


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def default_kv_heads(num_heads: int, num_kv_heads: int) -> list[int]:
    """MHA, the model's own count and MQA, largest first, without repeats."""
    return sorted({num_heads, num_kv_heads, 1}, reverse=True)


def _head_counts(cfg: ModelConfig, kv_heads: list[int] | None) -> list[int]:
    """``kv_heads`` without repeats (default ``default_kv_heads``), each one checked against ``cfg``."""
    from ...convert import check_kv_heads

    counts = default_kv_heads(cfg.num_heads, cfg.num_kv_heads) if kv_heads is None else list(dict.fromkeys(kv_heads))
    for n in counts:
        check_kv_heads(cfg, n, "mean")
    return counts


def _variants(src: str | None, cfg: ModelConfig, counts: list[int], folder: Path) -> dict[int, str | None]:
    """Per head count, the model to run: ``src`` itself for its own count (``None``: the embedded model), else a
    conversion of it written into ``folder``."""
    from ...convert import convert

    paths: dict[int, str | None] = {}
    for n in counts:
        if n == cfg.num_kv_heads:
            paths[n] = src
            continue
        print(f"[bench model] converting to {n} KV heads ...", file=sys.stderr, flush=True)
        paths[n] = str(convert(src, folder / f"kv{n}", kv_heads=n, method="mean", progress=False))
    return paths


def _run_worker(path: str | None, engine: str, dtype: str, contexts: list[int], new_tokens: int, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "gqa.bench.model.worker", engine, "--dtype", dtype, "--new-tokens", str(new_tokens),
           "--contexts", *map(str, contexts), *extra]  # fmt: skip
    if path is not None:
        cmd += ["--model", path]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        raise RuntimeError(f"benchmark worker {engine} {dtype} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``gqa bench model``."""
    from ...options.common import HelpFormatter

    parser = argparse.ArgumentParser(prog="gqa bench model", description=DESCRIPTION, formatter_class=HelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    return run(parser, parser.parse_args(argv))


def run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    """The benchmark on flags ``parser`` (``build_parser`` or ``add_arguments``'s parser) has parsed."""
    if ns.window_caches and (ns.device != "cpu" or ns.tp is not None):
        parser.error("--window-caches runs on the CPU at batch 1 (no --device, --tp)")
    ns.kv_cache_dtypes = list(dict.fromkeys(ns.kv_cache_dtypes))
    if ns.kv_cache_dtypes != ["auto"] and (ns.window_caches or ns.device != "cpu"):
        parser.error("--kv-cache-dtypes: --window-caches and --device cuda run float caches (auto) only")
    if ns.device != "cpu":
        from .cuda import run as run_cuda

        return run_cuda(parser, ns)
    if ns.shapes is not None:
        return _run_shapes(parser, ns)
    if ns.engines is None:
        ns.engines = list(CPU_ENGINES)
    if "hf-static-compile" in ns.engines:
        parser.error("--engines hf-static-compile runs with --device cuda (transformers compiles it on CUDA only)")
    if ns.contexts is None:
        ns.contexts = [512] if ns.tp else [4096, 16384] if ns.window_caches else [128, 1024, 4096]
    if ns.quick:
        ns.contexts, ns.new_tokens, ns.dtypes = [64, 256], 8, ["fp32"]
        ns.engines = [e for e in ns.engines if e != "gqa-compile"] or ["gqa"]
    if ns.new_tokens < 2:
        parser.error("--new-tokens must be >= 2")
    if min(ns.contexts) < 1:
        parser.error(f"--contexts must be positive, got {ns.contexts}")
    if ns.kv_heads is not None and min(ns.kv_heads) < 1:
        parser.error(f"--kv-heads must be positive, got {ns.kv_heads}")
    if ns.plot is not None:
        check_plotting()  # fail before the long part
    if not ns.window_caches:
        check_kv_dtypes(parser, ns.kv_cache_dtypes, read_config(ns.model))

    if ns.tp is not None:
        return _run_tp(parser, ns)
    if ns.window_caches:
        from .window_caches import run_window_caches

        if ns.model is not None or ns.batch is not None or ns.kv_heads is not None or ns.repeats < 1:
            parser.error("--window-caches runs its own model at batch 1 (no --model, --batch, --kv-heads); "
                         "--repeats >= 1")  # fmt: skip
        started = time.perf_counter()
        args, rows, config, text = run_window_caches(parser, ns)
        ns.model = "Gemma-3-1B-like random model"
        _report(ns, _payload("model-window-caches", ns, started, args, rows, config=config), text)
        return 0
    if ns.kv_budget is not None and (ns.batch is None or ns.kv_budget <= 0):
        parser.error("--kv-budget needs --batch and a positive size in GiB")
    if ns.batch is not None and min(ns.batch) < 1:
        parser.error(f"--batch must be positive, got {ns.batch}")
    started = time.perf_counter()
    cfg = read_config(ns.model)  # no weights here: the conversions and the workers load their own
    counts = _head_counts(cfg, ns.kv_heads)
    heads = f"{cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads"
    print(f"[bench model] {model_label(ns.model)} ({heads}) as {' '.join(map(str, counts))} KV heads; each run "
          "loads the model in its own process", file=sys.stderr, flush=True)  # fmt: skip
    if max(ns.contexts) + ns.new_tokens > cfg.max_position_embeddings:
        parser.error(f"--contexts {max(ns.contexts)} + --new-tokens {ns.new_tokens} exceeds the model's "
                     f"max_position_embeddings {cfg.max_position_embeddings}")  # fmt: skip
    if ns.batch is not None:
        return _run_throughput(ns, cfg, counts, started)
    if FILE_BLOCKS in ns.dtypes and resolve_model_path(ns.model).suffix.lower() != ".gguf":
        parser.error(f"--dtypes {FILE_BLOCKS} runs a GGUF file's own tensors: --model must be a GGUF file")
    engines = list(ns.engines)
    own_format = gguf_format(ns.model) if "llama.cpp" in engines else None
    if "llama.cpp" in engines and (own_format is None or not llama_cpp_available()):
        why = "llama-cpp-python is not installed (make llama-cpp)" if own_format else "the model is no quantized GGUF"
        print(f"[bench model] skipping llama.cpp: {why}", file=sys.stderr, flush=True)
        engines.remove("llama.cpp")
    results, skipped = [], {}
    read_gbps = [read_bandwidth()]  # the ceiling a decode step's bytes are measured against, at the start and end
    with tempfile.TemporaryDirectory(prefix="gqa-bench-model-") as tmp:
        paths = _variants(ns.model, cfg, counts, Path(tmp))
        for n, path in paths.items():
            for dtype in ns.dtypes:
                for engine in engines:
                    if not _applies(engine, dtype, path == ns.model and n == cfg.num_kv_heads, own_format):
                        continue
                    for kv, kind in kv_runs(engine, dtype, ns.kv_cache_dtypes, skipped):
                        print(f"[bench model] {n} KV heads, {engine} {dtype}, {kv} KV cache, contexts {ns.contexts} "
                              "...", file=sys.stderr, flush=True)  # fmt: skip
                        greedy = ("--greedy",) if dtype in (own_format, FILE_BLOCKS) and path == ns.model else ()
                        r = _run_worker(path, engine, dtype, ns.contexts, ns.new_tokens, "--kv-cache-dtype", kv,
                                        *greedy)  # fmt: skip
                        per_token = kind_bytes_per_token(cfg.num_layers, n, cfg.head_dim, kind)
                        # a gqa worker's own count (its caches' bytes) replaces the formula's
                        results.append({"kv_heads": n, "kv_dtype": kind.name, "kv_bytes_per_token": per_token} | r)
    read_gbps.append(read_bandwidth())
    args = {"kv_heads": list(paths), "contexts": ns.contexts, "dtypes": ns.dtypes,
            "kv_cache_dtypes": ns.kv_cache_dtypes, "engines": engines, "new_tokens": ns.new_tokens}  # fmt: skip
    payload = _payload("model", ns, started, args, results, read_gbps=max(read_gbps), config=cfg.as_dict(),
                       skipped=list(skipped))  # fmt: skip
    header = (
        f"Model benchmark ({payload['model']}, {cfg.num_heads} query heads), batch 1, {ns.new_tokens} new tokens "
        f"per context; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    slow = sorted({f"{r['engine']} {r['dtype']}" for r in results if r["engine"] != "hf" and not r["native_kernels"]})
    if slow:  # the PyTorch fallback is correct but not what the numbers are meant to show
        header += (f"\nWARNING: gqa's native kernels were not loaded in {', '.join(slow)} (build them: "
                   "python -m gqa.kernels); those rows measure the PyTorch fallback")  # fmt: skip
    _report(ns, payload, header + "\n\n" + table(payload))
    if ns.plot:
        plot_model(payload, ns.plot)
    return 0


def read_bandwidth() -> float:
    """This machine's read bandwidth now, GB/s: ``x.sum()`` over 1 GiB of float32, all threads (``bench.limits``)."""
    from ..attention.limits import _bandwidth

    return _bandwidth(torch.device("cpu"), 2**30, 5, {})[0]


def _applies(engine: str, dtype: str, original: bool, own_format: str | None) -> bool:
    """HF runs float dtypes; llama.cpp runs the original GGUF in its own format only; the file's own tensors
    (``gguf``) are the original model's."""
    if engine == "hf":
        return dtype in DTYPES
    if engine == "llama.cpp":
        return original and dtype in (own_format, FILE_BLOCKS)
    return original or dtype != FILE_BLOCKS


def _run_throughput(ns: argparse.Namespace, cfg: ModelConfig, counts: list[int], started: float) -> int:
    """Decode throughput at ``--batch`` sizes (and the ``--kv-budget`` batch) per KV head count, dtype, context."""
    from .report import plot_throughput, throughput_table

    results, skipped = [], {}
    with tempfile.TemporaryDirectory(prefix="gqa-bench-model-") as tmp:
        paths = _variants(ns.model, cfg, counts, Path(tmp))
        for n, path, dtype in ((n, p, d) for n, p in paths.items() for d in ns.dtypes):
            for kv, kind in kv_runs("gqa", dtype, ns.kv_cache_dtypes, skipped):
                per_token = kind_bytes_per_token(cfg.num_layers, n, cfg.head_dim, kind)
                for context in ns.contexts:
                    batches = list(ns.batch)
                    fits = None
                    if ns.kv_budget is not None:
                        fits = int(ns.kv_budget * 2**30 // (per_token * (context + ns.new_tokens)))
                        batches = sorted({*batches, fits} - {0})
                    print(f"[bench model] throughput: {n} KV heads, {dtype}, {kv} KV cache, context {context}, batch "
                          f"{batches} ...", file=sys.stderr, flush=True)  # fmt: skip
                    r = _run_worker(path, "gqa", dtype, [context], ns.new_tokens, "--kv-cache-dtype", kv, "--batch",
                                    *map(str, batches))  # fmt: skip
                    for row in r["rows"]:
                        row["fits_budget"] = row["batch"] == fits
                    results.append({"kv_heads": n, "kv_dtype": kind.name, "kv_bytes_per_token": per_token,
                                    "budget_batch": fits} | r)  # fmt: skip
    args = {"kv_heads": counts, "contexts": ns.contexts, "dtypes": ns.dtypes, "kv_cache_dtypes": ns.kv_cache_dtypes,
            "batch": ns.batch, "kv_budget_gib": ns.kv_budget, "new_tokens": ns.new_tokens}  # fmt: skip
    payload = _payload("model-throughput", ns, started, args, results, config=cfg.as_dict(), skipped=list(skipped))
    header = (
        f"Decode throughput ({payload['model']}, {cfg.num_heads} query heads), {ns.new_tokens} steps per point, "
        f"caches filled to the context; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    _report(ns, payload, header + "\n\n" + throughput_table(payload))
    if ns.plot:
        plot_throughput(payload, ns.plot)
    return 0


def _run_shapes(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from .random_files import LLAMA_SHAPES
    from .shapes import run_shapes, shapes_table

    if ns.model is not None or ns.tp or ns.batch or ns.window_caches or ns.kv_heads or ns.engines:
        parser.error("--shapes on the CPU runs its own files with gqa and llama.cpp: no --model, --tp, --batch, "
                     "--window-caches, --kv-heads, --engines")  # fmt: skip
    if not set(ns.shapes) <= set(LLAMA_SHAPES):
        parser.error(f"--shapes on the CPU: {', '.join(s for s in LLAMA_SHAPES if s != 'tiny')} (smollm2 is the "
                     "default --model)")  # fmt: skip
    ns.contexts = ns.contexts or list(CPU_CONTEXTS)
    if min(ns.contexts) < 1 or ns.new_tokens < 2 or ns.repeats < 1:
        parser.error("--contexts must be positive, --new-tokens >= 2, --repeats >= 1")
    started = time.perf_counter()
    read_gbps = read_bandwidth()
    ns.shapes = list(dict.fromkeys(ns.shapes))
    out = run_shapes(ns)
    args = {"shapes": ns.shapes, "contexts": ns.contexts, "new_tokens": ns.new_tokens, "repeats": ns.repeats}
    ns.model = ", ".join(f"random {s}" for s in ns.shapes)
    payload = _payload("model-shapes", ns, started, args, out["results"], read_gbps=read_gbps)
    header = (f"Random Llama-shaped Q4_K_M files, gqa vs llama.cpp on the same file, batch 1, {out['threads']} "
              f"threads, {ns.new_tokens} new tokens; torch {torch.__version__}")  # fmt: skip
    _report(ns, payload, header + "\n\n" + shapes_table(payload, read_gbps))
    return 0


def _run_tp(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from .tensor_parallel import run_tp, tp_table

    if min(ns.tp) < 1:
        parser.error(f"--tp must be positive, got {ns.tp}")
    if ns.plot is not None or ns.kv_heads is not None or ns.engines != list(CPU_ENGINES):
        parser.error("--tp runs the model as it is, eager: --plot, --kv-heads and --engines do not apply")
    started = time.perf_counter()
    tps = list(dict.fromkeys(ns.tp))
    skipped: dict = {}
    results = run_tp(ns, tps, skipped)
    args = {"tp": tps, "contexts": ns.contexts, "dtypes": ns.dtypes, "kv_cache_dtypes": ns.kv_cache_dtypes,
            "new_tokens": ns.new_tokens}  # fmt: skip
    payload = _payload("model-tp", ns, started, args, results, skipped=list(skipped))
    cores = os.cpu_count()
    header = (
        f"Tensor-parallel decode ({payload['model']}), batch 1, eager, {ns.new_tokens} new tokens per context; "
        f"{cores} cores, cores / tp threads per rank; gloo all-reduces; torch {torch.__version__}"
    )
    note = skipped_note(payload)
    _report(ns, payload, header + "\n\n" + tp_table(results) + ("\n\n" + note if note else ""))
    return 0


def _payload(kind: str, ns: argparse.Namespace, started: float, args: dict, results: list, **extra: object) -> dict:
    """The JSON of a run: what ran, where, when, with which arguments, and its results."""
    return {
        "benchmark": kind,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_description(torch.device("cpu")),
        "model": ns.model or "embedded SmolLM2-135M-Instruct",
        **extra,
        "args": args,
        "elapsed_s": time.perf_counter() - started,
        "results": results,
    }


def _report(ns: argparse.Namespace, payload: dict, text: str) -> None:
    """Print the table; write the JSON and markdown files asked for."""
    print(text)
    if ns.json:
        write_json_atomic(ns.json, payload)
    if ns.markdown:
        write_text_atomic(ns.markdown, text + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
