"""``gqa bench model --device cuda``: whole-model greedy decode on a GPU, gqa against HF transformers on the same
random weights (the model files never leave the CPU machine; their shapes do).

Rows per shape (SmolLM2-135M's and Llama-3.2-1B's, bf16) and batch size: gqa's default path (``model.generate``: CUDA
graphs over the fused decode step), gqa ``compile=True`` (the Inductor-compiled fused step in the graph), HF
``generate`` eager, and HF with a static cache (``cache_implementation="static"``, which transformers compiles itself
on CUDA, ``mode="reduce-overhead"``). Tokens/s count the new tokens over the whole ``generate`` call, the prompt's
prefill included for every engine; GB/s are the bytes a decode step must read (``decode_bytes``) at the best gqa
rate. ``benchmarks/gpu_check.py`` runs the same rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from .arguments import CUDA_SHAPES

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
               max_position_embeddings=8192, rms_norm_eps=1e-5)  # fmt: skip
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                max_position_embeddings=8192, rms_norm_eps=1e-5)  # Llama-3.2-1B's shapes  # fmt: skip
TINY = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
            vocab_size=256, tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=512,
            rms_norm_eps=1e-5)  # fmt: skip
LLAMA_3B = LLAMA_1B | dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24)  # Llama-3.2-3B's shapes
LLAMA_8B = LLAMA_1B | dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                           tie_word_embeddings=False)  # Llama-3.1-8B's shapes  # fmt: skip
SHAPES = {"smollm2": ("SmolLM2-135M shapes", SMOLLM2), "llama-1b": ("Llama-3.2-1B shapes", LLAMA_1B),
          "llama-3b": ("Llama-3.2-3B shapes", LLAMA_3B), "llama-8b": ("Llama-3.1-8B shapes", LLAMA_8B),
          "tiny": ("tiny", TINY)}  # fmt: skip
ENGINES = ("gqa", "gqa-compile", "hf", "hf-static-compile")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _hf_model(config: dict, device: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**config, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def _gqa_model(hf, device: torch.device, dtype: torch.dtype):
    from gqa.models import CausalLM
    from gqa.models.config import ModelConfig

    cfg = ModelConfig.from_hf(hf.config.to_dict() | {"model_type": "llama"})
    with torch.device(device):
        model = CausalLM.from_state(cfg, hf.state_dict())
    return model.to(dtype)


def _timed(fn, device: torch.device, repeats: int, warm: bool = True) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs after one warm-up (``warm=False``: already warmed)."""
    if warm:
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_bytes(model, batch: int, context: float) -> float:
    """Bytes one decode step must read: every weight matrix once (the embedding table only where it is also the
    tied lm_head), and each row's K/V of ``context`` tokens."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_word_embeddings:
        weights -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    kv = cfg.num_layers * 2 * batch * cfg.num_kv_heads * cfg.head_dim * context * model.dtype.itemsize
    return weights + kv


@torch.inference_mode()
def model_pair(config: dict, device: torch.device, dtype: torch.dtype) -> tuple:
    """HF's Llama and gqa's on the same random weights in ``dtype``, and their float32 logits' relative error."""
    hf = _hf_model(config, device, torch.float32)
    model = _gqa_model(hf, device, torch.float32)
    probe = torch.randint(3, config["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    ref = hf(probe).logits.float()
    fp32_err = ((model(probe).float() - ref).norm() / ref.norm()).item()
    return hf.to(dtype), model.to(dtype), fp32_err


@torch.inference_mode()
def model_row(name: str, pair: tuple, device: torch.device, *, batch: int, prompt_len: int, new_tokens: int,
              engines: tuple[str, ...] = ENGINES, deadline: float = float("inf"),
              repeats: int = 3) -> dict:  # fmt: skip
    """Greedy decode of ``batch`` rows by each of ``engines`` (module docstring); the first call of each (compiling,
    capturing) is timed apart, then the median of ``repeats``. Engines left when ``deadline``
    (``time.perf_counter()``) has passed are skipped."""
    hf, model, fp32_err = pair
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(batch)).to(device)
    hf_kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                     do_sample=False, pad_token_id=0)  # fmt: skip
    calls = {
        "gqa": lambda: model.generate(ids, max_new_tokens=new_tokens, eos_token_ids=[]),
        "hf": lambda: hf.generate(ids, **hf_kwargs),
        "hf-static-compile": lambda: hf.generate(ids, **hf_kwargs, cache_implementation="static"),
        "gqa-compile": lambda: model.generate(ids, max_new_tokens=new_tokens, eos_token_ids=[], compile=True),
    }  # in this order: the peers before the slowest first call
    row = {"name": name, "dtype": str(model.dtype).removeprefix("torch."), "B": batch, "prompt": prompt_len,
           "new_tokens": new_tokens, "logits_rel_err_fp32": fp32_err, "tokens_per_s": {}, "first_call_s": {},
           "errors": {}}  # fmt: skip
    outputs = {}
    for engine, fn in calls.items():
        if engine not in engines:
            continue
        if time.perf_counter() > deadline:
            row["errors"][engine] = "skipped: out of time"
            continue
        try:
            t0 = time.perf_counter()
            out = fn()  # the first call: compilations, graph capture
            _sync(device)
            row["first_call_s"][engine] = time.perf_counter() - t0
            outputs[engine] = torch.as_tensor(out, device=device)[..., -new_tokens:].reshape(batch, -1)
            row["tokens_per_s"][engine] = batch * new_tokens / _timed(fn, device, repeats, warm=False)
            if engine == "hf-static-compile":  # transformers compiles the forward itself on CUDA; did it?
                row["hf_static_compiled"] = getattr(hf, "_compiled_call", None) is not None
        except Exception as err:  # one engine failing must not lose the others
            row["errors"][engine] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"[bench model] {name} B={batch} {engine}: {row['errors'][engine]}", file=sys.stderr, flush=True)
    for engine in ("gqa-compile", "hf", "hf-static-compile"):
        if engine in outputs and "gqa" in outputs:
            row[f"agreement_{engine}"] = (outputs[engine] == outputs["gqa"]).float().mean().item()
    best = max((row["tokens_per_s"].get(e, 0.0) for e in ("gqa", "gqa-compile")), default=0.0)
    if best:
        row["decode_gbs"] = decode_bytes(model, batch, prompt_len + new_tokens / 2) * best / batch / 1e9
        for peer in ("hf", "hf-static-compile"):
            if row["tokens_per_s"].get(peer):
                row[f"best_gqa_vs_{peer}"] = best / row["tokens_per_s"][peer]
    return row


