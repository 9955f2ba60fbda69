"""KV caches for decoding, one per attention layer. They store K/V with ``H_kv`` heads only: a GQA cache is
``H_q / H_kv`` times smaller than the MHA one, and that is the bytes each decoded token has to read.

* ``StaticKVCache`` — preallocated to ``max_len``, written in place, never reallocated; its position is a tensor,
  so a compiled decode step runs with static shapes and never recompiles.
* ``DynamicKVCache`` — grows on demand (capacity doubles, so appends are amortised O(1)).

Batched decoding with left padding: ``set_left_padding(pad)`` records how many leading slots of each row are padding.
The cache then provides per-row RoPE positions (``positions``), the mask of what each query may see (``visibility``)
and per-row real lengths (``lengths``); the attention module uses them automatically.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .._compiler import disable
from ..attention.checks import shape_str
from .kv_dtypes import KVDtype
from .quantize import DTYPE_NAMES, as_stored, kv_formats, resolve_kv_dtype, row_size, storage_dtype
from .sizes import kv_cache_elements

KVDtypeChoice = str | KVDtype | tuple[str | KVDtype, str | KVDtype] | None


def kv_cache_bytes(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    seq_len: int,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Bytes of a KV cache: ``2 (K and V) * layers * H_kv * D * seq_len * batch * itemsize``.

    ``dtype`` defaults to float32, the default of the caches themselves and of ``gqa.load_model``."""
    elements = kv_cache_elements(num_layers, num_kv_heads, head_dim, seq_len, batch)  # the counts checked first
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    return elements * dtype.itemsize


def check_positive(**counts: object) -> None:
    """``ValueError`` naming the first of ``counts`` that is not a positive int."""
    for name, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")


def kv_kinds(
    kv_dtype: KVDtypeChoice, dtype: torch.dtype, flag: str = "kv_dtype", device: torch.device | str | None = None
) -> tuple[KVDtype, KVDtype]:
    """The K and V storage types of a cache of ``dtype`` activations on ``device`` (``None``: not known yet):
    ``kv_dtype`` one name for both (``"auto"`` / ``None``: ``dtype`` itself), or a ``(K, V)`` pair, as llama.cpp's
    ``-ctk`` / ``-ctv``. A float type must be ``dtype`` (the caches store what the model computes; quantized ones are
    the way to fewer bytes), fp8 needs a CUDA device that has it (``check_fp8_device``): ``ValueError`` naming
    ``flag`` otherwise."""
    pair = kv_dtype if isinstance(kv_dtype, tuple) else (kv_dtype, kv_dtype)
    if len(pair) != 2:
        raise ValueError(f"{flag} must be a name or a (K, V) pair of names, got {kv_dtype!r}")
    kinds = tuple(resolve_kv_dtype(k, dtype, flag) for k in pair)
    for kind in kinds:
        if not kind.quantized and storage_dtype(kind) != dtype:
            raise ValueError(
                f"{flag} {kind.name} differs from the model's dtype {DTYPE_NAMES.get(dtype, dtype)}: a float KV cache "
                f"stores the model's dtype (load the model in {kind.name}), or pick q8_0 / q4_0"
            )
        if kind.fp8 and device is not None:
            check_fp8_device(torch.device(device), flag)
    return kinds  # type: ignore[return-value]


