"""Window-sized KV caches against full ones on a Gemma-3-1B-like model: KV memory and decode speed, side by side.

The model has Gemma 3 1B's attention shapes (26 layers, 5 sliding layers to 1 global, a 512-key window, 1 KV head
of dim 256, 4 query heads) and random weights with a small hidden size (2 x 128: the KV cache's size does not depend
on it, and the step's time is then mostly attention's). One prompt of ``--prompt`` tokens, then ``--new`` greedy
tokens, decoded with ``new_caches(window_caches=True)`` (window caches on the sliding layers) and ``False`` (every
layer a full static cache), each through the step ``generate`` takes (``select_step``: the one-call native step) and
through the eager forward; the tokens must agree. Prints KV bytes held and decode tok/s (median of ``--repeats``).

    .venv/bin/python benchmarks/window_cache.py --prompt 4096 --new 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gqa.cache.sizes import layer_cache_tokens
from gqa.decoding.sampling import sample_next
from gqa.decoding.steps import select_step
from gqa.models import ModelConfig
from gqa.models.llama import CausalLM


def gemma3_like(context: int) -> CausalLM:
    layers = 26
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    cfg = ModelConfig(arch="gemma3_text", vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=layers,
                      num_heads=4, num_kv_heads=1, head_dim=256, max_position_embeddings=context,
                      tie_word_embeddings=True, qk_norm=True, sliding_window=512, hidden_act="gelu_pytorch_tanh",
                      layer_types=kinds,
                      rope_theta=1e6, rope_local_theta=1e4, query_pre_attn_scalar=256.0)  # fmt: skip
    torch.manual_seed(0)
    return CausalLM(cfg).eval()


@torch.no_grad()
def decode(
    model: CausalLM, prompt: torch.Tensor, new: int, window_caches: bool, native: bool
) -> tuple[list[int], float, int]:
    """Greedy tokens, decode seconds (after the prompt) and the caches' bytes."""
    caches = model.new_caches(1, prompt.shape[1] + new, window_caches=window_caches)
    step = select_step(model, caches) if native else (lambda tokens, caches: model(tokens, caches=caches))
    if native and step.name != "native":
        raise SystemExit(f"expected the native step, select_step chose {step.name!r}")
    logits = model(prompt, caches=caches, last_only=True)[:, -1]
    tokens, t0 = [], time.perf_counter()
    for _ in range(new):
        token = sample_next(logits, temperature=0.0)
        tokens.append(int(token))
        logits = step(token.view(1, 1), caches)[:, -1]
    return tokens, time.perf_counter() - t0, sum(c.nbytes for c in caches)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--new", type=int, default=64, help="decoded tokens (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each (default 3)")
    args = p.parse_args()
    model = gemma3_like(max(32768, args.prompt + args.new))
    prompt = torch.randint(0, 512, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    rows = {}
    for native in (True, False):
        for window in (True, False):
            runs = [decode(model, prompt, args.new, window, native) for _ in range(args.repeats)]
            rows[window, native] = (runs[0][0], statistics.median(r[1] for r in runs), runs[0][2])
    tokens = {tuple(r[0]) for r in rows.values()}
    assert len(tokens) == 1, "the caches or steps decoded different tokens"
    cfg = model.config
    per_slot = 2 * cfg.num_kv_heads * cfg.head_dim * 4  # one layer's K and V of one token, fp32
    full_32k = cfg.num_layers * 32768 * per_slot
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    held_32k = sum(layer_cache_tokens(None if w is None else w[0] + 1, 32768) for w in windows) * per_slot
    print(f"Gemma-3-1B-like attention (26 layers, 22 sliding with 512 keys), fp32, prompt {args.prompt}, "
          f"{args.new} new tokens, {torch.get_num_threads()} threads, median of {args.repeats}")  # fmt: skip
    print("| caches | step | KV held (MiB) | decode tok/s | KV at 32k tokens (MiB) |")
    print("|---|---|---:|---:|---:|")
    for (window, native), (_, seconds, nbytes) in rows.items():
        label = "window-sized on sliding layers" if window else "full on every layer"
        at_32k = held_32k if window else full_32k
        step = "native (one call)" if native else "eager forward"
        print(f"| {label} | {step} | {nbytes / 2**20:.1f} | {args.new / seconds:.1f} | {at_32k / 2**20:.1f} |")
    print(f"tokens equal: yes; KV at 32k: {held_32k / full_32k:.2f}x of full")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
