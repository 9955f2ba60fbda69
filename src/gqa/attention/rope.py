"""Rotary position embedding (RoPE) in the two layouts in use, with Llama-3 and linear frequency scaling.

Layouts of the rotated ``rotary_dim`` features of a head (the rest pass through unchanged):

* ``interleaved=False`` — HF/Llama "half rotation": feature ``i`` pairs with ``i + rotary_dim / 2``.
* ``interleaved=True`` — GPT-J / original RoFormer: feature ``2i`` pairs with ``2i + 1``.

Pair ``i`` at position ``p`` is rotated by the angle ``p * inv_freq[i]``, ``inv_freq[i] = theta ** (-2i / rotary_dim)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .checks import shape_str


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama-3.1 frequency scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    if high <= low:
        raise ValueError(f"rope scaling needs high_freq_factor ({high}) > low_freq_factor ({low})")
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(
        wavelen > old_ctx / low, inv_freq / factor, torch.where(wavelen < old_ctx / high, inv_freq, blended)
    )


class RoPE(nn.Module):
    """Rotary embedding for ``(*B, H, L, D)`` queries and keys.

    Parameters
    ----------
    head_dim : int
        ``D`` of the tensors it rotates.
    theta : float
        Base of the frequencies (10000 for Llama 2, 500000 for Llama 3, 100000 for SmolLM2).
    rotary_dim : int, optional
        Rotate only the first ``rotary_dim`` features (partial rotary); default all of ``head_dim``. Must be even.
    interleaved : bool
        GPT-J pair layout instead of the HF/Llama half-rotation layout.
    scaling : mapping, optional
        HF ``rope_scaling``: ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
        "original_max_position_embeddings"}`` or ``{"rope_type": "linear", "factor"}``.
    max_position : int
        Initial length of the cos/sin table; it grows on demand. Under ``torch.compile`` cos/sin are computed from
        the frequencies instead (the same float64 arithmetic as the table), so any position works there too.

    The frequencies and the cos/sin tables stay float32 whatever ``.to(dtype)`` / ``.half()`` does to the module (as
    in HF transformers): in bfloat16 the low frequencies would be off by up to 0.4%, a rotation error that grows
    with the position. The rotation itself runs in float32 and is cast back to the input dtype.
    """

    _FLOAT32_BUFFERS = ("inv_freq", "cos_cached", "sin_cached")

    def __init__(
        self,
        head_dim: int,
        *,
        theta: float = 10000.0,
        rotary_dim: int | None = None,
        interleaved: bool = False,
        scaling: Mapping[str, Any] | None = None,
        max_position: int = 2048,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"rotary_dim ({rotary_dim}) must be even and >= 2")
        if rotary_dim > head_dim:
            raise ValueError(f"rotary_dim ({rotary_dim}) must not exceed head_dim ({head_dim})")
        for name, n in (("head_dim", head_dim), ("rotary_dim", rotary_dim)):
            if isinstance(n, bool) or not isinstance(n, int):
                raise TypeError(f"{name} must be an int, got {type(n).__name__}")
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            raise ValueError(f"theta must be > 0 and finite, got {theta!r}")
        self.head_dim, self.rotary_dim, self.theta, self.interleaved = (
            head_dim,
            rotary_dim,
            float(theta),
            interleaved,
        )
        self.scaling = dict(scaling) if scaling else None
        inv_freq = 1.0 / self.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim)
        self.position_scale = 1.0
        kind = (self.scaling or {}).get("rope_type", (self.scaling or {}).get("type", "default"))
        if kind in ("linear", "llama3"):
            factor = self.scaling.get("factor")
            if (
                isinstance(factor, bool)
                or not isinstance(factor, (int, float))
                or not math.isfinite(factor)
                or factor <= 0
            ):
                raise ValueError(f"rope scaling {kind!r} needs a finite factor > 0, got {factor!r}")
        if kind == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, self.scaling)
        elif kind == "linear":
            self.position_scale = 1.0 / float(self.scaling["factor"])
        elif kind != "default":
            raise ValueError(f"unsupported rope scaling type {kind!r}; supported: 'default', 'linear', 'llama3'")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # (rotary_dim / 2,)
        self.register_buffer("cos_cached", torch.empty(0, device=device), persistent=False)
        self.register_buffer("sin_cached", torch.empty(0, device=device), persistent=False)
        self._grow(max_position)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RoPE:
        """``.to()``, ``.cuda()``, ``.half()``...: move the float32 buffers, never cast them (class docstring)."""
        kept = {name: self._buffers[name] for name in self._FLOAT32_BUFFERS}
        super()._apply(fn, recurse)
        for name, old in kept.items():
            new = self._buffers[name]
            if new.dtype != torch.float32:
                self._buffers[name] = old.to(device=new.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta:g}, "
            f"interleaved={self.interleaved}, scaling={self.scaling}"
        )

    def _angles(self, positions: torch.Tensor) -> torch.Tensor:
        """float64 angles ``(*P, rotary_dim)`` of integer ``positions (*P)``: pairs ``(2i, 2i + 1)`` interleaved, or
        ``(i, i + rotary_dim / 2)`` in the half layout."""
        angles = (positions.double() * self.position_scale)[..., None] * self.inv_freq.double()  # (*P, rotary_dim / 2)
        return angles.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat([angles, angles], dim=-1)

    def _grow(self, length: int) -> None:
        """(Re)build the cos/sin tables for positions ``[0, length)`` (rounded up to a power of two)."""
        length = 1 << max(length - 1, 1).bit_length()
        angles = self._angles(torch.arange(length, device=self.inv_freq.device))  # (P, rotary_dim)
        self.cos_cached = angles.cos().float()
        self.sin_cached = angles.sin().float()

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``cos, sin`` of shape ``(*P, rotary_dim)`` for integer ``position_ids (*P)``."""
        if (
            not isinstance(position_ids, torch.Tensor)
            or position_ids.dtype == torch.bool
            or position_ids.is_floating_point()
            or position_ids.is_complex()
        ):
            got = position_ids.dtype if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
            raise TypeError(f"position_ids must be an integer tensor, got {got}")
        position_ids = position_ids.long()
        if torch.compiler.is_compiling():  # no table growth inside a graph: compute the few values needed
            angles = self._angles(position_ids)  # (*P, rotary_dim)
            return angles.cos().float(), angles.sin().float()
        if position_ids.numel():
            top = int(position_ids.max())
            if int(position_ids.min()) < 0:
                raise ValueError(f"position_ids must be >= 0, got min {int(position_ids.min())}")
            if top >= self.cos_cached.shape[0]:
                self._grow(top + 1)
        return self.cos_cached[position_ids], self.sin_cached[position_ids]

    def _rotate_pairs(self, x: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            pairs = x.unflatten(-1, (-1, 2))  # (..., rotary_dim / 2, 2)
            return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x (*B, H, L, D)`` by ``cos, sin (*P, L, rotary_dim)`` broadcast over heads; computed in float32."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"RoPE was built for head_dim {self.head_dim}, got a tensor of shape {shape_str(x)}")
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # (*P, 1, L, rotary_dim)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        xf = rot.float()
        out = (xf * cos + self._rotate_pairs(xf) * sin).to(x.dtype)
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query (*B, H_q, L, D)`` and ``key (*B, H_kv, L, D)`` at ``position_ids`` ``(L,)`` (shared by every
        row) or ``(B, L)`` (one row of positions per batch element)."""
        L = query.shape[-2]
        if position_ids.dim() == 0 or position_ids.shape[-1] != L or key.shape[-2] != L:
            raise ValueError(
                f"position_ids {shape_str(position_ids)} must end in the sequence length L={L} of query "
                f"{shape_str(query)} and key {shape_str(key)}"
            )
        if position_ids.dim() > 1 and position_ids.shape[:-1] != query.shape[:-3]:
            raise ValueError(f"position_ids {shape_str(position_ids)} batch dims do not match query {shape_str(query)}")
        cos, sin = self.cos_sin(position_ids)
        return self.rotate(query, cos, sin), self.rotate(key, cos, sin)
