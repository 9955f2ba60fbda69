"""The SDPA backend: ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` where torch runs it
natively grouped.

torch's fused kernels (the CPU flash kernel; flash/cuDNN on CUDA) index the shared KV head per query head, but its
math fallback — chosen for dropout, 3-D inputs and some dtypes and masks — copies K/V with ``repeat_interleave``.
This backend therefore flattens the batch dims to exactly one, turns our bottom-right causal mask into an explicit
mask when ``L != S`` (torch's ``is_causal`` is top-left) — on CUDA into ``causal_lower_right``, which torch runs on
the flash kernel whose own causal is bottom-right — and refuses to run when torch would pick the copying path.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams
from torch.nn.attention import SDPBackend

from ..._compiler import assume_constant_result
from ..checks import AttnShape, shape_str
from ..masks import causal_mask, merge_masks
from .cuda_routing import device_capability, flash_supports


def _to_4d(t: torch.Tensor) -> torch.Tensor:
    """``(*B, H, L, D)`` -> ``(N, H, L, D)`` with ``N = prod(B)`` (a view for the usual layouts)."""
    if t.dim() == 4:
        return t  # the common case, without a reshape call (a few µs of host time per call on a GPU)
    return t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


def _mask_4d(mask: torch.Tensor, shape: AttnShape) -> torch.Tensor:
    """A mask broadcastable to ``(*B, H_q, L, S)`` as one broadcastable to ``(N, H_q, L, S)``."""
    if mask.dim() <= 2 or (mask.dim() == 4 and len(shape.batch) == 1):
        return mask
    mask = mask.reshape((1,) * (len(shape.scores) - mask.dim()) + tuple(mask.shape))  # one dim per score dim
    if len(shape.batch) == 0:
        return mask[None]  # torch's fused kernels want a 4-D mask here
    if all(s == 1 for s in mask.shape[:-3]):
        return mask.reshape(1, *mask.shape[-3:])
    return mask.expand(*shape.batch, *mask.shape[-3:]).reshape(math.prod(shape.batch), *mask.shape[-3:])


def _is_causal_bias(mask: object) -> bool:
    """Whether ``mask`` is torch's ``CausalBias`` (there is none unless its module, which imports dynamo, was
    imported: ``_inputs`` imports it on CUDA only)."""
    bias = sys.modules.get("torch.nn.attention.bias")
    return bias is not None and isinstance(mask, bias.CausalBias)


def _inputs(query, key, value, shape: AttnShape, attn_mask, is_causal):
    q, k, v = _to_4d(query), _to_4d(key), _to_4d(value)
    mask = None if attn_mask is None else _mask_4d(attn_mask, shape)
    if is_causal and shape.L == 1:
        is_causal = False  # bottom-right, one query sees every key
    native_causal = is_causal and mask is None and shape.L == shape.S
    if is_causal and mask is None and shape.L < shape.S and query.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right  # imports dynamo: only when used

        mask = causal_lower_right(shape.L, shape.S)  # flash's own causal is bottom-right: no mask materialized
    elif is_causal and not native_causal:
        mask = merge_masks(mask, causal_mask(shape.L, shape.S, query.device))
    if not _is_causal_bias(mask) and mask is not None and mask.dtype not in (torch.bool, query.dtype):
        mask = mask.to(query.dtype)
    return q, k, v, mask, native_causal


def _fused_choice(q, k, v, mask, native_causal: bool, scale: float | None, grouped: bool) -> bool:
    """Whether torch's own dispatcher picks a fused (natively grouped) kernel for these inputs."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, native_causal, scale=scale, enable_gqa=grouped)
    except Exception:  # an older torch that cannot answer: assume the copying path
        return False
    return SDPBackend(choice) not in (SDPBackend.MATH, SDPBackend.ERROR)


def _layout(t: torch.Tensor) -> tuple:
    """What of a tensor the kernel choice depends on: heads, last dim, its contiguity, dtype, device."""
    return t.shape[1], t.shape[-1], t.stride(-1) == 1, t.dtype, str(t.device)


def _stand_in(heads: int, dim: int, contiguous: bool, dtype: torch.dtype, device: str) -> torch.Tensor:
    t = torch.zeros(1, heads, 1, dim * (1 if contiguous else 2), dtype=dtype, device=device)  # (1, H, 1, D)
    return t if contiguous else t[..., ::2]


_PROBED: dict[tuple, bool] = {}


@assume_constant_result
def _fused_choice_probe(q: tuple, k: tuple, v: tuple, mask: tuple | None, native_causal: bool, grouped: bool) -> bool:
    """``_fused_choice`` for a compiled call, where torch's dispatcher query cannot be traced: asked once per kind of
    call on one-token stand-ins with the same heads, head dims, strides, dtypes, device and mask kind. The answer is
    a constant of the graph (the CPU kernels' rules depend on nothing else; on CUDA sequence lengths can matter)."""
    key = (q, k, v, mask, native_causal, grouped)
    if key not in _PROBED:
        m = None if mask is None else torch.ones((1,) * mask[0], dtype=mask[1], device=q[4])
        _PROBED[key] = _fused_choice(_stand_in(*q), _stand_in(*k), _stand_in(*v), m, native_causal, None, grouped)
    return _PROBED[key]


def _flash_takes_lower_right(q, k, v, grouped: bool) -> bool:
    """Whether ``causal_lower_right`` runs on the flash kernel (as torch's ``CausalBias`` dispatch decides), the one
    path it takes without materializing the mask or copying K/V."""
    try:
        params = SDPAParams(q, k, v, None, 0.0, False, grouped)
        return bool(torch.backends.cuda.can_use_flash_attention(params))
    except (TypeError, RuntimeError):  # an older torch without enable_gqa in SDPAParams
        return False


