"""``WindowKVCache``: the KV cache of a sliding-window layer, holding the window and not the whole context.

A layer whose queries see only their last ``window`` keys (themselves included) needs no older key. This cache keeps
``window + spare`` slots in sequence order, slot ``s`` holding position ``offset + s``: tokens are appended as in a
static cache, and when the next call's tokens do not fit, the last ``window - 1`` keys (all that its first query can
see) move to the front and ``offset`` moves on. That copy of ``window - 1`` rows happens once per ``spare`` decoded
tokens, and between copies the slots are what a static cache would hold, trimmed: the bottom-right window and causal
masks mean the same keys, so attention needs no mask of the cache's (only left padding gets one) and reads only the
window (``grouped_attention`` skips the keys no window reaches). Keys are stored after RoPE, so moving them changes
nothing. A call with more new tokens than ``spare + 1`` (a long prompt) attends to the kept keys joined to its own.

Eager or through the native one-call decode step (``native_rows``: the slots as a dense cache, in slot numbers);
``StaticKVCache`` is the one for compiled and graphed decoding (the offset is a Python int).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv import KVDtypeChoice, _KVCache, check_positive
from .sizes import WINDOW_SPARE as DEFAULT_SPARE  # slots beyond the window: decoded tokens between two moves


@dataclass
class SlotRows:
    """A ``WindowKVCache``'s slots as a dense cache (``kernels.ops.RowCache``) for one native decode step."""

    key: torch.Tensor
    value: torch.Tensor
    start: torch.Tensor  # (B,) int64, slot numbers
    cursor: torch.Tensor  # () int64: the new token's slot (the step adds 1)
    cache: WindowKVCache

    def advance(self) -> None:
        """Count the token the step wrote."""
        self.cache.cursor.add_(1)


class WindowKVCache(_KVCache):
    """``min(max_len, window + spare)`` slots for a layer whose queries see their last ``window`` keys.

    Buffers ``key (B, H_kv, slots, D)``, ``value (B, H_kv, slots, D_v)``; ``capacity`` is ``max_len``, the tokens the
    cache takes in all (writing past it raises ``ValueError``), ``nbytes`` what the slots hold.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        window: int,
        *,
        spare: int = DEFAULT_SPARE,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        kv_dtype: KVDtypeChoice = None,
    ) -> None:
        check_positive(max_len=max_len, window=window)
        if isinstance(spare, bool) or not isinstance(spare, int) or spare < 0:
            raise ValueError(f"spare must be an int >= 0, got {spare!r}")
        slots = min(max_len, window + spare)
        super().__init__(batch_size, num_kv_heads, head_dim, slots, value_dim=value_dim, dtype=dtype, device=device,
                         kv_dtype=kv_dtype)  # fmt: skip
        self.max_len, self.window = max_len, window
        self.offset = 0  # the position slot 0 holds
        self._returned_offset = 0  # the position of the first key the last update returned

    @property
    def capacity(self) -> int:
        return self.max_len

    @property
    def slots(self) -> int:
        return self.key.shape[2]

    def reset(self) -> None:
        super().reset()
        self.offset = self._returned_offset = 0

    def _reserve(self, needed: int) -> None:
        if needed > self.max_len:
            raise ValueError(
                f"WindowKVCache overflow: {needed - self.seq_len} new tokens after {self.seq_len} cached exceed "
                f"max_len {self.max_len}"
            )

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key (B, H_kv, L, D)`` and ``value (B, H_kv, L, D_v)``; return the keys and values to attend to,
        in sequence order and ending with the new ones: the slots in use (views), or for a call longer than
        ``spare + 1`` tokens the kept keys joined to the new ones."""
        if torch.compiler.is_compiling():
            raise NotImplementedError("WindowKVCache is eager only; compiled decoding takes a StaticKVCache")
        L, n = self._new_tokens(key, value), self.slots
        key, value = self._stored(key, value)
        cursor = self.seq_len
        self._reserve(cursor + L)
        used = self._make_room(L)
        self.cursor.add_(L)
        self._returned_offset = self.offset
        if used + L <= n:
            self.key[:, :, used : used + L] = key
            self.value[:, :, used : used + L] = value
            return self.key[:, :, : used + L], self.value[:, :, : used + L]
        # a call longer than the free slots: attend to the kept keys and the new ones; keep the last n of them
        keys = torch.cat([self.key[:, :, :used], key], dim=2)
        values = torch.cat([self.value[:, :, :used], value], dim=2)
        self.key.copy_(keys[:, :, -n:])
        self.value.copy_(values[:, :, -n:])
        self.offset = cursor + L - n
        return keys, values

    def _make_room(self, L: int) -> int:
        """Slots in use once room is made for ``L`` more tokens: where they do not fit, the ``window - 1`` keys the
        first new query sees move to the front (``offset`` moves on)."""
        cursor, used = self.seq_len, self.seq_len - self.offset
        if used + L > self.slots:
            keep = min(used, self.window - 1)
            if keep:
                src = slice(used - keep, used)
                self.key[:, :, :keep] = self.key[:, :, src].clone()
                self.value[:, :, :keep] = self.value[:, :, src].clone()
            self.offset, used = cursor - keep, keep
        return used

    def native_rows(self) -> SlotRows:
        """Room for one more token, and the slots as the native decode step reads a dense cache: ``key``, ``value``,
        ``start`` (each row's first slot past its left padding) and ``cursor`` (the new token's slot), in slot
        numbers. The step writes the token at ``cursor`` and reads the window before it; ``advance`` then counts
        it."""
        self._reserve(self.seq_len + 1)
        used = self._make_room(1)
        self._returned_offset = self.offset
        start = (self.start - self.offset).clamp_min(0)
        return SlotRows(self.key, self.value, start, torch.tensor(used, dtype=torch.long), self)

    def visibility(self, L: int, S: int, is_causal: bool) -> tuple[torch.Tensor | None, bool]:
        """As ``StaticKVCache.visibility``, with the returned keys starting at position ``offset``: nothing beyond
        the bottom-right ``is_causal`` without padding, else a bool ``(B, 1, L, S)`` mask hiding the padding."""
        if not self.padded:
            return None, is_causal
        positions = self._returned_offset + torch.arange(S, device=self.cursor.device)  # (S,)
        mask = positions[None, None, :] >= self.start[:, None, None]  # (B, 1, S)
        if is_causal:
            first = self.seq_len - L  # position of the first new token
            query = first + torch.arange(L, device=positions.device)[:, None]  # (L, 1)
            mask = mask & (positions <= query)[None]  # (B, L, S)
        return mask[:, None].expand(-1, -1, L, -1), False
