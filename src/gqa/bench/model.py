"""Whole-model benchmark: prefill and decode tokens/s of gqa vs HF transformers on the same weights.

Every (engine, dtype) pair runs in its own subprocess, one after another in one command, so that each one's peak
memory (max RSS) is its own. Engines:

* ``gqa`` — ``gqa.load_model``; decode steps through static KV caches, compiled with ``torch.compile``;
* ``gqa-eager`` — the same without compilation;
* ``hf`` — ``transformers`` ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (default SDPA attention) holding the very
  same tensors, driven by its own ``generate``.

Per context ``C``: prefill = one forward over a ``C``-token prompt (batch 1) that returns the last position's logits
(as generation needs); decode = ``(N - 1) / (t_N - t_1)`` for ``N`` new tokens, from the wall-clock time at which the
first and the last new token came out of generation (our ``generate_stream``; HF's ``streamer``). Run ``gqa bench
model --help`` for the flags.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from gqa.bench import write_json_atomic

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ENGINES = ("gqa", "gqa-eager", "hf")


def _prompt(context: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (context,), generator=g).tolist()


def _run_gqa(path: str | None, dtype: torch.dtype, contexts: list[int], new: int, compiled: bool) -> list[dict]:
    import gqa
    from gqa.generation import generate_stream

    model = gqa.load_model(path, dtype=dtype, tokenizer=False)
    step = None
    if compiled:
        compiled_forward = torch.compile(lambda tok, caches: model(tok, caches=caches))
        step = compiled_forward
    rows = []
    with torch.inference_mode():
        for context in contexts:
            ids = _prompt(context, model.config.vocab_size)
            if step is not None:  # compile (or re-specialise) for this cache size outside the timing
                model.generate(ids[:8], max_new_tokens=3, eos_token_ids=[], step_fn=step)
                caches = model.new_caches(1, context + new)
                model(torch.tensor([ids]), caches=caches, last_only=True)
                for _ in range(2):
                    step(torch.tensor([[ids[-1]]]), caches)
            start = time.perf_counter()
            model(torch.tensor([ids]), caches=model.new_caches(1, context + new), last_only=True)
            prefill = time.perf_counter() - start
            stamps = []
            for _ in generate_stream(model, [ids], max_new_tokens=new, eos_token_ids=[], step_fn=step):
                stamps.append(time.perf_counter())
            assert len(stamps) == new
            rows.append(_row(context, prefill, stamps))
    return rows


def _run_hf(path: str | None, dtype: torch.dtype, contexts: list[int], new: int) -> list[dict]:
    import transformers

    from gqa.loaders import read_model

    cfg, state = read_model(path)
    hf_config = transformers.AutoConfig.for_model(**cfg.to_hf())
    model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=dtype, attn_implementation="sdpa")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=not cfg.tie_word_embeddings)
    model.tie_weights()
    model.eval()
    rows = []
    with torch.inference_mode():
        model.generate(torch.tensor([_prompt(8, cfg.vocab_size)]), max_new_tokens=3, do_sample=False)  # warm up
        for context in contexts:
            ids = torch.tensor([_prompt(context, cfg.vocab_size)])
            start = time.perf_counter()
            model(ids, use_cache=True, logits_to_keep=1)
            prefill = time.perf_counter() - start
            streamer = _Stamps()
            out = model.generate(
                ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
                streamer=streamer,
            )  # fmt: skip
            assert out.shape[1] == context + new and len(streamer.stamps) == new + 1  # the prompt, then each token
            rows.append(_row(context, prefill, streamer.stamps[1:]))
    return rows


class _Stamps:
    """An HF ``streamer`` that only records when each ``put`` (the prompt, then every new token) happens."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _row(context: int, prefill: float, stamps: list[float]) -> dict:
    """``stamps``: the time each new token came out, the first one right after the prefill."""
    new = len(stamps)
    return {
        "context": context,
        "new_tokens": new,
        "prefill_s": prefill,
        "decode_s": stamps[-1] - stamps[0],
        "prefill_tok_s": context / prefill,
        "decode_tok_s": (new - 1) / (stamps[-1] - stamps[0]),
    }


def worker(ns: argparse.Namespace) -> int:
    """Run one engine in this process and print one JSON line."""
    torch.manual_seed(0)
    dtype = DTYPES[ns.dtype]
    if ns.engine == "hf":
        rows = _run_hf(ns.model, dtype, ns.contexts, ns.new_tokens)
    else:
        rows = _run_gqa(ns.model, dtype, ns.contexts, ns.new_tokens, compiled=ns.engine == "gqa")
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"engine": ns.engine, "dtype": ns.dtype, "peak_rss_mib": peak_mib, "rows": rows}))
    return 0


def _machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _table(results: list[dict], contexts: list[int]) -> str:
    lines = [
        "| dtype | context | engine | prefill tok/s | decode tok/s | decode vs hf | peak RSS MiB |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    by = {(r["engine"], r["dtype"]): r for r in results}
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        for i, context in enumerate(contexts):
            hf = by.get(("hf", dtype))
            hf_decode = hf["rows"][i]["decode_tok_s"] if hf else None
            for engine in ENGINES:
                r = by.get((engine, dtype))
                if r is None:
                    continue
                row = r["rows"][i]
                ratio = f"{row['decode_tok_s'] / hf_decode:.2f}x" if hf_decode else "-"
                lines.append(
                    f"| {dtype} | {context} | {engine} | {row['prefill_tok_s']:.0f} | {row['decode_tok_s']:.1f} | "
                    f"{ratio} | {r['peak_rss_mib']:.0f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gqa bench model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per context (default 32)")
    parser.add_argument("--quick", action="store_true", help="contexts 64 and 256, 8 new tokens, fp32, no compile")
    parser.add_argument("--json", type=Path, default=None, help="write every number and the machine here")
    parser.add_argument("--worker", choices=ENGINES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.quick:
        ns.contexts, ns.new_tokens, ns.dtypes = [64, 256], 8, ["fp32"]
        ns.engines = [e for e in ns.engines if e != "gqa"]
    if ns.new_tokens < 2:
        parser.error("--new-tokens must be >= 2")
    if ns.worker:
        ns.engine = ns.worker
        return worker(ns)

    results, started = [], time.perf_counter()
    for dtype in ns.dtypes:
        for engine in ns.engines:
            print(f"[bench model] {engine} {dtype} contexts {ns.contexts} ...", file=sys.stderr, flush=True)
            cmd = [sys.executable, "-m", "gqa.bench.model", "--worker", engine, "--dtype", dtype,
                   "--new-tokens", str(ns.new_tokens), "--contexts", *map(str, ns.contexts)]  # fmt: skip
            if ns.model:
                cmd += ["--model", str(ns.model)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"HF_HUB_OFFLINE": "1"})
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                raise RuntimeError(f"benchmark worker {engine} {dtype} failed (exit {proc.returncode})")
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    header = (
        f"SmolLM2-class model benchmark ({ns.model or 'embedded SmolLM2-135M-Instruct'}), batch 1, "
        f"{ns.new_tokens} new tokens per context; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(header + "\n\n" + _table(results, ns.contexts))
    if ns.json:
        write_json_atomic(ns.json, {
            "benchmark": "model",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": _machine(),
            "args": {"contexts": ns.contexts, "dtypes": ns.dtypes, "engines": ns.engines, "new_tokens": ns.new_tokens},
            "elapsed_s": time.perf_counter() - started,
            "results": results,
        })  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