def cuda_rows(device: torch.device, shapes: list[str], batches: list[int], engines: tuple[str, ...], *,
              prompt_len: int = 128, new_tokens: int = 64, deadline: float = float("inf"),
              dtype: torch.dtype = torch.bfloat16, repeats: int = 3) -> list[dict]:  # fmt: skip
    """``model_row`` for every shape and batch size: B=1 of every shape first, then the largest batch (the last
    shape first), then the rest, so that what a ``deadline`` cuts is the least asked for. HF's static cache runs at
    B=1 only (its compilation is the slowest first call)."""
    pairs, runs = {}, []
    for key in shapes:
        name, config = SHAPES[key]
        try:
            pairs[name] = model_pair(config, device, dtype)
        except Exception as err:
            runs.append({"name": name, "B": "-", "error": f"{type(err).__name__}: {err}"})
    names, ordered = list(pairs), sorted(dict.fromkeys(batches), key=lambda b: (b != 1, -b))
    order = [(n, b) for b in ordered[:2] for n in (names if b == 1 else reversed(names))]
    order += [(n, b) for b in ordered[2:] for n in names]
    for name, batch in order:
        chosen = tuple(e for e in engines if e != "hf-static-compile" or batch == 1)
        try:
            row = model_row(name, pairs[name], device, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                            engines=chosen, deadline=deadline, repeats=repeats)  # fmt: skip
            runs.append(row)
        except Exception as err:  # one row failing must not lose the others
            runs.append({"name": name, "B": batch, "error": f"{type(err).__name__}: {err}"})
            print(f"[bench model] {name} B={batch} failed: {runs[-1]['error']}", file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return runs


def table(rows: list[dict], copy: float | None) -> list[str]:
    """The rows as a markdown table; ``copy``: the device-to-device copy bandwidth in GB/s, for GB/s as a share."""
    lines = ["## Whole-model greedy decode, random weights (tokens/s over the whole generate call; first call s)", "",
             "| model | B | " + " | ".join(ENGINES) + " | best gqa vs HF static+compile | vs HF eager | "
             "decode GB/s (% of copy) | agreement compile / hf / hf-static | fp32 logits rel. err |",
             "|" + "---|" * (7 + len(ENGINES))]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['B']} | failed: {r['error'][:200]} |")
            continue
        t, first, errors = r["tokens_per_s"], r["first_call_s"], r["errors"]
        cells = [f"{t[e]:.0f} ({first[e]:.0f} s)" if e in t else (errors.get(e, "—")[:80]) for e in ENGINES]
        gbs = r.get("decode_gbs")
        pct = f" ({100 * gbs / copy:.0f}%)" if gbs and copy else ""
        agree = " / ".join(f"{r[k]:.2f}" if k in r else "—" for k in
                           ("agreement_gqa-compile", "agreement_hf", "agreement_hf-static-compile"))  # fmt: skip
        ratios = " | ".join("—" if r.get(k) is None else f"{r[k]:.2f}x"
                            for k in ("best_gqa_vs_hf-static-compile", "best_gqa_vs_hf"))  # fmt: skip
        gbs_cell = "—" if gbs is None else f"{gbs:.0f}{pct}"
        lines.append(f"| {r['name']} | {r['B']} | " + " | ".join(cells) + f" | {ratios} | {gbs_cell} | {agree} | "
                     f"{r['logits_rel_err_fp32']:.1e} |")  # fmt: skip
    return [*lines, ""]


