"""``gqa bench model --window-caches``: window-sized KV caches against full ones on a Gemma-3-1B-like model, side by
side in one run: KV memory held and decode tokens/s at each context.

The model has Gemma 3 1B's attention (26 layers, five sliding layers with a 512-key window to one global, one KV head
of dim 256, four query heads, separate RoPE bases, q/k norms) with random weights and a small hidden size (256: a
KV cache's size does not depend on it, and a step's time is then mostly attention's). Each context's prompt is
prefilled once per cache kind, then ``--new-tokens`` greedy tokens are decoded through the step ``generate`` takes
(``select_step``: the one-call native step on CPU, the graphed fused step on CUDA) over
``new_caches(window_caches=True)`` (the sliding layers hold only their window) and ``False`` (every layer a full static
cache). Both must decode the same tokens.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

import torch

from ...cache.sizes import layer_cache_tokens
from ...decoding.sampling import sample_next
from ...decoding.steps import select_step
from ...models import ModelConfig
from ...models.llama import CausalLM

LAYERS, WINDOW, PATTERN = 26, 512, 6  # Gemma 3 1B: every sixth layer is global


def gemma3_like(context: int, dtype: torch.dtype = torch.float32) -> CausalLM:
    """A random model with Gemma 3 1B's attention shapes and a context of ``context`` tokens."""
    kinds = ["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(LAYERS)]
    cfg = ModelConfig(arch="gemma3_text", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=LAYERS,
                      num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=context,
                      tie_word_embeddings=True, qk_norm=True, sliding_window=WINDOW, hidden_act="gelu_pytorch_tanh",
                      layer_types=kinds, rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=256.0)  # fmt: skip
    torch.manual_seed(0)
    return CausalLM(cfg).eval().to(dtype)


@torch.inference_mode()
def decode(model: CausalLM, prompt: torch.Tensor, new: int, window_caches: bool) -> dict:
    """Greedy tokens, prefill and decode seconds and the caches' bytes for one prompt ``(1, P)``."""
    caches = model.new_caches(1, prompt.shape[1] + new, window_caches=window_caches)
    step = select_step(model, caches)
    t0 = time.perf_counter()
    logits = model(prompt, caches=caches, last_only=True)[:, -1]
    stamps = [time.perf_counter()]
    tokens = []
    for _ in range(new):
        token = sample_next(logits, temperature=0.0)
        tokens.append(int(token))
        logits = step(token.view(1, 1), caches)[:, -1]
        stamps.append(time.perf_counter())
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "tokens": tokens,
        "prefill_s": stamps[0] - t0,
        "step_s": statistics.median(steps),
        "decode_s": stamps[-1] - stamps[0],
        "kv_bytes": sum(c.nbytes for c in caches),
        "step": step.name,
    }


def full_and_window_bytes(cfg: ModelConfig, tokens: int, itemsize: int) -> tuple[int, int]:
    """KV bytes of one ``tokens``-token sequence with full caches on every layer, and with window caches."""
    per_slot = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize  # one layer's K and V of one token
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    held = sum(layer_cache_tokens(None if w is None else w[0] + 1, tokens) for w in windows)
    return cfg.num_layers * tokens * per_slot, held * per_slot


def window_rows(contexts: list[int], new: int, repeats: int, dtype: torch.dtype) -> tuple[list[dict], ModelConfig]:
    """One row per (context, cache kind): medians of ``repeats`` runs, decode tokens/s as one over the median step
    (robust to one slow step: the first one after a long prefill can be; the mean rate is kept beside it); raises if
    the two kinds' tokens differ. Also the model's config."""
    model = gemma3_like(max(contexts) + new, dtype)
    rows = []
    for context in contexts:
        prompt = torch.randint(0, 512, (1, context), generator=torch.Generator().manual_seed(context))
        tokens = set()
        for window in (True, False):
            print(f"[bench model] window caches: context {context}, {'window' if window else 'full'} caches ...",
                  file=sys.stderr, flush=True)  # fmt: skip
            runs = [decode(model, prompt, new, window) for _ in range(repeats)]
            tokens |= {tuple(r["tokens"]) for r in runs}
            rows.append({"context": context, "window_caches": window, "step": runs[0]["step"],
                         "kv_bytes": runs[0]["kv_bytes"], "prefill_s": statistics.median(r["prefill_s"] for r in runs),
                         "decode_tok_s": 1.0 / statistics.median(r["step_s"] for r in runs),
                         "decode_mean_tok_s": new / statistics.median(r["decode_s"] for r in runs),
                         "decode_runs_s": [r["decode_s"] for r in runs]})  # fmt: skip
        if len(tokens) != 1:
            raise RuntimeError(f"context {context}: window and full caches decoded different tokens")
    return rows, model.config


def window_table(rows: list[dict], cfg: ModelConfig, itemsize: int) -> str:
    lines = [
        "| context | caches | step | KV held (MiB) | KV vs full | prefill s | decode tok/s | decode vs full |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    full = {r["context"]: r for r in rows if not r["window_caches"]}
    for r in rows:
        base = full[r["context"]]
        label = "window-sized on sliding layers" if r["window_caches"] else "full on every layer"
        lines.append(
            f"| {r['context']} | {label} | {r['step']} | {r['kv_bytes'] / 2**20:.1f} | "
            f"{r['kv_bytes'] / base['kv_bytes']:.2f}x | {r['prefill_s']:.2f} | {r['decode_tok_s']:.1f} | "
            f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x |"
        )
    full_32k, held_32k = full_and_window_bytes(cfg, 32768, itemsize)
    lines.append(f"\nOne 32,768-token sequence: {held_32k / 2**20:,.1f} MiB with window caches, "
                 f"{full_32k / 2**20:,.1f} MiB with full caches ({held_32k / full_32k:.2f}x).")  # fmt: skip
    return "\n".join(lines)


def run_window_caches(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> tuple[dict, list[dict], dict, str]:
    """The ``--window-caches`` run (module docstring): its arguments, rows, the model's config and the report's
    text."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if ns.dtypes == ["fp32", "bf16", "q4_1"]:  # the default of the other modes
        ns.dtypes = ["fp32"]
    if len(ns.dtypes) != 1 or ns.dtypes[0] not in dtypes:
        parser.error(f"--window-caches runs one float dtype (fp32 or bf16), got --dtypes {' '.join(ns.dtypes)}")
    dtype = dtypes[ns.dtypes[0]]
    rows, cfg = window_rows(ns.contexts, ns.new_tokens, ns.repeats, dtype)
    args = {"contexts": ns.contexts, "new_tokens": ns.new_tokens, "repeats": ns.repeats, "dtype": ns.dtypes[0]}
    header = (
        f"Window-sized vs full KV caches: a Gemma-3-1B-like random model ({LAYERS} layers, 5 of every 6 sliding with "
        f"{WINDOW} keys, 1 KV head of dim 256), {ns.dtypes[0]}, batch 1, {ns.new_tokens} greedy tokens after each "
        f"prompt (decode: the median step), {ns.repeats} run(s); both decode the same tokens; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    return args, rows, cfg.as_dict(), header + "\n\n" + window_table(rows, cfg, dtype.itemsize)
