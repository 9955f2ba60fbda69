"""``Linear``: an ``nn.Linear`` whose decode-sized calls on CPU run the native GEMV kernel.

A decoded token multiplies one row (per sequence) by every weight matrix of the model, so decode time is the time to
stream the weights through memory. ``kernels.ops.linear_rows`` (``gqa/kernels/csrc``) streams ``nn.Linear``'s own
``(out, in)`` layout at close to the machine's read bandwidth; everything else (training, prefill, other devices and
dtypes, or no built kernels) goes to ``F.linear``. Same parameters, names and state dict as ``nn.Linear``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..kernels import ops
from .quantized import QuantizedLinear, quantized_linears

# Up to this many rows of x the native GEMV streams the weight once for all of them; more rows is a GEMM, MKL's job.
KERNEL_MAX_ROWS = 8
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def uses_kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`linear` runs the native kernel for these inputs."""
    if x.device.type != "cpu" or x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype or x.dim() == 0:
        return False
    if not weight.is_contiguous() or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous())):
        return False
    if x.numel() > KERNEL_MAX_ROWS * x.shape[-1]:
        return False
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False  # the kernel has no backward
    return kernels.vectorized()  # as scalar loops (no AVX-512/AVX2 SIMD) the kernel is slower than F.linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: ``x (*, in)``, ``weight (out, in)``, ``bias (out,)`` -> ``(*, out)``."""
    if not uses_kernel(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (N, in), N <= KERNEL_MAX_ROWS: a copy of at most 8 rows
    out = ops.linear_rows(rows, weight, bias)  # (N, out)
    return out.view(*x.shape[:-1], weight.shape[0])


def linears(x: torch.Tensor, layers: Sequence[nn.Linear]) -> list[torch.Tensor]:
    """``[layer(x) for layer in layers]`` — in one kernel call (one pass of the threads over all the weights) where
    the native kernel applies to every layer, e.g. q/k/v or gate/up projections of one decoded token; quantized
    layers (``gqa.models.quantized.QuantizedLinear``) through the quantized kernel."""
    if all(isinstance(layer, QuantizedLinear) for layer in layers):
        return quantized_linears(x, list(layers))
    if not all(
        isinstance(layer, nn.Linear) and not layer._forward_hooks and uses_kernel(x, layer.weight, layer.bias)
        for layer in layers
    ):  # a module with hooks (e.g. a LoRA adapter, ``gqa.convert.lora``) is called as a module
        return [layer(x) for layer in layers]
    rows = x.reshape(-1, x.shape[-1]).contiguous()  # (N, in)
    outs = ops.linear_rows_n(rows, [m.weight for m in layers], [m.bias for m in layers])  # [(N, out_i)]
    return [out.view(*x.shape[:-1], out.shape[-1]) for out in outs]


class Linear(nn.Linear):
    """``nn.Linear`` with :func:`linear` as its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
