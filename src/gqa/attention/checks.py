"""Input validation shared by the function, the module and the caches.

Every check raises ``ValueError`` (bad sizes) or ``TypeError`` (bad types or dtypes) with a message that names the
argument and shows its shape, so a wrong call never turns into a wrong answer, a NaN or a silent copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def shape_str(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def flat_view(t: torch.Tensor, tail: int) -> torch.Tensor | None:
    """``t`` with its leading dims merged into one before its last ``tail`` dims, as a view (``None`` where that
    would need a copy): how the kernels take any number of batch dims without copying K/V."""
    try:
        return t.view(-1, *t.shape[-tail:]) if t.dim() > tail else t.unsqueeze(0)
    except RuntimeError:
        return None


def kernel_refusal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    dropout_p: float,
    return_weights: bool,
    attn_mask: torch.Tensor | None = None,
) -> str | None:
    """Why an inference decode kernel (the native CPU one, the Triton one) cannot take these tensors, or ``None``:
    no weights, dropout or gradients (of the inputs or of an additive ``attn_mask``, a learned bias), no empty inputs,
    K/V with contiguous rows and batch dims mergeable as a view."""
    if return_weights or dropout_p > 0.0:
        return "attention weights / dropout"
    if query.numel() == 0 or key.numel() == 0:
        return "empty inputs (no query or no key)"
    if need_grad(query, key, value, attn_mask):
        return "inputs that need gradients (no backward)"
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        return "key/value whose last dim is not contiguous"
    if flat_view(key, 3) is None or flat_view(value, 3) is None:
        return "key/value whose batch dims cannot be merged without a copy"
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        return "batch dims that differ between query, key and value (broadcast)"
    return None


def check_heads(num_heads: int, num_kv_heads: int) -> int:
    """Return the group size ``G = num_heads // num_kv_heads`` or raise."""
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


@dataclass(frozen=True)
class AttnShape:
    """Sizes of one call: ``query (*B, H_q, L, D)``, ``key (*B, H_kv, S, D)``, ``value (*B, H_kv, S, D_v)``."""

    batch: tuple[int, ...]  # the batch dims of the output: query's, key's and value's broadcast together
    H_q: int
    H_kv: int
    L: int
    S: int
    D: int
    D_v: int
    broadcast: bool = False  # query, key and value have different (broadcastable) batch dims

    @property
    def G(self) -> int:
        return self.H_q // self.H_kv

    @property
    def scores(self) -> tuple[int, ...]:
        return (*self.batch, self.H_q, self.L, self.S)


def check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> AttnShape:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.dim() < 3:
            raise ValueError(f"{name} must have shape (*B, H, L, D) with at least 3 dims, got {shape_str(t)}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype} and {value.dtype}")
    if key.device != query.device or value.device != query.device:
        raise ValueError(
            f"query, key and value must be on one device, got {query.device}, {key.device}, {value.device}"
        )
    if key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            f"query, key and value must have the same number of dims, got query {shape_str(query)}, "
            f"key {shape_str(key)}, value {shape_str(value)}"
        )
    *batch, H_q, L, D = query.shape
    *kbatch, H_kv, S, Dk = key.shape
    *vbatch, H_v, S_v, D_v = value.shape
    broadcast = not (tuple(kbatch) == tuple(batch) == tuple(vbatch))
    if broadcast:  # e.g. learned queries of batch 1 against K/V of batch N, as torch SDPA allows
        try:
            batch = list(torch.broadcast_shapes(tuple(batch), tuple(kbatch), tuple(vbatch)))
        except RuntimeError:
            raise ValueError(
                f"batch dims do not broadcast: query {shape_str(query)}, key {shape_str(key)}, value {shape_str(value)}"
            ) from None
    if Dk != D:
        raise ValueError(f"key head dim ({Dk}) must equal query head dim ({D}): key {shape_str(key)}")
    if H_v != H_kv or S_v != S:
        raise ValueError(f"value {shape_str(value)} must have key's head count and length, key is {shape_str(key)}")
    if min(H_q, H_kv) < 1 or D < 1:
        raise ValueError(f"empty head or feature dim: query {shape_str(query)}, key {shape_str(key)}")
    if H_q % H_kv:
        raise ValueError(
            f"query heads H_q ({H_q}) must be divisible by key/value heads H_kv ({H_kv}): "
            f"query {shape_str(query)}, key {shape_str(key)}"
        )
    return AttnShape(tuple(batch), H_q, H_kv, L, S, D, D_v, broadcast)


def check_mask(attn_mask: torch.Tensor | None, shape: AttnShape, query: torch.Tensor) -> None:
    """A mask must be bool or floating point and broadcast to ``(*B, H_q, L, S)``."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(
            f"attn_mask must be bool (True = attend) or floating point (added to the scores), "
            f"got dtype {attn_mask.dtype}"
        )
    if attn_mask.device != query.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
    target = shape.scores
    ok = attn_mask.dim() <= len(target)
    if ok:
        try:
            ok = torch.broadcast_shapes(attn_mask.shape, target) == torch.Size(target)
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(
            f"attn_mask of shape {shape_str(attn_mask)} does not broadcast to (*B, H_q, L, S) = {tuple(target)}"
        )


def check_scale(scale: float | None) -> None:
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")


def check_dropout(dropout_p: float, name: str = "dropout_p") -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {dropout_p}")


Window = tuple[int | None, int | None]  # (left, right) keys around the bottom-right diagonal; None: unbounded


def check_window(window: object) -> Window | None:
    """``window`` as ``(left, right)``: an int is ``(left, None)``; each side an int >= 0 or None (unbounded)."""
    if window is None:
        return None
    sides = (window, None) if isinstance(window, int) and not isinstance(window, bool) else window
    if not isinstance(sides, tuple) or len(sides) != 2:
        raise TypeError(f"window must be an int (left) or a (left, right) tuple, got {window!r}")
    for name, n in zip(("left", "right"), sides, strict=True):
        if n is None:
            continue
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"window's {name} side must be an int or None, got {n!r}")
        if n < 0:
            raise ValueError(f"window's {name} side must be >= 0 (None for unbounded), got {n}")
    return sides


def check_softcap(softcap: object) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a float or None, got {type(softcap).__name__}")
    if not (softcap > 0 and softcap != float("inf")):
        raise ValueError(f"softcap must be a finite number > 0, got {softcap}")
    return float(softcap)


def sinks_need_grad(sinks: torch.Tensor | None) -> bool:
    """Whether ``sinks`` would need a gradient from this call (the inference kernels give none)."""
    return need_grad(sinks)


def need_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether any of ``tensors`` (``None``s skipped) would need a gradient from this call."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_sinks(sinks: object, shape: AttnShape, query: torch.Tensor) -> None:
    """Sinks: one logit per query head, ``(H_q,)``, floating point, on the query's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape (H_q,) = ({shape.H_q},), got {type(sinks).__name__}")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor, got dtype {sinks.dtype}")
    if sinks.shape != (shape.H_q,):
        raise ValueError(f"sinks must have shape (H_q,) = ({shape.H_q},), got {shape_str(sinks)}")
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {query.device}")