def _flash_certain(q, k, v, mask) -> bool:
    """Inputs SDPA's flash kernel takes for certain (no mask, half precision, dense last dims, sm80-sm90), so torch
    never falls to math for them: no need to ask its dispatcher, whose checks cost tens of µs per call on CUDA."""
    if q.device.type != "cuda" or mask is not None or any(t.stride(-1) != 1 for t in (q, k, v)):
        return False
    return flash_supports(device_capability(q.device), q.dtype, q.shape[-1], v.shape[-1])


def _native(q, k, v, mask, dropout_p: float, native_causal: bool, scale: float, grouped: bool) -> bool:
    if dropout_p > 0.0:
        return False  # every CPU path with dropout is the copying math path
    if _flash_certain(q, k, v, mask):
        return True
    if _is_causal_bias(mask):
        return _flash_takes_lower_right(q, k, v, grouped)
    if torch.compiler.is_compiling():
        mask_kind = None if mask is None else (mask.dim(), mask.dtype)
        return _fused_choice_probe(_layout(q), _layout(k), _layout(v), mask_kind, native_causal, grouped)
    return _fused_choice(q, k, v, mask, native_causal, scale, grouped)


def sdpa_is_native(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    shape: AttnShape,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
) -> bool:
    """True when torch would run this call on a fused, natively grouped kernel (no K/V copy)."""
    if dropout_p > 0.0 or shape.broadcast:
        return False
    q, k, v, mask, native_causal = _inputs(query, key, value, shape, attn_mask, is_causal)
    return _native(q, k, v, mask, dropout_p, native_causal, scale, shape.H_q != shape.H_kv)


def sdpa_attention(
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
) -> tuple[torch.Tensor, None]:
    if return_weights:
        raise ValueError("backend='sdpa' cannot return attention weights; use backend='grouped' or 'auto'")
    if query.numel() == 0 or key.numel() == 0:
        raise ValueError(
            f"backend='sdpa' cannot run empty inputs (query {shape_str(query)}, key {shape_str(key)}); use 'auto'"
        )
    if shape.broadcast:
        raise ValueError(
            f"backend='sdpa' cannot broadcast batch dims (query {shape_str(query)}, key {shape_str(key)}, value "
            f"{shape_str(value)}): torch's fused kernels want equal ones; use backend='grouped' or 'auto'"
        )
    q, k, v, mask, native_causal = _inputs(query, key, value, shape, attn_mask, is_causal)
    if not _native(q, k, v, mask, dropout_p, native_causal, scale, shape.H_q != shape.H_kv):
        raise ValueError(
            f"backend='sdpa' would fall back to torch's math path, which copies K/V per query head "
            f"(dtype {query.dtype}, device {query.device}, dropout_p {dropout_p}, D {shape.D}, D_v {shape.D_v}); "
            "use backend='grouped' or 'auto'"
        )
    return _sdpa_run(q, k, v, mask, native_causal, query, shape, dropout_p, scale), None


def _sdpa_run(q, k, v, mask, native_causal: bool, query, shape: AttnShape, dropout_p: float, scale: float):
    """SDPA on ``_inputs``' tensors, the fused kernels' edge cases put right, the output in ``query``'s batch dims."""
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=native_causal,
        scale=scale,
        enable_gqa=shape.H_q != shape.H_kv,
    )  # (N, H_q, L, D_v)
    if q.device.type == "cpu" and shape.S < 16:
        # torch's CPU flash kernel (2.13) returns finite values for a query row holding a NaN when S < 16 (fewer
        # keys than one vector of its max); the other backends give NaN, as the definition does. Put it back.
        out = out.masked_fill(q.isnan().any(-1, keepdim=True), float("nan"))  # mask (N, H_q, L, 1)
    if q.device.type == "cuda" and isinstance(mask, torch.Tensor) and not _is_causal_bias(mask):
        # torch's fused CUDA kernels give a query row whose mask hides every key the mean of V (or NaN); the
        # definition, and every other backend, gives zeros
        seen = mask.any(-1, keepdim=True) if mask.dtype == torch.bool else (mask != float("-inf")).any(-1, True)
        out = out.masked_fill(~seen, 0.0)  # seen (N | 1, H | 1, L | 1, 1)
    if len(shape.batch) == 1:
        return out
    return out.reshape(*shape.batch, shape.H_q, shape.L, shape.D_v)


def prepare_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    shape: AttnShape,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """``call(query, key, value, attn_mask) -> out`` for later calls of this checked signature (``attention.routes``):
    with no mask of the caller's and nothing to put right afterwards, a bare SDPA call with every argument bound (the
    causal mask, where one is needed, depends on ``L`` and ``S`` alone and is made once here)."""
    mask, native_causal = _inputs(query, key, value, shape, attn_mask, is_causal)[3:]
    grouped = shape.H_q != shape.H_kv
    bare = (
        attn_mask is None
        and len(shape.batch) == 1
        and (mask is None or _is_causal_bias(mask) or query.device.type == "cpu")
        and not (query.device.type == "cpu" and shape.S < 16)
    )
    if bare:
        sdpa = F.scaled_dot_product_attention

        def call(query, key, value, attn_mask):
            return sdpa(query, key, value, attn_mask=mask, dropout_p=dropout_p, is_causal=native_causal, scale=scale,
                        enable_gqa=grouped)  # fmt: skip

        return call

    def call_with_mask(query, key, value, attn_mask):
        q, k, v, m, causal = _inputs(query, key, value, shape, attn_mask, is_causal)
        return _sdpa_run(q, k, v, m, causal, query, shape, dropout_p, scale)

    return call_with_mask
