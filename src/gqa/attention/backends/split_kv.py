"""The ``triton`` backend: the split-KV grouped decode kernel of ``gqa.kernels.triton.split_kv`` (CUDA; CPU tensors
under ``TRITON_INTERPRET=1``). Decode-shaped calls only (``L <= 16``), inference only; ``supports`` says why it
refuses. It takes a sliding window itself (reading only the window's keys), soft-capping and sinks."""

from __future__ import annotations

import torch

from ...kernels.triton.split_kv import launch, supports
from ..checks import AttnShape, Window, sinks_need_grad


def triton_attention(
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
    window: Window | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    reason = supports(query, key, value, dropout_p=dropout_p, return_weights=return_weights, attn_mask=attn_mask)
    if reason is None and sinks_need_grad(sinks):
        reason = "sinks that require grad (inference only)"
    if reason is not None:
        raise ValueError(f"backend 'triton' cannot run this call: {reason}")
    out = launch(query, key, value, shape, scale, is_causal, attn_mask, None, None, None, window=window,
                 softcap=softcap, sinks=sinks)  # fmt: skip
    return out, None


def triton_run(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    shape: AttnShape,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """The kernel on a call ``supports`` took (``attention.routes`` calls this for a signature already checked)."""
    return launch(query, key, value, shape, scale, is_causal, attn_mask, None, None, None)
