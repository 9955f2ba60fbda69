"""Masks: the bottom-right causal mask, padding masks, and how a mask meets the grouped score layout.

Conventions (the same as ``torch.nn.functional.scaled_dot_product_attention``):

* a **bool** mask is True where attention is *allowed*;
* a **float** mask is *added* to the scores (``-inf`` forbids a position);
* masks broadcast to the score shape ``(*B, H_q, L, S)``.

The causal mask is aligned **bottom-right**: query ``i`` of ``L`` sees keys ``j <= i + S - L`` of ``S``. With a KV cache
the ``L`` new queries are the *last* ``L`` positions of the sequence, so the last query sees every key. torch's own
``is_causal`` is aligned top-left (``j <= i``), which is only right when ``L == S``.
"""

from __future__ import annotations

import torch


def causal_mask(L: int, S: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Bottom-right aligned causal mask, bool ``(L, S)``, True where query ``i`` may see key ``j <= i + S - L``."""
    return torch.ones(L, S, dtype=torch.bool, device=device).tril(S - L)


def window_mask(L: int, S: int, left: int | None, right: int | None, device: torch.device | str | None = None):
    """Bool ``(L, S)``, True where query ``i`` may see key ``j``: ``i + S - L - left <= j <= i + S - L + right`` (a side
    that is None is unbounded), the band aligned bottom-right like ``causal_mask``."""
    i = torch.arange(L, device=device)[:, None] + (S - L)  # each query's own position among the keys
    j = torch.arange(S, device=device)[None, :]
    allowed = torch.ones(L, S, dtype=torch.bool, device=device)
    if left is not None:
        allowed &= j >= i - left
    if right is not None:
        allowed &= j <= i + right
    return allowed


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (Gemma 2's logit soft-capping), or the scores as they are. A cap beyond the
    scores' dtype's range leaves them as they are too (``scores / softcap`` would divide by inf, then ``0 * inf`` give
    NaN): that is the capped value to the dtype's rounding for every score below ``softcap / 4096``."""
    if softcap is None or softcap > torch.finfo(scores.dtype).max:
        return scores
    return torch.tanh(scores / softcap) * softcap


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor, may_have_empty_rows: bool) -> torch.Tensor:
    """Softmax over the last dim with one more logit per row, the head's sink (a key whose value is zero): the weights
    of the real keys, which then sum to less than 1. A row that sees no key gets zeros, with a sink of ``-inf`` too
    (which is no sink: ``softmax_rows`` over the row and its sink). ``sinks`` broadcasts to
    ``scores.shape[:-1] + (1,)``; ``may_have_empty_rows`` as ``softmax_rows`` takes it."""
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    weights = softmax_rows(torch.cat([scores, sink], dim=-1), may_have_empty_rows)
    return weights[..., :-1]


def padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Turn an HF-style ``(B, S)`` mask (1/True = real token, 0/False = padding) into a bool ``(B, 1, 1, S)`` mask.

    The result broadcasts over heads and queries, so it can be passed as ``attn_mask`` directly.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must have shape (B, S), got ({', '.join(map(str, attention_mask.shape))})")
    return attention_mask.bool()[:, None, None, :]


def merge_masks(attn_mask: torch.Tensor | None, other: torch.Tensor | None) -> torch.Tensor | None:
    """Combine two masks of either kind; bool ∧ bool stays bool, anything with a float mask becomes float."""
    if attn_mask is None:
        return other
    if other is None:
        return attn_mask
    if attn_mask.dtype == torch.bool and other.dtype == torch.bool:
        return attn_mask & other
    if attn_mask.dtype == torch.bool:
        attn_mask, other = other, attn_mask
    if other.dtype == torch.bool:
        return attn_mask.masked_fill(~other, float("-inf"))
    return attn_mask + other


def group_mask(mask: torch.Tensor, ndim: int, H_kv: int, G: int) -> torch.Tensor:
    """View a mask broadcastable to ``(*B, H_q, L, S)`` as one broadcastable to ``(*B, H_kv, G, L, S)``.

    ``ndim`` is the number of dims of the score tensor ``(*B, H_q, L, S)``. Query head ``h`` is ``(h // G, h % G)``
    in the grouped layout, which is exactly a reshape of the head dim; a head dim of 1 stays broadcast.
    """
    mask = mask.reshape((1,) * (ndim - mask.dim()) + tuple(mask.shape))
    heads = mask.shape[-3]
    split = (H_kv, G) if heads != 1 else (1, 1)
    return mask.unflatten(-3, split)


def apply_mask_(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Apply a (broadcastable) mask to float scores; returns the masked scores (in place where possible)."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, float("-inf"))
    return scores.add_(mask.to(scores.dtype))


def softmax_rows(scores: torch.Tensor, may_have_empty_rows: bool) -> torch.Tensor:
    """Softmax over the last dim where a row with no visible key (all ``-inf``) gives zeros, not NaN.

    The fix-up costs two extra passes, so it runs only when a mask could empty a row. Gradients stay finite: an empty
    row's scores are replaced by zeros before the softmax and its weights are zeroed after it.
    """
    if not may_have_empty_rows or scores.shape[-1] == 0:  # no keys at all: empty weights, zero output
        return torch.softmax(scores, dim=-1)
    empty = scores.amax(dim=-1, keepdim=True) == float("-inf")
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)
    return weights.masked_fill(empty, 0.0)
