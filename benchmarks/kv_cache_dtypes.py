"""The quantized KV cache side by side with the float one, in one run on one machine (issue 70's targets).

    python benchmarks/kv_cache_dtypes.py speed   [--model M] [--contexts 4096 8192] [--kv auto q8_0 q4_0]
    python benchmarks/kv_cache_dtypes.py quality [--model M] [--window 2048] [--kv q8_0 q4_0]
    python benchmarks/kv_cache_dtypes.py capacity [--kv-cache-mib 64] [--clients 16 32] [--prompt-tokens 1536]

speed: greedy decode tok/s of one sequence after ``context`` tokens, through the step ``gqa generate`` takes (the
native one-call step on CPU), each kv dtype's caches filled to the context with the blocks of random keys/values
(decode time does not depend on their values; a real 8k-token prefill per point would take minutes), the dtypes
alternating within each round and the medians of ``--rounds`` rounds reported; the bytes a step reads (weights + the
KV cache) beside each. quality: perplexity of the model with each kv dtype and its mean KL from the same model with
its float (bf16) cache, over ``--window``-token windows of the repository's texts (CPython's LICENSE.txt, gqa's
encyclopedia text, README.md). capacity: ``gqa serve``'s engine at a fixed ``--kv-cache-mib``: the tokens and
sequences each kv dtype's pool admits, and the tok/s of ``--clients`` concurrent greedy requests with long prompts.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import gqa
from gqa.cache.quantize import quantize

ROOT = Path(__file__).resolve().parents[1]


def fill(caches: list, context: int, g: torch.Generator) -> None:
    """Each cache holds ``context`` tokens of random K/V (stored as its kinds store them)."""
    for cache in caches:
        for buf, kind, width in ((cache.key, cache.kinds[0], cache.head_dim), (cache.value, cache.kinds[1],
                                                                                cache.value_dim)):  # fmt: skip
            rows = torch.randn(*buf.shape[:2], context, width, generator=g).to(cache.dtype)
            buf[:, :, :context] = quantize(rows, kind) if kind.quantized else rows
        cache.cursor.fill_(context)


def speed(ns: argparse.Namespace) -> list[dict]:
    from gqa.decoding.steps import select_step
    from gqa.models.quantized import weight_bytes

    model = gqa.load_model(ns.model, dtype="auto", tokenizer=False)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    weights = sum(weight_bytes(model).values())
    results = []
    with torch.inference_mode():
        for context in ns.contexts:
            if context + ns.new > cfg.max_position_embeddings:
                print(f"context {context} + {ns.new} exceeds the model's {cfg.max_position_embeddings}: skipped")
                continue
            caches = {kv: model.new_caches(1, context + ns.new, kv_dtype=kv_choice(kv)) for kv in ns.kv}
            times: dict[str, list[float]] = {kv: [] for kv in ns.kv}
            for _ in range(ns.rounds):
                for kv in ns.kv:  # alternating: the machine's noise falls on every dtype alike
                    fill(caches[kv], context, g)
                    step = select_step(model, caches[kv])
                    tokens = torch.tensor([[11]])
                    stamps = [time.perf_counter()]
                    for _ in range(ns.new):
                        tokens = step(tokens, caches[kv])[:, -1].argmax(-1, keepdim=True)
                        stamps.append(time.perf_counter())
                    times[kv].append(statistics.median(b - a for a, b in itertools.pairwise(stamps)))
            base = statistics.median(times[ns.kv[0]])
            for kv in ns.kv:
                t = statistics.median(times[kv])
                kv_bytes = sum(c.key[:, :, :context].nbytes + c.value[:, :, :context].nbytes for c in caches[kv])
                row = dict(context=context, kv=kv, step=caches[kv][0].kinds[0].name, tok_s=1 / t,
                           vs_first=base / t, kv_mib=kv_bytes / 2**20, step_bytes=weights + kv_bytes,
                           rounds=[1 / x for x in times[kv]])  # fmt: skip
                results.append(row)
                print(f"{context:>6} {kv:>5}: {1 / t:7.1f} tok/s  x{base / t:.2f} vs {ns.kv[0]}  "
                      f"KV {kv_bytes / 2**20:6.1f} MiB, weights {weights / 2**20:.1f} MiB", flush=True)  # fmt: skip
            del caches
    return results


def texts() -> list[tuple[str, str]]:
    """The repository's texts, and all of them joined (``--text-file`` writes that one out, for llama-perplexity:
    it takes a file of at least two 2k-token windows)."""
    from gqa.evaluation.perplexity import default_eval_text

    text, description = default_eval_text()
    out = [(description, text)]
    out.append(("gqa's encyclopedia text", (ROOT / "src/gqa/data/encyclopedia.txt").read_text()))
    out.append(("README.md", (ROOT / "README.md").read_text()))
    return [("all three, joined", "".join(t for _, t in out)), *out]


def kv_choice(name: str) -> str | tuple[str, str]:
    """``q8_0`` or ``K/V`` (``q8_0/q4_0``: llama.cpp's ``-ctk q8_0 -ctv q4_0``)."""
    return tuple(name.split("/")) if "/" in name else name  # type: ignore[return-value]


def quality(ns: argparse.Namespace) -> list[dict]:
    from gqa.evaluation.perplexity import _score

    base = gqa.load_model(ns.model, dtype="auto")
    tok = base.tokenizer
    results = []
    for name, text in texts()[: 1 if ns.joined_only else None]:
        if ns.text_file is not None and name.startswith("all"):
            ns.text_file.write_text(text)
        ids = torch.tensor(tok.encode(text))
        ppl = {}
        for kv in ns.kv:
            model = gqa.load_model(ns.model, dtype="auto", tokenizer=False, kv_dtype=kv_choice(kv))
            nll, kl, n = _score(model, ids, ns.window, ns.window // 2, reference=base)
            ppl[kv] = (float(torch.tensor(nll / n).exp()), kl / n)
        nll0, _, n0 = _score(base, ids, ns.window, ns.window // 2)
        p0 = float(torch.tensor(nll0 / n0).exp())
        for kv, (p, kl) in ppl.items():
            row = dict(text=name, tokens=len(ids), kv=kv, perplexity=p, base_perplexity=p0, change=p / p0 - 1, kl=kl)
            results.append(row)
            print(f"{name[:28]:<28} {len(ids):>6} tok  {kv:>5}: ppl {p:8.4f} vs {p0:8.4f} ({100 * (p / p0 - 1):+.3f}%) "
                  f"KL {kl:.5f}", flush=True)  # fmt: skip
    return results


def capacity(ns: argparse.Namespace) -> list[dict]:
    from gqa.serve.engine import Engine
    from gqa.serve.sampling import SamplingParams

    model = gqa.load_model(ns.model, dtype="auto")
    g = torch.Generator().manual_seed(0)
    results = []
    for clients in ns.clients:
        prompts = [torch.randint(100, 20000, (ns.prompt_tokens,), generator=g).tolist() for _ in range(clients)]
        for kv in ns.kv:
            engine = Engine(model, model.tokenizer, kv_cache_mib=ns.kv_cache_mib, kv_cache_dtype=kv_choice(kv),
                            max_running=clients, prefill_chunk=256)  # fmt: skip
            tokens = engine.blocks.num_blocks * engine.blocks.block_size
            fits = tokens // (ns.prompt_tokens + ns.new)
            params = SamplingParams(max_tokens=ns.new, temperature=0.0, ignore_eos=True)
            for p in prompts:
                engine.add(p, params)
            start, produced, peak = time.perf_counter(), 0, 0
            while engine.has_work:
                outs = engine.step()
                produced += sum(len(o.token_ids) for o in outs)
                peak = max(peak, engine.stats().running)
            wall = time.perf_counter() - start
            row = dict(clients=clients, kv=kv, pool_tokens=tokens, sequences_fit=fits, peak_running=peak,
                       tok_s=produced / wall, wall_s=wall)  # fmt: skip
            results.append(row)
            print(f"{clients:>3} clients {kv:>5}: pool {tokens:>6} tokens = {fits:>3} sequences of "
                  f"{ns.prompt_tokens}+{ns.new}; peak running {peak:>3}; {produced / wall:7.1f} tok/s "
                  f"({wall:.1f} s)", flush=True)  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["speed", "quality", "capacity"])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2)")
    parser.add_argument("--kv", nargs="+", default=None, help="kv dtypes, the first one the baseline")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 8000])
    parser.add_argument("--new", type=int, default=32, help="speed: decoded tokens per round; capacity: per client")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--kv-cache-mib", type=float, default=64.0)
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--prompt-tokens", type=int, default=1536)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--text-file", type=Path, default=None, help="quality: write the joined texts here")
    parser.add_argument("--joined-only", action="store_true", help="quality: the joined texts only")
    ns = parser.parse_args(argv)
    ns.kv = ns.kv or (["auto", "q8_0", "q4_0"] if ns.what != "quality" else ["q8_0", "q8_0/q4_0", "q4_0"])
    if ns.what == "capacity":
        ns.new = 16 if ns.new == 32 else ns.new
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {' '.join(sys.argv)}", flush=True)
    results = {"speed": speed, "quality": quality, "capacity": capacity}[ns.what](ns)
    if ns.json:
        ns.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
