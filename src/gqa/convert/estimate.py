"""What a conversion will take, before it runs (``gqa convert --dry-run``): peak memory and time, from the source's
tensor shapes (no weight is read) and the speed of this machine's matrix products, measured on the spot.

Memory, streaming (``gqa.convert.streaming``): the process as it is now (Python, torch), plus the largest of
* embedding the calibration windows: the embedding matrix as stored, and the hidden states;
* a layer: its tensors as stored and in float32, the merged attention in float32, the hidden states (two copies
  without the refit, about four with it: inputs, normed inputs, targets, outputs), one forward pass's intermediates
  (the MLP's and the attention scores of the tokens in flight), and the refit's Gram matrix ``(H_q * r)^2`` float64
  (``r = H_kv / N * D``);
plus, when healing, the source (teacher) and the converted model (student) in float32, AdamW's two moments and the
gradients of the trained parameters, and a step's logits. Time: each layer's floating-point operations (calibration
forward passes, the refit's attention passes, Gram products and conjugate-gradient iterations) over the measured rate.
Both are estimates; docs/conversion.md compares them with measured runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..loaders.lazy import LazyModel
from .refit import BATCH_TOKENS, CALIBRATION_WINDOW
from .streaming import SOURCE_WINDOW
from .value_refit import _CG_STEPS, VALUE_STEPS

__all__ = ["EFFICIENCY", "Estimate", "estimate", "machine_gflops"]

# the share of the measured matrix-product rate conversions reach: 0.6B MHA -> 2 KV heads on a 2-core CPU, pca took
# 2.5x and pca + refit 2.4x the time these operation counts take at the full rate (measured when EFFICIENCY was set)
EFFICIENCY = 0.4


@dataclass(frozen=True)
class Estimate:
    """Bytes and seconds a conversion is expected to take (see the module docstring)."""

    peak_bytes: int
    baseline_bytes: int
    whole_model_bytes: int  # the source in float32: what loading it whole would take
    layer_seconds: float
    layers: int
    heal_bytes: int
    gflops: float

    @property
    def seconds(self) -> float:
        return self.layer_seconds * self.layers


def _rss() -> int:
    """This process's resident memory now, in bytes (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def machine_gflops(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", n: int = 768) -> float:
    """Measured rate of ``(n, n) @ (n, n)`` products in ``dtype`` on ``device``, GFLOP/s (best of a few)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    best = float("inf")
    for _ in range(5):
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ a
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def estimate(
    source: LazyModel,
    kv_heads: int,
    *,
    calibration_tokens: int,
    refit: bool,
    heal: bool = False,
    heal_tokens_per_step: int = 256,
    device: torch.device | str = "cpu",
) -> Estimate:
    """The ``Estimate`` for converting ``source`` to ``kv_heads`` KV heads, calibrating on ``calibration_tokens``
    tokens (0: no calibration), with or without the refit and healing."""
    cfg = source.config
    E, H, D, N = cfg.hidden_size, cfg.num_heads, cfg.head_dim, kv_heads
    T = calibration_tokens if kv_heads < cfg.num_kv_heads else 0

    def numel(name: str) -> int:
        return int(torch.Size(source.shapes[name]).numel())

    layer_names = [[n for n in source.shapes if n.startswith(f"model.layers.{i}.")] for i in range(cfg.num_layers)]
    stored = max(sum(source.nbytes(n) for n in names) for names in layer_names)
    params = max(sum(numel(n) for n in names) for names in layer_names)
    attn = 2 * H * D * E + 2 * N * D * E
    r = max(cfg.num_kv_heads // max(N, 1), 1) * D
    hidden = T * E * 4 * (4 if refit else 2)
    window = min(CALIBRATION_WINDOW if refit else SOURCE_WINDOW, cfg.max_position_embeddings)
    in_flight = min(T, BATCH_TOKENS if refit else window)  # tokens one forward pass holds
    transient = in_flight * (3 * cfg.intermediate_size + H * window) * 4  # MLP intermediates, attention scores
    refit_bytes = (H * r) ** 2 * 8 if refit and T else 0
    layer_phase = stored + params * 4 + attn * 4 + hidden + transient + refit_bytes
    embed = source.nbytes("model.embed_tokens.weight") + T * E * 4
    whole = sum(numel(n) for n in source.shapes) * 4
    heal_bytes = 0
    if heal:
        trained = cfg.num_layers * attn
        heal_bytes = 2 * whole + 3 * trained * 4 + heal_tokens_per_step * cfg.vocab_size * 4 * 6
    baseline = _rss()
    rate32 = machine_gflops(torch.float32, device) * 1e9
    rate64 = machine_gflops(torch.float64, device) * 1e9
    forward = T * (2 * params + 2 * H * D * window)  # the layer's projections, and causal attention scores
    flops32, flops64 = forward, 0.0
    if refit and T:
        flops32 += 3 * T * (2 * attn + 2 * H * D * window) + 2 * T * (H * r) ** 2
        flops64 += VALUE_STEPS * _CG_STEPS * 2 * H * H * D * r * (D + r)
    seconds = (flops32 / rate32 + flops64 / rate64) / EFFICIENCY + stored / 1e9  # and reading the layer, ~1 GB/s
    return Estimate(baseline + max(layer_phase, embed), baseline, whole, seconds, cfg.num_layers, heal_bytes,
                    rate32 / 1e9)  # fmt: skip
