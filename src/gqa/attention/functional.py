"""``grouped_attention``: one attention call for MHA, GQA and MQA."""

from __future__ import annotations

import dataclasses

import torch

from .backends import BACKENDS, bind_backend, choose_backend
from .checks import (
    AttnShape,
    check_dropout,
    check_mask,
    check_qkv,
    check_scale,
    check_sinks,
    check_softcap,
    check_window,
    sinks_need_grad,
)
from .masks import merge_masks, window_mask
from .routes import Route, find_route, remember_route, signature

_last: list[str | None] = [None]


def last_backend() -> str | None:
    """The backend the last eager ``grouped_attention`` call in this process ran (``auto`` resolved), or None."""
    return _last[0]


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    window: int | tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_weights: bool = False,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention where ``H_kv`` key/value heads are shared by ``H_q`` query heads.

    Query head ``i`` uses key/value head ``i // (H_q // H_kv)``. ``H_kv == H_q`` is multi-head attention, ``H_kv == 1``
    multi-query attention. K/V are never copied per query head, on any backend.

    Parameters
    ----------
    query : Tensor ``(*B, H_q, L, D)``
    key : Tensor ``(*B, H_kv, S, D)``
    value : Tensor ``(*B, H_kv, S, D_v)``
        Any number of leading batch dims ``*B`` (including none); the same for all three. ``H_q % H_kv == 0``.
    attn_mask : Tensor, optional
        Broadcastable to ``(*B, H_q, L, S)``. Bool: True where attention is allowed. Float: added to the scores.
    dropout_p : float
        Dropout on the attention weights, applied whenever > 0 (as in torch SDPA; the module passes 0 in eval mode).
    is_causal : bool
        Causal mask aligned **bottom-right**: query ``i`` sees keys ``j <= i + S - L``. For ``L == S`` it is the usual
        lower triangle; with a KV cache (``L < S``) the last query sees every key. torch SDPA's ``is_causal`` is
        top-left (``j <= i``), which is wrong for cached decoding. Combines with ``attn_mask``.
    scale : float, optional
        Multiplies the scores; default ``D ** -0.5``.
    window : int or (int | None, int | None), optional
        Sliding window as FlashAttention's ``window_size``: ``(left, right)``, an int meaning ``(left, None)``, a side
        that is None unbounded. Aligned bottom-right like ``is_causal``: query ``i`` sees keys ``j`` with
        ``i + S - L - left <= j <= i + S - L + right``. Combines with ``is_causal`` and ``attn_mask``.
    softcap : float, optional
        Logit soft-capping (Gemma 2): ``softcap * tanh(scores / softcap)`` on the scaled scores, before any mask.
    sinks : Tensor ``(H_q,)``, optional
        A logit per query head joining every row's softmax as a key whose value is zero (gpt-oss's attention sinks);
        the weights of the real keys then sum to less than 1. Gradients flow to it.
    return_weights : bool
        Also return the attention weights ``(*B, H_q, L, S)`` (after dropout, if any).
    backend : {"auto", "reference", "grouped", "sdpa", "fused", "triton", "flex"}
        ``auto`` picks per shape, device and dtype (``last_backend()`` says which ran); ``fused`` is the native CPU
        decode kernel (``gqa.kernels``), ``triton`` the GPU split-KV decode kernel (``gqa.kernels.triton.split_kv``),
        ``flex`` torch's FlexAttention (compiled on CUDA). The keys no query's window reaches are never read;
        ``triton`` and ``flex`` take the window itself, the others as a mask. ``softcap`` and ``sinks`` run on every
        backend but ``sdpa``; on CUDA ``auto`` sends such calls to ``triton`` (decode) or ``flex`` (prefill), on CPU
        to ``fused`` where it would run the plain call, else to ``grouped``.

    Returns
    -------
    Tensor ``(*B, H_q, L, D_v)`` in the input dtype, or ``(out, weights)`` with ``return_weights=True``.

    Notes
    -----
    A query row with no visible key returns zeros (not NaN), with zero gradients, with sinks too (a sink of ``-inf``
    is no sink). For float16/bfloat16 inputs the scores and softmax are computed in float32 and the output is cast
    back. The checks and the choice of backend are made once per call signature (shapes, strides, dtypes, devices,
    the scalars) and remembered (``gqa.attention.routes``): a repeated call costs about what the backend's own call
    costs.
    """
    compiling = torch.compiler.is_compiling()
    if window is not None or softcap is not None or sinks is not None:
        return _variant_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, window, softcap, sinks,
                                  return_weights, backend)  # fmt: skip
    sig = None
    if not compiling:
        sig = signature(query, key, value, attn_mask, dropout_p, is_causal, scale, return_weights, backend)
        route = find_route(sig)
        if route is not None:
            _last[0] = route.backend
            return route.call(query, key, value, attn_mask)
    shape = _check_call(query, key, value, attn_mask, dropout_p, is_causal, scale, backend)
    kwargs = dict(
        shape=shape,
        attn_mask=attn_mask,
        dropout_p=float(dropout_p),
        is_causal=is_causal,
        scale=float(shape.D**-0.5 if scale is None else scale),
    )
    if backend == "auto":
        backend = choose_backend(query, key, value, return_weights=return_weights, **kwargs)
    out, weights = BACKENDS[backend](query, key, value, return_weights=return_weights, **kwargs)
    if not compiling:
        _last[0] = backend
        call = bind_backend(backend, query, key, value, return_weights=return_weights, **kwargs)
        remember_route(sig, Route(backend, call))
    return (out, weights) if return_weights else out


def _check_call(query, key, value, attn_mask, dropout_p, is_causal, scale, backend) -> AttnShape:
    """Every check of a call's tensors and plain options (``ValueError`` / ``TypeError`` naming the argument)."""
    shape = check_qkv(query, key, value)
    check_mask(attn_mask, shape, query)
    check_dropout(dropout_p)
    check_scale(scale)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    return shape


