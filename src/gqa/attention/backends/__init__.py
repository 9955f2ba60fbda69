"""Attention backends: one keyword-only signature, a registry, and the ``auto`` policy.

Every backend is called as ``fn(query, key, value, *, shape, attn_mask, dropout_p, is_causal, scale, return_weights)``
with validated inputs and returns ``(out (*B, H_q, L, D_v), weights (*B, H_q, L, S) or None)``. None of them copies
K/V per query head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ... import kernels
from ...kernels.triton import split_kv
from ..checks import AttnShape, need_grad
from . import flex, fused
from .cuda_routing import CudaCall, device_capability, flash_supports, route_cuda
from .grouped import grouped_attention_rows
from .reference import reference_attention
from .sdpa import prepare_sdpa, sdpa_attention, sdpa_is_native
from .split_kv import triton_attention, triton_run

BACKENDS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor | None]]] = {
    "reference": reference_attention,
    "grouped": grouped_attention_rows,
    "sdpa": sdpa_attention,
    "fused": fused.fused_attention,
    "triton": triton_attention,
    "flex": flex.flex_attention_rows,
}

# Backends whose own checks the first call of a signature has already passed (``attention.routes``): the unchecked
# run, called directly by later calls of that signature.
UNCHECKED = {"fused": fused.fused_run, "triton": triton_run}


def bind_backend(
    name: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    shape: AttnShape,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    return_weights: bool,
) -> Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]:
    """``call(query, key, value, attn_mask)`` running backend ``name`` with every other argument bound, returning
    ``out``, or ``(out, weights)`` with ``return_weights``: what ``attention.routes`` keeps for a checked signature.
    Call it once the backend has run this signature (its own checks passed)."""
    kwargs = dict(shape=shape, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if name == "sdpa" and not return_weights:
        return prepare_sdpa(query, key, value, attn_mask=attn_mask, **kwargs)
    run = UNCHECKED.get(name)
    if run is not None and not return_weights and dropout_p == 0.0:
        del kwargs["dropout_p"]
        return lambda q, k, v, m: run(q, k, v, attn_mask=m, **kwargs)
    fn = BACKENDS[name]
    if return_weights:
        return lambda q, k, v, m: fn(q, k, v, attn_mask=m, return_weights=True, **kwargs)
    return lambda q, k, v, m: fn(q, k, v, attn_mask=m, return_weights=False, **kwargs)[0]


# Up to this many query rows per KV head (G * L) the call is decode-like: the grouped matmul reads K/V once and
# beats SDPA's flash kernel, which walks the cache once per query head. Measured with benchmarks/attention.py.
DECODE_ROWS = 32

# Up to this many query rows per KV head the native fused kernel, where built (float32/bfloat16: `fused.supports`),
# beats the grouped matmul: it reads K/V once, close to the read bandwidth. Built without SIMD its float32 loops lose,
# so there `auto` takes it for bf16 only (`fused_is_fast`). The measurements: docs/performance.md, "Native CPU kernels".
FUSED_ROWS = 32


def fused_is_fast(dtype: torch.dtype) -> bool:
    """Whether the fused kernel beats the grouped matmul for decode in ``dtype`` on this CPU (comment above)."""
    return dtype == torch.bfloat16 or kernels.vectorized()


def choose_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    shape: AttnShape,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    return_weights: bool,
    variant: bool = False,
    sinks_grad: bool = False,
) -> str:
    """The ``auto`` policy. On CUDA: ``gqa.attention.backends.cuda_routing.route_cuda`` (``variant``: the call has a
    window, soft-capping or sinks, ``sinks_grad``: sinks that need a gradient). On CPU: the native fused kernel for
    decode (where built); the grouped matmul for other decode-like shapes, weights or dropout; SDPA where it is
    natively grouped (prefill); else the grouped matmul."""
    rows = shape.G * shape.L  # query rows per KV head
    if query.numel() == 0 or key.numel() == 0:
        return "grouped"  # empty in or out: plain tensor ops give the empty or all-zero result
    if shape.broadcast:
        return "grouped"  # batch dims that broadcast: the matmuls broadcast them as views; the kernels want one N
    if query.device.type == "cuda":
        return _cuda_backend(query, key, value, shape, attn_mask, dropout_p, is_causal, scale, return_weights,
                             variant, sinks_grad)  # fmt: skip
    if (
        rows <= FUSED_ROWS
        and fused_is_fast(query.dtype)
        and fused.supports(query, key, value, dropout_p=dropout_p, return_weights=return_weights, attn_mask=attn_mask)
        is None
    ):
        return "fused"
    if return_weights or dropout_p > 0.0 or rows <= DECODE_ROWS:
        return "grouped"
    native = sdpa_is_native(
        query,
        key,
        value,
        shape=shape,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
    )
    return "sdpa" if native else "grouped"


def triton_runs(query, key, value, dropout_p: float, return_weights: bool, attn_mask=None) -> bool:
    """Whether the split-KV kernel runs these tensors (triton installed, device, dtype, sizes, strides)."""
    return split_kv.supports(query, key, value, dropout_p=dropout_p, return_weights=return_weights,
                             attn_mask=attn_mask) is None  # fmt: skip


def _cuda_backend(query, key, value, shape, attn_mask, dropout_p, is_causal, scale, return_weights, variant=False,
                  sinks_grad=False) -> str:  # fmt: skip
    capability = device_capability(query.device)
    if (  # route_cuda's first rule, checked before building its argument (host time matters on a GPU)
        not variant
        and attn_mask is None
        and not return_weights
        and dropout_p == 0.0
        and flash_supports(capability, query.dtype, shape.D, shape.D_v)
        and not (is_causal and shape.L > shape.S)
    ):
        return "sdpa"
    call = CudaCall(
        capability=capability,
        dtype=query.dtype,
        shape=shape,
        mask=None if attn_mask is None else ("bool" if attn_mask.dtype == torch.bool else "float"),
        is_causal=is_causal,
        dropout_p=dropout_p,
        return_weights=return_weights,
        needs_grad=need_grad(query, key, value, attn_mask),
        triton=triton_runs(query, key, value, dropout_p, return_weights, attn_mask),
        variant=variant,
        sinks_grad=sinks_grad,
        flex=variant and flex.supports(query, key, value, dropout_p=dropout_p, return_weights=return_weights) is None,
    )
    if not variant and route_cuda(call) == "grouped" and not (return_weights or dropout_p > 0.0):  # torch natively?
        native = sdpa_is_native(query, key, value, shape=shape, attn_mask=attn_mask, dropout_p=dropout_p,
                                is_causal=is_causal, scale=scale)  # fmt: skip
        call = replace(call, sdpa_native=native)
    return route_cuda(call)
