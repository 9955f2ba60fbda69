"""Where one decode step's time goes: the whole step against its parts, timed alone on the same weights.

    python benchmarks/decode_profile.py --dtype auto      # the default model as gqa generate loads it (q4_1 blocks)
    python benchmarks/decode_profile.py --dtype bf16

Prints medians (ms) of: a full decode step at ``--context`` tokens (batch 1, the native step: one
``gqa::decode_model`` call), the same step with a native call per layer (the path kept for what the one call cannot
take), the GEMVs of every layer's weights (q/k/v, o, gate/up, down, as the step calls them), the lm_head GEMV, and
``x.sum()`` over 1 GiB (the read bandwidth the GEMVs are compared with), three rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import gqa
from gqa.decoding import native_step as decode_step
from gqa.kernels import ops
from gqa.models.quantized import QuantizedLinear


def median_ms(fn: Callable[[], object], repeats: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def paired_ms(a: Callable[[], object], b: Callable[[], object], repeats: int = 60) -> tuple[float, float]:
    """Medians (ms) of ``a`` and ``b`` timed in alternation, so a busy spell of a shared machine hits both."""
    for _ in range(5):
        a(), b()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((a, times[0]), (b, times[1])):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def gemv(x: torch.Tensor, layers: list) -> None:
    if isinstance(layers[0], QuantizedLinear):
        ops.qlinear_rows_n(x, [m.blocks for m in layers], [m.format.code for m in layers], [None] * len(layers))
    else:
        ops.linear_rows_n(x, [m.weight for m in layers], [None] * len(layers))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--context", type=int, default=128)
    ns = parser.parse_args()
    dtype = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16}[ns.dtype]
    model = gqa.load_model(dtype=dtype, tokenizer=False)
    layers = model.model.layers
    groups = [g for layer in layers for g in (
        [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], [layer.self_attn.o_proj],
        [layer.mlp.gate_proj, layer.mlp.up_proj], [layer.mlp.down_proj])]  # fmt: skip
    inputs = {m.in_features: torch.randn(1, m.in_features, dtype=model.dtype) for g in groups for m in g}
    with torch.inference_mode():
        caches = model.new_caches(1, ns.context + 8)
        model(torch.arange(100, 100 + ns.context)[None], caches=caches, last_only=True)
        token = torch.tensor([[5]])

        def step() -> None:
            for cache in caches:
                cache.cursor.fill_(ns.context)
            model(token, caches=caches)

        def per_layer_step() -> None:
            whole = decode_step.decode_weights
            decode_step.decode_weights = lambda *args: None
            try:
                step()
            finally:
                decode_step.decode_weights = whole

        big = torch.randn(2**28)
        for _ in range(3):
            s, per_layer = paired_ms(step, per_layer_step)
            g = median_ms(lambda: [gemv(inputs[grp[0].in_features], grp) for grp in groups])
            h = median_ms(lambda: gemv(inputs[model.lm_head.in_features], [model.lm_head]))
            bw = big.nbytes / median_ms(big.sum, 10) / 1e6
            print(f"step {s:.2f} ms (a call per layer: {per_layer:.2f} ms) | layer GEMVs {g:.2f} ms | "
                  f"lm_head {h:.2f} ms | rest {s - g - h:.2f} ms | "
                  f"sum over 1 GiB {bw:.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
