"""One engine of ``gqa bench model`` in its own process: ``python -m gqa.bench.model_worker ENGINE ...`` prints one
JSON line — the engine, dtype, peak RSS and a row per context. Run by ``gqa.bench.model``, one process per (model,
engine, dtype), so that each one's peak memory (max RSS) is its own.

Engines:

* ``gqa`` — ``gqa.load_model``; decode steps through static KV caches, compiled with ``torch.compile``;
* ``gqa-eager`` — the same without compilation;
* ``hf`` — ``transformers`` ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (default SDPA attention) holding the very
  same tensors, driven by its own ``generate``.

Per context ``C``: prefill = one forward over a ``C``-token prompt (batch 1) that returns the last position's logits
(as generation needs); decode = one over the median time between consecutive new tokens (``N`` new tokens give ``N - 1``
intervals), from the wall-clock time at which each came out of generation (our ``generate_stream``; HF's
``streamer``); ``decode_mean_tok_s`` is ``(N - 1) / (t_N - t_1)``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import resource
import statistics
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ENGINES = ("gqa", "gqa-eager", "hf")


def prompt(context: int, vocab: int, seed: int = 0) -> list[int]:
    """``context`` random token ids in ``[10, vocab)``: the same prompt for every engine and model."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(10, vocab - 1), vocab, (context,), generator=g).tolist()


def run_gqa(path: str | None, dtype: torch.dtype, contexts: list[int], new: int, compiled: bool) -> tuple[int, list]:
    import gqa
    from gqa.generation import generate_stream

    model = gqa.load_model(path, dtype=dtype, tokenizer=False)
    step = torch.compile(lambda tok, caches: model(tok, caches=caches)) if compiled else None
    rows = []
    with torch.inference_mode():
        for context in contexts:
            ids = prompt(context, model.config.vocab_size)
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
    return model.config.num_kv_heads, rows


def run_hf(path: str | None, dtype: torch.dtype, contexts: list[int], new: int) -> tuple[int, list]:
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
        model.generate(torch.tensor([prompt(8, cfg.vocab_size)]), max_new_tokens=3, do_sample=False)  # warm up
        for context in contexts:
            ids = torch.tensor([prompt(context, cfg.vocab_size)])
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
    return model.config.num_key_value_heads, rows


class _Stamps:
    """An HF ``streamer`` that only records when each ``put`` (the prompt, then every new token) happens."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def _row(context: int, prefill: float, stamps: list[float]) -> dict:
    """``stamps``: the time each new token came out, the first one right after the prefill. Decode tokens/s is one
    over the median time between consecutive tokens (robust to a burst of other work on the machine); the mean rate
    over the whole span is kept beside it."""
    new = len(stamps)
    median = statistics.median(b - a for a, b in itertools.pairwise(stamps))
    return {
        "context": context,
        "new_tokens": new,
        "prefill_s": prefill,
        "decode_s": stamps[-1] - stamps[0],
        "prefill_tok_s": context / prefill,
        "decode_tok_s": 1.0 / median,
        "decode_mean_tok_s": (new - 1) / (stamps[-1] - stamps[0]),
    }


def peak_rss_mib() -> float:
    """This process's peak resident memory: ``VmHWM`` of ``/proc/self/status`` (Linux), which starts afresh at
    ``exec``; ``ru_maxrss`` does not — it keeps the parent's peak across ``fork`` + ``exec``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gqa.bench.model_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=ENGINES)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--contexts", type=int, nargs="+", required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    ns = parser.parse_args(argv)
    torch.manual_seed(0)
    dtype = DTYPES[ns.dtype]
    if ns.engine == "hf":
        kv_heads, rows = run_hf(ns.model, dtype, ns.contexts, ns.new_tokens)
    else:
        kv_heads, rows = run_gqa(ns.model, dtype, ns.contexts, ns.new_tokens, compiled=ns.engine == "gqa")
    peak_mib = peak_rss_mib()
    from gqa import kernels

    print(json.dumps({"engine": ns.engine, "dtype": ns.dtype, "model_kv_heads": kv_heads, "peak_rss_mib": peak_mib,
                      "native_kernels": kernels.available(), "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