def copy_gbs(device: torch.device, nbytes: int = 2**30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written over the median time): the decode ceiling."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _timed(lambda: dst.copy_(src), device, repeats) / 1e9


def run(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    """``gqa bench model --device cuda``: the rows of ``cuda_rows`` as a table (printed; ``--json``,
    ``--markdown``)."""
    from .. import write_json_atomic, write_text_atomic

    try:
        device = torch.device(ns.device)
    except RuntimeError:
        parser.error(f"--device must be cpu, cuda or cuda:N, got {ns.device!r}")
    if device.type != "cuda":
        parser.error(f"--device must be cpu, cuda or cuda:N, got {ns.device!r}")
    if not torch.cuda.is_available():
        parser.error(f"--device {ns.device}: no CUDA device on this machine")
    if ns.model is not None or ns.tp or ns.kv_heads or ns.kv_budget is not None:
        parser.error("--device cuda runs --shapes with random weights: --model, --tp, --kv-heads and --kv-budget are "
                     "CPU options")  # fmt: skip
    engines = tuple(ns.engines or ENGINES)
    if "llama.cpp" in engines:
        parser.error("--engines llama.cpp runs on CPU (gqa bench model without --device)")
    batches = ns.batch or [1, 8, 64]
    if min(batches) < 1 or ns.new_tokens < 2:
        parser.error("--batch must be positive and --new-tokens >= 2")
    shapes = list(dict.fromkeys(ns.shapes or CUDA_SHAPES))
    rows = cuda_rows(device, shapes, batches, engines, new_tokens=ns.new_tokens)
    copy = copy_gbs(device)
    text = "\n".join(table(rows, copy))
    print(text)
    payload = {"benchmark": "model", "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "copy_gbs": copy, "command": "gqa bench model " + " ".join(sys.argv[sys.argv.index("model") + 1 :])
               if "model" in sys.argv else None, "rows": rows}  # fmt: skip
    if ns.json is not None:
        write_json_atomic(ns.json, payload)
    if ns.markdown is not None:
        write_text_atomic(ns.markdown, text + "\n")
    return 0 if all("error" not in r and not r["errors"] for r in rows) else 1
