"""``gqa bench model --tp 1 2 3``: the model decoded by 1, 2, 3 ... tensor-parallel ranks, side by side in one run.

Per ``tp`` (each a fresh launch of ``tp`` local gloo processes, ``cores / tp`` threads each; ``tp`` 1 is the plain
model in one process) and KV cache type (``--kv-cache-dtypes``: each rank's caches hold its KV heads in that type):
prefill and decode tokens/s at batch 1 (eager, greedy, ``--new-tokens`` per context), each rank's weight bytes and
KV-cache bytes per token (counted in its caches), and the share of decode time rank 0 spends in its all-reduces (two
per layer per token; the wait for slower ranks included, so an unbalanced split shows there).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

__all__ = ["run_tp", "tp_rank", "tp_table"]


def tp_rank(path: str | None, dtype_name: str, kv: str, contexts: list[int], new_tokens: int) -> dict:
    """One rank's measurements (run on every rank of a launch, or alone for tp 1), its caches storing ``kv``."""
    import torch.distributed as dist

    from ...decoding.steps import select_step
    from ...kernels import available, ops
    from ...loaders.model import load_model
    from ...parallel.tensor_parallel import ReducingLinear
    from .worker import DTYPES, cache_bytes_per_token, prompt

    def reduce_seconds() -> float:  # the all-reduces inside the one native call
        return ops.reduce_seconds() if available() else 0.0

    sharded = dist.is_initialized() and dist.get_world_size() > 1  # tp 1: the plain model
    dtype = DTYPES[dtype_name]
    model = load_model(path, dtype=dtype, tokenizer=False, tensor_parallel=sharded, kv_dtype=kv)
    cfg = model.config
    ReducingLinear.timed = True
    rows = []
    with torch.inference_mode():
        for context in contexts:
            ids = torch.tensor([prompt(context, cfg.vocab_size)])
            model(ids[:, :8], caches=model.new_caches(1, 16))  # warm-up
            caches = model.new_caches(1, context + new_tokens)
            start = time.perf_counter()
            logits = model(ids, caches=caches, last_only=True)
            prefill = time.perf_counter() - start
            ReducingLinear.seconds, reduced = 0.0, reduce_seconds()
            steps = []
            step = select_step(model, caches)
            for _ in range(new_tokens):
                start = time.perf_counter()
                logits = step(logits[:, -1].argmax(-1, keepdim=True), caches)
                steps.append(time.perf_counter() - start)
            rows.append({
                "context": context, "prefill_tok_s": context / prefill, "decode_tok_s": 1 / statistics.median(steps),
                "allreduce_share": (ReducingLinear.seconds + reduce_seconds() - reduced) / sum(steps),
            })  # fmt: skip
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied head counted once
    return {
        "rank": dist.get_rank() if sharded else 0,
        "heads": [cfg.num_heads, cfg.num_kv_heads],
        "weight_bytes": weights,
        "kv_bytes_per_token": cache_bytes_per_token(model.new_caches(1, 1)),
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def run_tp(ns: argparse.Namespace, tps: list[int], skipped: dict) -> list[dict]:
    """Every ``tp`` of ``tps`` for each dtype of ``ns.dtypes`` and KV cache type of ``ns.kv_cache_dtypes``, one
    launch each: a result per (dtype, KV cache type, tp); the combinations not run noted in ``skipped``."""
    from ...loaders import read_config
    from ...parallel.distributed import launch_local
    from ...parallel.tensor_parallel import check_tp
    from .kv_caches import kv_runs

    cfg = read_config(ns.model)
    for tp in tps:
        check_tp(cfg.num_heads, cfg.num_kv_heads, tp)  # all of them, before the first launch
    results = []
    for dtype in ns.dtypes:
        for kv, kind in kv_runs("gqa", dtype, ns.kv_cache_dtypes, skipped):
            for tp in tps:
                print(f"[bench model] tp={tp}, {dtype}, {kv} KV cache, contexts {ns.contexts} ...", file=sys.stderr,
                      flush=True)  # fmt: skip
                ranks = launch_local(tp, tp_rank, ns.model, dtype, kv, ns.contexts, ns.new_tokens)  # tp 1: a process
                results.append({"tp": tp, "dtype": dtype, "kv_dtype": kind.name,
                                "ranks": [ranks[r] for r in sorted(ranks)]})  # fmt: skip
    return results


def tp_table(results: list[dict]) -> str:
    """Markdown: a row per (dtype, KV cache type, tp, context) with rank 0's speeds, all-reduce share and every rank's
    bytes."""
    lines = [
        "| dtype | KV cache | tp | context | prefill tok/s | decode tok/s | vs tp 1 | all-reduce share of decode | "
        "heads per rank (q/kv) | weights per rank | KV cache per token per rank |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    base = {(r["dtype"], r.get("kv_dtype"), row["context"]): row["decode_tok_s"] for r in results if r["tp"] == 1
            for row in r["ranks"][0]["rows"]}  # fmt: skip
    for r in results:
        ranks = r["ranks"]
        heads = " ".join(f"{q}/{kv}" for q, kv in (x["heads"] for x in ranks))
        weights = " ".join(f"{x['weight_bytes'] / 2**20:.0f}" for x in ranks) + " MiB"
        kv = " ".join(f"{x['kv_bytes_per_token'] / 1024:.1f}" for x in ranks) + " KiB"
        for row in ranks[0]["rows"]:
            one = base.get((r["dtype"], r.get("kv_dtype"), row["context"]))
            ratio = f"{row['decode_tok_s'] / one:.2f}x" if one else "-"
            share = f"{row['allreduce_share']:.0%}" if r["tp"] > 1 else "-"
            lines.append(
                f"| {r['dtype']} | {r.get('kv_dtype', '-')} | {r['tp']} | {row['context']} | "
                f"{row['prefill_tok_s']:.0f} | {row['decode_tok_s']:.1f} | {ratio} | {share} | {heads} | {weights} | "
                f"{kv} |"
            )
    return "\n".join(lines)
