"""The ``flex`` backend: torch's FlexAttention, for the calls SDPA cannot take exactly — a sliding window, soft-capping,
sinks — at prefill lengths on a GPU (the decode kernels take the short ones).

A window and bottom-right causal are a ``mask_mod`` of the query and key positions alone, made into a block mask
(``create_block_mask``, kept per shape and window) so that whole blocks outside every window are skipped; soft-capping
and a user mask are a ``score_mod``; grouped heads are FlexAttention's own (``enable_gqa``: K/V are not copied per
query head). Sinks rescale the output by the share of the softmax the real keys keep, from the log-sum-exp FlexAttention
returns: ``out * sigmoid(lse - sink)``. On CUDA the call is compiled (``torch.compile(flex_attention)``: a fused
kernel); elsewhere it runs unfused (tests, CPU), materializing the scores.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from ..checks import AttnShape, Window, sinks_need_grad

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
MIN_HEAD_DIM = 16  # the compiled kernel's smallest head dim
MAX_HEAD_DIM = 256
BLOCK_MASKS = 64  # block masks kept (one per shape, window and device)


def supports(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    dropout_p: float,
    return_weights: bool,
    sinks: torch.Tensor | None = None,
) -> str | None:
    """``None`` if FlexAttention can run this call, else the reason it cannot."""
    if _flex() is None:
        return "this torch has no FlexAttention (torch.nn.attention.flex_attention)"
    if return_weights or dropout_p > 0.0:
        return "attention weights / dropout"
    if query.dtype not in DTYPES or (query.device.type == "cuda" and query.dtype == torch.float64):
        return f"dtype {query.dtype}"
    if query.numel() == 0 or key.numel() == 0:
        return "empty inputs (no query or no key)"
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        return "batch dims that differ between query, key and value (broadcast)"
    if query.device.type == "cuda":
        D, D_v = query.shape[-1], value.shape[-1]
        if D_v != D or not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM or D % 8:
            return f"head dims {D}, {D_v} (equal, a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] on CUDA)"
    grad = torch.is_grad_enabled()
    if sinks_need_grad(sinks):
        return "sinks that require grad (their gradient would go through the log-sum-exp)"
    if query.device.type == "cpu" and grad and any(t.requires_grad for t in (query, key, value)):
        return "inputs that need gradients on CPU (FlexAttention has no backward there)"
    return None


@functools.cache
def _flex():
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


@functools.cache
def _compiled():
    return torch.compile(_flex().flex_attention)


def flex_attention_rows(
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
    reason = supports(query, key, value, dropout_p=dropout_p, return_weights=return_weights, sinks=sinks)
    if reason is not None:
        raise ValueError(f"backend 'flex' cannot run this call: {reason}")
    N, H_q, L, S = math.prod(shape.batch), shape.H_q, shape.L, shape.S
    q = query.reshape(N, H_q, L, shape.D)
    k = key.reshape(N, shape.H_kv, S, shape.D)
    v = value.reshape(N, shape.H_kv, S, shape.D_v)
    mask = None if attn_mask is None else attn_mask.expand(shape.scores).reshape(N, H_q, L, S)  # views if it can
    left, right = (None, None) if window is None else window
    block_mask = None
    if is_causal or left is not None or right is not None:
        block_mask = _block_mask(L, S, is_causal, left, right, query.device)
    flex = _compiled() if query.device.type == "cuda" else _flex().flex_attention
    score_mod = _score_mod(softcap, mask)
    kwargs = {}
    if sinks is not None:
        kwargs = _lse_request()
    with warnings.catch_warnings():  # unfused off CUDA: on purpose (tests, CPU)
        warnings.filterwarnings("ignore", message=".*without torch.compile.*")
        result = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True, **kwargs)
    if sinks is None:
        out = result
    else:
        out, aux = result
        lse = aux if isinstance(aux, torch.Tensor) else aux.lse  # (N, H_q, L) float32, natural log
        kept = torch.sigmoid(lse - sinks.to(lse.dtype).view(1, H_q, 1))  # the real keys' share of the softmax
        kept = kept.masked_fill(lse == float("-inf"), 0.0)  # a row that sees no key: zeros (with a sink of -inf too)
        out = (out.to(kept.dtype) * kept[..., None]).to(query.dtype)
    return out.reshape(*shape.batch, H_q, L, shape.D_v), None


def _lse_request() -> dict:
    """How this torch asks FlexAttention for the log-sum-exp (``return_aux`` from 2.9 on, ``return_lse`` before)."""
    aux = getattr(_flex(), "AuxRequest", None)
    return {"return_lse": True} if aux is None else {"return_aux": aux(lse=True)}


def _score_mod(softcap: float | None, mask: torch.Tensor | None):
    """Soft-capping, then the user's mask (additive, or bool: -inf where False), on each scaled score (float32: a cap
    beyond its range is none, as ``masks.soft_cap`` has it)."""
    if softcap is not None and softcap > torch.finfo(torch.float32).max:
        softcap = None
    if softcap is None and mask is None:
        return None
    additive = mask is not None and mask.dtype != torch.bool

    def score_mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if mask is not None:
            m = mask[b, h, q_idx, kv_idx]
            score = score + m if additive else torch.where(m, score, -float("inf"))
        return score

    return score_mod


def _block_mask(L: int, S: int, is_causal: bool, left: int | None, right: int | None, device: torch.device):
    key = (L, S, is_causal, left, right, device)
    cached = _block_masks.get(key)
    if cached is None:
        if len(_block_masks) >= BLOCK_MASKS:
            _block_masks.clear()
        offset = S - L  # bottom-right: query i's diagonal key is i + S - L

        def visible(b, h, q_idx, kv_idx):
            diagonal = q_idx + offset
            seen = kv_idx >= 0
            if is_causal:
                seen = seen & (kv_idx <= diagonal)
            if left is not None:
                seen = seen & (kv_idx >= diagonal - left)
            if right is not None:
                seen = seen & (kv_idx <= diagonal + right)
            return seen

        cached = _block_masks[key] = _flex().create_block_mask(visible, None, None, L, S, device=device)
    return cached


_block_masks: dict = {}
