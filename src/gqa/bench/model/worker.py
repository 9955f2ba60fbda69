"""One engine of ``gqa bench model`` in its own process: ``python -m gqa.bench.model.worker ENGINE ...`` prints one
JSON line — the engine, dtype, peak RSS and a row per context. Run by ``gqa.bench.model.benchmark``, one process per
(model, engine, dtype), so that each one's peak memory (max RSS) is its own.

Engines:

* ``gqa`` — ``gqa.load_model`` and generation as a user gets it by default (on CPU the native decode step);
* ``gqa-compile`` — the same with ``compile=True`` (``torch.compile``; compiled outside the timing);
* ``hf`` — ``transformers`` ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` (default SDPA attention) holding the very
  same tensors, driven by its own ``generate``;
* ``llama.cpp`` — ``llama-cpp-python`` on the GGUF file itself (its own quantization; an optional extra).

Dtypes: ``fp32``, ``bf16``, or a block format (``q8_0``, ``q4_0``, ``q4_1``): the GGUF's own blocks when the file is
in that format, else the float weights quantized to it; activations in ``gqa.hardware.auto_dtype()``. The KV cache
(``--kv-cache-dtype``): ``auto`` (the activations' dtype; llama.cpp's default f16), or what
``gqa.load_model(kv_dtype=)`` takes (``q8_0``, ``q4_0``; llama.cpp the same type through ``type_k`` / ``type_v``);
gqa engines report the bytes a token takes in the caches they decoded with (``kv_bytes_per_token``).

Per context ``C``: prefill = one forward over a ``C``-token prompt (batch 1) that returns the last position's logits
(as generation needs); decode = one over the median time between consecutive new tokens (``N`` new tokens give ``N - 1``
intervals), from the wall-clock time at which each came out of generation (our ``generate_stream``; HF's
``streamer``); ``decode_mean_tok_s`` is ``(N - 1) / (t_N - t_1)``. With ``--batch``: decode throughput instead (see
``run_throughput``). ``--greedy``: also the greedy tokens of a few chat prompts (agreement between engines).
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

from gqa.bench.model.arguments import ENGINES, FILE_BLOCKS, FLOAT_DTYPES, QUANTIZED
from gqa.options.common import KV_CACHE_DTYPES
from gqa.options.dtypes import torch_dtype

DTYPES = {name: torch_dtype(name) for name in FLOAT_DTYPES}
GREEDY_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in one sentence.",
    "List three primary colours.",
    "What is 12 times 7?",
    "Who wrote Romeo and Juliet?",
)


def prompt(context: int, vocab: int, seed: int = 0) -> list[int]:
    """``context`` random token ids in ``[10, vocab)``: the same prompt for every engine and model."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(10, vocab - 1), vocab, (context,), generator=g).tolist()


def gguf_format(path: str | None) -> str | None:
    """The block format most of a GGUF file's layer weights are in (``"q4_1"``, ``"q4_k"`` ...), ``None`` for HF
    folders and float files."""
    from collections import Counter

    from gqa.loaders import resolve_model_path
    from gqa.loaders.gguf_meta import open_gguf

    file = resolve_model_path(path)
    if file.is_dir():
        return None
    kinds = Counter(t.type.name.lower() for t in open_gguf(file).tensors if t.name.startswith("blk."))
    name = kinds.most_common(1)[0][0]
    return None if name in ("f32", "f16", "bf16") else name


def load_gqa(path: str | None, dtype: str, kv: str = "auto"):
    """The model as ``gqa`` loads it for ``dtype`` (a float dtype, or a block format: see the module docstring), its
    KV caches storing ``kv`` (``load_model``'s ``kv_dtype``)."""
    import gqa

    if dtype not in QUANTIZED:
        return gqa.load_model(path, dtype=DTYPES[dtype], tokenizer=False, kv_dtype=kv)
    own = dtype == FILE_BLOCKS or gguf_format(path) == dtype
    quantize = None if own else dtype  # the file's own blocks, or float weights quantized
    return gqa.load_model(path, dtype="auto", tokenizer=False, quantize=quantize, kv_dtype=kv)


