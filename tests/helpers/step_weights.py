"""Random per-layer weights (float or block-quantized) in the one-call decode step's argument order."""

from __future__ import annotations

import torch


def random_layers(g: torch.Generator, dtype, formats, E, F, Hq, Hkv, D, biases):
    """Per layer: norms, 7 weights (float or blocks per ``formats``) with their format codes, q/k/v biases."""
    from gqa.models.quantized import get_format, quantize

    layers = []
    shapes = [(Hq * D, E), (Hkv * D, E), (Hkv * D, E), (E, Hq * D), (F, E), (F, E), (E, F)]
    for fmt in formats:
        weights, codes = [], []
        for M, K in shapes:
            w = torch.randn(M, K, generator=g) / K**0.5
            if fmt is None:
                weights.append(w.to(dtype))
                codes.append(-1)
            else:
                weights.append(quantize(w, fmt).blocks)
                codes.append(get_format(fmt).code)
        norms = [(1 + 0.1 * torch.randn(E, generator=g)).to(dtype) for _ in range(2)]
        bias = [(0.1 * torch.randn(M, generator=g)).to(dtype) if biases else None for M, _ in shapes[:3]]
        layers.append((norms, weights, codes, bias))
    return layers