def check_fp8_device(device: torch.device, flag: str = "kv_dtype") -> None:
    """``ValueError`` naming ``flag`` unless an fp8 KV cache can be read on ``device``: a CUDA GPU of compute
    capability 8.9 or more (Ada, Hopper and later: Triton's ``float8e4nv``), or CPU tensors under Triton's
    interpreter (``TRITON_INTERPRET=1``, tests)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"{flag} fp8_e4m3 needs a GPU of compute capability 8.9 or more (Ada, Hopper), this "
                             f"one is {major}.{minor}: use q8_0 or q4_0")  # fmt: skip
        return
    from ..kernels.triton.split_kv import interpreted

    if device.type == "cpu" and interpreted():
        return
    raise ValueError(f"{flag} fp8_e4m3 is read by the CUDA kernels only (vLLM's fp8 cache); on {device.type} "
                     "use q8_0 or q4_0")  # fmt: skip


class _KVCache(nn.Module):
    """Shared machinery: buffers ``key (B, H_kv, capacity, D)``, ``value (B, H_kv, capacity, D_v)``, ``start (B,)``
    (left padding per row) and ``cursor`` (slots written, a 0-dim tensor so compiled code never guards on it).

    ``kv_dtype`` ``"q8_0"`` / ``"q4_0"`` (or a ``(K, V)`` pair, see ``kv_kinds``) stores K and/or V as uint8 rows of
    32-value blocks, ``(B, H_kv, capacity, D / 32 * block_bytes)``: each new token is quantized once, as it is
    written, and attention reads the blocks (``attention.quantized_cache``). ``dtype`` is then the activations'."""

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        kv_dtype: KVDtypeChoice = None,
    ) -> None:
        super().__init__()
        check_positive(batch_size=batch_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
        value_dim = head_dim if value_dim is None else value_dim
        self.kinds = kv_kinds(kv_dtype, dtype, device=device if device is not None else "cpu")
        self.dtype, self.head_dim, self.value_dim = dtype, head_dim, value_dim
        B, H = batch_size, num_kv_heads
        k_kind, v_kind = self.kinds
        self.register_buffer("key", torch.zeros(B, H, capacity, row_size(k_kind, head_dim),
                                                dtype=storage_dtype(k_kind), device=device))  # fmt: skip
        self.register_buffer("value", torch.zeros(B, H, capacity, row_size(v_kind, value_dim),
                                                  dtype=storage_dtype(v_kind), device=device))  # fmt: skip
        self.register_buffer("start", torch.zeros(B, dtype=torch.long, device=device))
        self.register_buffer("cursor", torch.zeros((), dtype=torch.long, device=device))
        self.padded = False

    @property
    def capacity(self) -> int:
        return self.key.shape[2]

    @property
    def quantized(self) -> bool:
        """Whether K or V is stored as blocks."""
        return self.kinds[0].quantized or self.kinds[1].quantized

    @property
    def kv_formats(self) -> tuple[int, ...]:
        """The native kernels' codes of K's and V's storage (``KVDtype.code``; ``()`` where both are float)."""
        return kv_formats(self.kinds)

    def _stored(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``key`` and ``value`` as the buffers hold them: quantized where the cache's kinds say so."""
        return as_stored(key, self.kinds[0], key=True), as_stored(value, self.kinds[1])

    @property
    def seq_len(self) -> int:
        """Slots written so far (the same for every row; left padding is counted in it)."""
        return int(self.cursor)

    @property
    def nbytes(self) -> int:
        """Bytes held by the K/V buffers (allocated capacity, not only the written part)."""
        return self.key.nbytes + self.value.nbytes

    @property
    def lengths(self) -> torch.Tensor:
        """Real (non-padding) tokens per row, ``(B,)``."""
        return (self.cursor - self.start).clamp_min(0)

    def reset(self) -> None:
        """Forget the contents (buffers are kept) and the padding."""
        self.cursor.zero_()
        self.start.zero_()
        self.padded = False

    def set_left_padding(self, pad: torch.Tensor | Sequence[int]) -> None:
        """Declare that the first ``pad[b]`` slots of row ``b`` hold padding (left-padded batched prompts).

        Call it before writing the prompt. ``pad`` is ``(B,)``; an HF-style ``(B, L)`` 0/1 mask ``m`` gives
        ``pad = L - m.sum(-1)``.
        """
        pad = torch.as_tensor(pad, dtype=torch.long, device=self.start.device)
        if pad.shape != self.start.shape:
            raise ValueError(f"pad must have shape ({self.start.shape[0]},) = (B,), got {shape_str(pad)}")
        if bool((pad < 0).any()):
            raise ValueError(f"pad must be >= 0, got {pad.tolist()}")
        self.start.copy_(pad)
        self.padded = bool((pad > 0).any())

    def keep_rows(self, rows: torch.Tensor | Sequence[int]) -> None:
        """Keep batch rows ``rows`` only, in that order (e.g. the sequences of a batch that have not finished): the
        buffers become ``(len(rows), ...)`` copies of those rows; the cursor and each kept row's padding stay."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.start.device)
        B = self.start.shape[0]
        if rows.dim() != 1 or rows.numel() == 0 or bool(((rows < 0) | (rows >= B)).any()):
            raise ValueError(f"rows must be a non-empty 1-D list of rows in [0, {B}), got {rows.tolist()}")
        self.key = self.key.index_select(0, rows)
        self.value = self.value.index_select(0, rows)
        self.start = self.start.index_select(0, rows)
        self.padded = bool((self.start > 0).any())

    def positions(self, L: int) -> torch.Tensor:
        """RoPE positions ``(B, L)`` of the next ``L`` tokens: slot index minus the row's padding (0 on padding)."""
        slots = self.cursor + torch.arange(L, device=self.cursor.device)  # (L,)
        return (slots[None, :] - self.start[:, None]).clamp_min(0)

    def _reserve(self, needed: int) -> None:
        raise NotImplementedError

    def _reserve_while_compiling(self, L: int) -> None:
        """Make room for ``L`` more tokens inside a ``torch.compile``'d call (where ``cursor`` has no Python value).

        A static cache never reallocates: the compiled ``index_copy_`` checks its bounds and raises past ``max_len``.
        """

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key (B, H_kv, L, D)`` and ``value (B, H_kv, L, D_v)``; return the keys and values to attend to,
        ``(B, H_kv, S, D)`` and ``(B, H_kv, S, D_v)`` (views, not copies).

        Eagerly ``S`` is the number of slots written; under ``torch.compile`` it is the whole capacity (static shapes),
        and ``visibility`` masks the unwritten slots.
        """
        L = self._new_tokens(key, value)
        compiling = torch.compiler.is_compiling()
        if compiling:
            self._reserve_while_compiling(L)
        else:
            self._reserve(self.seq_len + L)  # raises before anything is written when a static cache is full
        slots = self.cursor + torch.arange(L, device=self.cursor.device)  # (L,)
        key, value = self._stored(key, value)
        self.key.index_copy_(2, slots, key)
        self.value.index_copy_(2, slots, value)
        self.cursor.add_(L)
        if compiling:
            return self.key, self.value
        S = self.seq_len
        return self.key[:, :, :S], self.value[:, :, :S]

    def _new_tokens(self, key: torch.Tensor, value: torch.Tensor) -> int:
        """``L``, the tokens ``update`` was given, after checking ``key (B, H_kv, L, D)`` and ``value (B, H_kv, L,
        D_v)`` against the cache (``TypeError`` / ``ValueError`` naming the argument)."""
        B, H = self.key.shape[:2]
        for name, t, feat in (("key", key, self.head_dim), ("value", value, self.value_dim)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[0] != B or t.shape[1] != H or t.shape[3] != feat:
                raise ValueError(f"{name} must have shape ({B}, {H}, L, {feat}) for this cache, got {shape_str(t)}")
            if t.dtype != self.dtype:
                verb = "takes" if self.quantized else "stores"  # a quantized cache takes activations, stores blocks
                raise TypeError(f"{name} has dtype {t.dtype} but the cache {verb} {self.dtype}")
        if value.shape[2] != key.shape[2]:
            raise ValueError(f"key {shape_str(key)} and value {shape_str(value)} must have the same length")
        return key.shape[2]

    def visibility(self, L: int, S: int, is_causal: bool) -> tuple[torch.Tensor | None, bool]:
        """After ``update`` of ``L`` tokens returned ``S`` slots: which slots the ``L`` new queries may see.

        Returns ``(mask, is_causal)`` to hand to ``grouped_attention``: eagerly and without padding nothing is needed
        beyond the bottom-right ``is_causal`` (``None, is_causal``); otherwise a bool ``(B, 1, L, S)`` mask that hides
        padding, unwritten slots and — when ``is_causal`` — later tokens, with ``is_causal=False``.
        """
        if not self.padded and not torch.compiler.is_compiling():
            return None, is_causal
        slots = torch.arange(S, device=self.cursor.device)  # (S,)
        first = self.cursor - L  # slot of the first new token
        if is_causal:
            seen = slots[None, :] <= first + torch.arange(L, device=slots.device)[:, None]  # (L, S)
        else:
            seen = (slots < self.cursor).expand(L, S)  # (L, S)
        mask = seen[None] & (slots[None, None, :] >= self.start[:, None, None])  # (B, L, S)
        return mask[:, None], False


class StaticKVCache(_KVCache):
    """A KV cache preallocated to ``max_len`` tokens and written in place.

    Buffers: ``key (B, H_kv, max_len, D)``, ``value (B, H_kv, max_len, D_v)``. Writing past ``max_len`` raises
    ``ValueError`` and leaves the cache unchanged.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        value_dim: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        kv_dtype: KVDtypeChoice = None,
    ) -> None:
        check_positive(max_len=max_len)
        super().__init__(batch_size, num_kv_heads, head_dim, max_len, value_dim=value_dim, dtype=dtype, device=device,
                         kv_dtype=kv_dtype)  # fmt: skip

    def _reserve(self, needed: int) -> None:
        if needed > self.capacity:
            raise ValueError(
                f"StaticKVCache overflow: {needed - self.seq_len} new tokens after {self.seq_len} cached exceed "
                f"max_len {self.capacity}"
            )


class DynamicKVCache(_KVCache):
    """A KV cache that grows as tokens arrive (capacity doubles, then K/V are copied once into the bigger buffer).

    Under ``torch.compile`` it grows too, outside the graph (a graph break per call, so not with ``fullgraph=True``),
    and each new capacity is a new buffer shape, so a recompilation; ``StaticKVCache`` is the one for compiled decoding.
    """

    def __init__(
        self,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        value_dim: int | None = None,
        initial_len: int = 256,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        kv_dtype: KVDtypeChoice = None,
    ) -> None:
        if isinstance(initial_len, bool) or not isinstance(initial_len, int) or initial_len < 1:
            raise ValueError(f"initial_len must be a positive int, got {initial_len!r}")
        super().__init__(
            batch_size,
            num_kv_heads,
            head_dim,
            initial_len,
            value_dim=value_dim,
            dtype=dtype,
            device=device,
            kv_dtype=kv_dtype,
        )

    @disable  # grows outside the graph
    def _reserve_while_compiling(self, L: int) -> None:
        self._reserve(self.seq_len + L)

    def _reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        capacity = max(needed, 2 * self.capacity)
        for name in ("key", "value"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : old.shape[2]].copy_(old)
            setattr(self, name, new)