SCORE_MOD_BACKENDS = ("grouped", "reference", "fused", "triton", "flex")  # the backends that take softcap and sinks
KERNEL_BACKENDS = ("fused", "triton", "flex")  # sinks without gradients
WINDOW_BACKENDS = ("triton", "flex")  # take the window itself, not as a mask


def _variant_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, window, softcap, sinks,
                       return_weights, backend):  # fmt: skip
    """``grouped_attention`` with a window, soft-capping or sinks (not remembered per signature: ``routes``): the
    window becomes a bottom-right band mask merged with ``attn_mask``; softcap and sinks go to a backend that takes
    them."""
    shape = _check_call(query, key, value, attn_mask, dropout_p, is_causal, scale, backend)
    sides = check_window(window)
    softcap = check_softcap(softcap)
    check_sinks(sinks, shape, query)
    user_mask = attn_mask
    if sides is not None:
        if not return_weights:  # the keys no query's window reaches are not read at all
            key, value, attn_mask, shape = _within_window(key, value, attn_mask, shape, sides[0])
            user_mask = attn_mask
        if _hides_nothing(sides, shape):  # e.g. a decoded token over its trimmed window: a plain call
            sides = None
            if softcap is None and sinks is None:
                return grouped_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                         return_weights=return_weights, backend=backend)  # fmt: skip
        else:
            attn_mask = merge_masks(attn_mask, window_mask(shape.L, shape.S, *sides, query.device))
    kwargs = dict(
        shape=shape,
        attn_mask=attn_mask,
        dropout_p=float(dropout_p),
        is_causal=is_causal,
        scale=float(shape.D**-0.5 if scale is None else scale),
    )
    modified = softcap is not None or sinks is not None
    if backend == "auto":
        backend = choose_backend(query, key, value, return_weights=return_weights, variant=True,
                                 sinks_grad=sinks_need_grad(sinks), **kwargs)  # fmt: skip
        if modified and not (backend in KERNEL_BACKENDS and not sinks_need_grad(sinks)):
            backend = "grouped"  # where the plain call would not run a kernel (which takes both)
    elif modified and backend not in SCORE_MOD_BACKENDS:
        raise ValueError(
            f"backend={backend!r} cannot apply softcap or sinks; use 'auto' or one of {SCORE_MOD_BACKENDS}"
        )
    extra = dict(softcap=softcap, sinks=sinks) if modified else {}
    if backend in WINDOW_BACKENDS and sides is not None:  # the window itself, not its mask
        kwargs["attn_mask"], extra["window"] = user_mask, sides
    out, weights = BACKENDS[backend](query, key, value, return_weights=return_weights, **kwargs, **extra)
    if not torch.compiler.is_compiling():
        _last[0] = backend
    return (out, weights) if return_weights else out


def _within_window(key, value, attn_mask, shape: AttnShape, left: int | None):
    """``key``, ``value`` and ``attn_mask`` without the keys before ``S - L - left``, which no query's window
    reaches (query ``i`` sees keys from ``i + S - L - left`` on), and the call's shape with the new ``S``. The window
    and a causal mask stay aligned bottom-right, so they mean the same keys over the shorter span: a decoded token
    with a ``W``-key window reads ``W`` keys, not the whole cache."""
    first = 0 if left is None else shape.S - shape.L - left
    if first <= 0:
        return key, value, attn_mask, shape
    if attn_mask is not None and attn_mask.shape[-1] == shape.S:
        attn_mask = attn_mask[..., first:]
    return key[..., first:, :], value[..., first:, :], attn_mask, dataclasses.replace(shape, S=shape.S - first)


def _hides_nothing(sides: tuple[int | None, int | None], shape: AttnShape) -> bool:
    """Whether the window ``(left, right)`` hides no key from any query: the last query's first key
    (``S - 1 - left``) is key 0 at the latest, and the first query's last (``S - L + right``) the last key."""
    left, right = sides
    return (left is None or shape.S - 1 - left <= 0) and (right is None or right >= shape.L - 1)
