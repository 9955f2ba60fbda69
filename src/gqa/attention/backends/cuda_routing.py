"""Which backend ``auto`` runs on a CUDA device: a pure function of what the call is, tested on CPU.

* **no mask, half precision** (sm80+, ``D % 8 == 0``, ``D <= 256``): SDPA's flash kernel, natively grouped
  (``enable_gqa=True``) — prefill, and decode too: for decode it folds the group into query rows and splits the KV
  sequence itself, and measured on an H200 it was faster than the split-KV kernel on every decode shape timed eagerly
  (docs/performance.md). Causal ``L == S`` as its own ``is_causal``, ``L < S`` (decode of several tokens, a chunk
  appended to a cache) through ``causal_lower_right``;
* **decode otherwise** (``L <= 16`` new tokens, inference): the Triton split-KV kernel
(``gqa.kernels.triton.split_kv``), which
  reads each K/V tile once per group and takes masks, ragged rows and bottom-right causal, and float32 at full
  precision — where SDPA would need a mask (cuDNN or the copying math path) or fall to math outright (float32, odd
  head dims, older GPUs). CUDA-graph decoding (``gqa.decoding.cuda_graphs``) calls it directly: it reads each row's
  cache bounds from device memory;
* **prefill with a mask** (or on a GPU the rule above does not know): SDPA only where torch's dispatcher says a
  fused kernel takes it natively (cuDNN on Hopper), which the caller asks and passes in as ``sdpa_native``;
* a **window, soft-capping or sinks** (which SDPA cannot take exactly): the split-KV kernel for decode, which takes
  all three itself and reads only a window's keys; FlexAttention (compiled: block-sparse over the window, the
  soft-cap a ``score_mod``, sinks from its log-sum-exp) for prefill and for gradients; sinks that need a gradient go to
  the grouped matmul;
* everything else (weights, dropout, gradients through decode, float32 prefill): the grouped matmul — one product per
  KV head, the group folded into rows — which never copies K/V. Never SDPA's math path, which copies K/V per query
  head and materializes the scores.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...kernels.triton.split_kv import DTYPES, MAX_HEAD_DIM, MAX_L
from ..checks import HALF_DTYPES, AttnShape

FLASH_CAPABILITY = (8, 0)  # SDPA's flash kernel: Ampere and newer


@dataclass(frozen=True)
class CudaCall:
    """What routing looks at: the device's compute capability and the call (``mask``: None, ``"bool"``, ``"float"``)."""

    capability: tuple[int, int]
    dtype: torch.dtype
    shape: AttnShape
    mask: str | None = None
    is_causal: bool = False
    dropout_p: float = 0.0
    return_weights: bool = False
    needs_grad: bool = False
    triton: bool = True  # triton installed
    sdpa_native: bool = False  # torch's dispatcher picks a fused (natively grouped) kernel for this call
    variant: bool = False  # a window, soft-capping or sinks
    sinks_grad: bool = False  # sinks that need a gradient
    flex: bool = False  # FlexAttention takes these tensors (``backends.flex.supports``)


def flash_supports(capability: tuple[int, int], dtype: torch.dtype, D: int, D_v: int) -> bool:
    """Whether SDPA's flash kernel (FlashAttention-2, sm80 to sm90 here) takes this device, dtype and head dims."""
    return FLASH_CAPABILITY <= capability <= (9, 0) and dtype in HALF_DTYPES and D_v == D and D % 8 == 0 and D <= 256


def flash_takes(call: CudaCall) -> bool:
    """Whether SDPA's flash kernel runs this call natively grouped (no mask; bottom-right causal needs ``L <= S``)."""
    s = call.shape
    return (
        flash_supports(call.capability, call.dtype, s.D, s.D_v)
        and call.mask is None
        and not (call.is_causal and s.L > s.S)
    )


def triton_takes(call: CudaCall) -> bool:
    """Whether the split-KV decode kernel runs this call."""
    s = call.shape
    return (
        call.triton
        and call.dtype in DTYPES
        and s.L <= MAX_L
        and max(s.D, s.D_v) <= MAX_HEAD_DIM
        and not (call.return_weights or call.dropout_p > 0.0 or call.needs_grad)
    )


def route_cuda(call: CudaCall) -> str:
    """The backend ``auto`` runs for ``call`` on CUDA: ``"triton"``, ``"sdpa"`` or ``"grouped"`` (module docstring)."""
    s = call.shape
    if s.L == 0 or s.S == 0 or 0 in s.batch:
        return "grouped"  # empty in or out: plain tensor ops give the empty or all-zero result
    if call.return_weights or call.dropout_p > 0.0:
        return "grouped"
    if call.variant:
        if call.sinks_grad:
            return "grouped"
        if triton_takes(call):
            return "triton"
        return "flex" if call.flex else "grouped"
    if flash_takes(call):
        return "sdpa"
    if triton_takes(call):
        return "triton"
    if call.sdpa_native:
        return "sdpa"
    return "grouped"


@functools.cache
def capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index`` (asked once)."""
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int]:
    return capability(device.index if device.index is not None else torch.cuda.current_device())