def cache_bytes_per_token(caches: list) -> int:
    """Bytes one token takes in ``caches`` (batch 1): each layer's K and V slot as the buffers store it (float
    values or blocks), a window cache's too."""
    return sum(c.nbytes // (c.key.shape[0] * c.key.shape[2]) for c in caches)


def run_gqa(
    model: torch.nn.Module, contexts: list[int], new: int, compiled: bool, repeats: int = 1
) -> tuple[int, list]:
    """Prefill and decode rows per context; ``repeats > 1``: the prefill's median over that many runs after an
    untimed one at the same length (warm, as llama-bench measures), else one run."""
    from gqa.decoding.generate import generate_stream
    from gqa.models.quantized import weight_bytes

    rows = []
    with torch.inference_mode():
        model.generate([5, 6, 7], max_new_tokens=3, eos_token_ids=[])  # first-call costs outside the timing
        for context in contexts:
            ids = prompt(context, model.config.vocab_size)
            if compiled:  # compile (or re-specialise) for this cache bucket outside the timing
                model.generate(ids, max_new_tokens=new, eos_token_ids=[], compile=True)
            times = []
            for _ in range(repeats + (repeats > 1)):
                caches = model.new_caches(1, context + new)
                start = time.perf_counter()
                model(torch.tensor([ids]), caches=caches, last_only=True)
                times.append(time.perf_counter() - start)
            prefill = statistics.median(times[-repeats:])
            stamps = []
            for _ in generate_stream(model, [ids], max_new_tokens=new, eos_token_ids=[], compile=compiled):
                stamps.append(time.perf_counter())
            assert len(stamps) == new
            # what one decoded token reads: every weight once, and the KV cache (as stored) at the context
            rows.append(_row(context, prefill, stamps) | {"kv_bytes": cache_bytes_per_token(caches) * context})
    weights = sum(weight_bytes(model).values())
    for row in rows:
        row["weight_bytes"] = weights
    return model.config.num_kv_heads, rows


def run_throughput(
    path: str | None, dtype: str, kv: str, contexts: list[int], new: int, batches: list[int]
) -> tuple[int, list]:
    """Decode throughput of ``B`` sequences at once, for each batch size and context: the caches (storing ``kv``) are
    filled with random keys/values up to the context (decode time does not depend on their values, and a real
    prefill of 32 x 4k tokens would take minutes here), then ``new`` steps of ``B`` greedy tokens run through the
    step ``generate`` takes (``select_step``); tokens/s = ``B`` / the median step time."""
    from gqa.decoding.steps import select_step

    model = load_gqa(path, dtype, kv)
    rows = []
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for context in contexts:
            for batch in batches:
                caches = model.new_caches(batch, context + new)
                for cache in caches:
                    fill_random(cache, g)
                    cache.cursor.fill_(context)
                tokens = torch.randint(10, model.config.vocab_size, (batch, 1), generator=g)
                step_fn = select_step(model, caches)
                stamps = [time.perf_counter()]
                for _ in range(new):
                    tokens = step_fn(tokens, caches)[:, -1].argmax(-1, keepdim=True)
                    stamps.append(time.perf_counter())
                step = statistics.median(b - a for a, b in itertools.pairwise(stamps))
                kv = sum(c.nbytes for c in caches)
                rows.append({"context": context, "batch": batch, "new_tokens": new, "step_s": step,
                             "decode_tok_s": batch / step, "kv_cache_bytes": kv})  # fmt: skip
                del caches
    return model.config.num_kv_heads, rows


def fill_random(cache: torch.nn.Module, g: torch.Generator, rows: int = 256) -> None:
    """Every slot of ``cache``'s ``key (B, H_kv, C, D)`` and ``value`` buffers random: normal values, or for a
    quantized cache ``rows`` slots of them quantized and repeated along the slots (quantizing all of a large cache
    would take longer than the benchmark)."""
    from gqa.cache.quantize import quantize

    for buf, kind, dim in ((cache.key, cache.kinds[0], cache.head_dim), (cache.value, cache.kinds[1], cache.value_dim)):
        if not kind.quantized:
            buf.normal_(generator=g)
            continue
        B, H, C, _ = buf.shape
        blocks = quantize(torch.randn(B, H, min(rows, C), dim, generator=g), kind)  # (B, H_kv, n, row bytes)
        for s in range(0, C, blocks.shape[2]):
            buf[:, :, s : s + blocks.shape[2]] = blocks[:, :, : C - s]


def greedy_tokens(path: str | None, generate: object) -> list[list[int]]:
    """``generate(prompt_ids) -> new ids`` on ``GREEDY_PROMPTS`` (chat template of the model's tokenizer, or the
    plain text where it has none)."""
    import gqa

    tok = gqa.load_tokenizer(path)
    return [generate(tok.apply_chat(p) if tok.chat_template else tok.encode(p)) for p in GREEDY_PROMPTS]


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


def run_llama_cpp(path: str | None, kv: str, contexts: list[int], new: int) -> tuple[int, list, object]:
    """llama.cpp (``llama-cpp-python``) on the GGUF file itself, as many threads as torch uses here, its KV cache
    storing ``kv`` (``bench.llama_cpp_kv``)."""
    from llama_cpp import Llama

    from gqa.bench.llama_cpp_kv import llama_kwargs
    from gqa.loaders import resolve_model_path

    file = resolve_model_path(path)
    if file.is_dir():
        raise ValueError(f"{file}: llama.cpp runs GGUF files, not HF folders")
    threads = torch.get_num_threads()
    llm = Llama(model_path=str(file), n_ctx=max(contexts) + new + 64, n_batch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False, **llama_kwargs(kv))  # fmt: skip
    vocab = llm.n_vocab()
    rows = []
    llm.eval([5, 6, 7])  # first-call costs outside the timing
    for context in contexts:
        ids = prompt(context, vocab)
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        prefill = time.perf_counter() - start
        llm.reset()
        stamps = []
        for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == new:
                break
        rows.append(_row(context, prefill, stamps))

    def generate(ids: list[int]) -> list[int]:
        llm.reset()
        out = []
        for t in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(int(t))
            if len(out) == 32 or t == llm.token_eos():
                return out
        return out

    return int(llm.metadata.get(f"{llm.metadata['general.architecture']}.attention.head_count_kv", 0)), rows, generate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gqa.bench.model.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("engine", choices=ENGINES)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", choices=[*DTYPES, *QUANTIZED], default="fp32")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    parser.add_argument("--contexts", type=int, nargs="+", required=True)
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=None, help="decode throughput at these batch sizes")
    parser.add_argument("--greedy", action="store_true", help="also greedy tokens of GREEDY_PROMPTS")
    parser.add_argument("--prefill-repeats", type=int, default=1, help="gqa: timed prefills per context (median)")
    ns = parser.parse_args(argv)
    torch.manual_seed(0)
    kv = ns.kv_cache_dtype
    if ns.engine == "hf" and kv not in ("auto", ns.dtype):
        parser.error(f"--kv-cache-dtype {kv}: the hf engine runs its cache in --dtype {ns.dtype}")
    greedy, measured = None, {}
    if ns.batch is not None:
        kv_heads, rows = run_throughput(ns.model, ns.dtype, kv, ns.contexts, ns.new_tokens, ns.batch)
    elif ns.engine == "hf":
        kv_heads, rows = run_hf(ns.model, DTYPES[ns.dtype], ns.contexts, ns.new_tokens)
    elif ns.engine == "llama.cpp":
        kv_heads, rows, generate = run_llama_cpp(ns.model, kv, ns.contexts, ns.new_tokens)
        greedy = greedy_tokens(ns.model, generate) if ns.greedy else None
    else:
        compiled = ns.engine == "gqa-compile"
        model = load_gqa(ns.model, ns.dtype, kv)
        kv_heads, rows = run_gqa(model, ns.contexts, ns.new_tokens, compiled=compiled, repeats=ns.prefill_repeats)
        measured = {"kv_bytes_per_token": cache_bytes_per_token(model.new_caches(1, 1))}
        if ns.greedy:
            greedy = greedy_tokens(ns.model, lambda ids: model.generate(ids, max_new_tokens=32, compile=compiled))
    peak_mib = peak_rss_mib()
    from gqa import kernels

    print(json.dumps({"engine": ns.engine, "dtype": ns.dtype, "kv_cache_dtype": kv, "model_kv_heads": kv_heads,
                      "peak_rss_mib": peak_mib, "native_kernels": kernels.available(), "rows": rows, "greedy": greedy}
                     | measured))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
