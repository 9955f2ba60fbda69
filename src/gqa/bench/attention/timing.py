"""Checking every implementation against the reference backend, and timing them round-robin."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import gqa

from .cases import Inputs
from .implementations import REFUSALS

Call = Callable[[], torch.Tensor]

# Allowed difference to the reference backend's output, elementwise ``|out - ref| <= atol + rtol * |ref|`` (inputs
# ~ N(0, 1), so outputs are O(1)). Half-precision implementations round the output (rtol: 2 ulp) and the weights and
# the scaled query, which costs up to ~2 ulp of 1 in absolute terms (bf16: 2 ** -6 measured at L = S = 2048), so atol
# is about twice that. A real bug (a wrong scale, a wrong head mapping, a wrong mask) is off by O(0.1) or more.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {  # dtype: (atol, rtol)
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 2 * 2**-10),
    torch.bfloat16: (3e-2, 2 * 2**-7),
}


@dataclass
class Check:
    """Each implementation's output compared with the reference backend's, on one case."""

    max_abs_diff: dict[str, float] = field(default_factory=dict)  # max |out - ref|, per implementation that ran
    error_ratio: dict[str, float | None] = field(default_factory=dict)  # max |out - ref| / bound; > 1 or None: off
    first_call_ms: dict[str, float] = field(default_factory=dict)  # the checked call's time (compilation included)
    skipped: dict[str, str] = field(default_factory=dict)  # implementation -> why it did not run
    errors: dict[str, str] = field(default_factory=dict)  # implementation -> an unexpected exception (a bug)
    mismatches: list[str] = field(default_factory=list)  # implementations whose output is off (or misshapen)


def reference_output(inputs: Inputs, chunk_bytes: int = 512 * 2**20) -> torch.Tensor:
    """The reference backend's output in float32, ``(B, H_q, L, D)``, computed over chunks of batch rows whose K/V
    take at most ``chunk_bytes`` in float32 (so its float32 copies of half K/V stay small for a large batch)."""
    B = inputs.q.shape[0]
    row_bytes = 2 * inputs.k[0].numel() * 4 + inputs.q[0].numel() * inputs.k.shape[-2] * 8  # K/V + scores, float32
    step = max(1, min(B, chunk_bytes // max(row_bytes, 1)))
    rows = []
    for b in range(0, B, step):
        q, k, v = inputs.q[b : b + step], inputs.k[b : b + step], inputs.v[b : b + step]
        out = gqa.grouped_attention(q, k, v, attn_mask=inputs.attn_mask, is_causal=inputs.is_causal,
                                    backend="reference")  # fmt: skip
        rows.append(out.float())
    return torch.cat(rows)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_calls(calls: dict[str, Call], expected: torch.Tensor, atol: float, rtol: float) -> Check:
    """Run each call once and compare it with ``expected`` elementwise, ``|out - ref| <= atol + rtol * |ref|``. A call
    that raises ``ValueError``, ``NotImplementedError`` or ``RuntimeError`` is skipped, with its message (and any
    warning torch gave, e.g. why an SDPA kernel refused); any other exception is recorded in ``errors``."""
    bound = atol + rtol * expected.abs()  # (B, H_q, L, D)
    check = Check()
    for name, call in calls.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                _synchronize(expected.device)
                start = time.perf_counter()
                out = call()
                _synchronize(expected.device)
                check.first_call_ms[name] = (time.perf_counter() - start) * 1e3
            except REFUSALS as err:
                notes = [str(w.message).strip() for w in caught]
                check.skipped[name] = " ".join(dict.fromkeys([f"{type(err).__name__}: {err}".strip(), *notes]))
                continue
            except Exception as err:  # a bug in an adapter: reported, and the run goes on
                check.errors[name] = f"{type(err).__name__}: {err}"
                continue
        if out.shape != expected.shape:
            check.mismatches.append(name)
            continue
        err = (out.float() - expected).abs()  # (B, H_q, L, D)
        check.max_abs_diff[name] = err.max().item()
        ratio = (err / bound).max().item()
        check.error_ratio[name] = ratio if ratio == ratio else None  # NaN -> None (JSON has no NaN)
        if not ratio <= 1.0:  # `not <=` also catches NaN
            check.mismatches.append(name)
        del out, err
    return check


class L2Flush:
    """On CUDA, overwrite a buffer larger than the L2 cache before each timed call, so that every call reads its
    inputs from device memory as a decode step of a real model does (the other layers evict them)."""

    def __init__(self, device: torch.device):
        self.buffer = None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20)
            self.buffer = torch.empty(max(2 * l2, 256 * 2**20) // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.zero_()


def time_round_robin(
    calls: dict[str, Call], repeats: int, warmup: int, device: torch.device, flush: L2Flush | None = None
) -> dict[str, list[float]]:
    """Per call, ``repeats`` times in ms, measured round-robin after ``warmup`` untimed rounds.

    Each repetition calls every implementation once; the starting implementation rotates, so none of them always runs
    first (after the others have warmed or evicted the caches). CPU: wall clock around the call; CUDA: events around
    the call after an L2 flush, read after a synchronize.
    """
    names = list(calls)
    for _ in range(warmup):
        for name in names:
            calls[name]()
    flush = flush or L2Flush(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        shift = rep % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            if device.type == "cuda":
                flush()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = calls[name]()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                start_s = time.perf_counter()
                out = calls[name]()
                times[name].append((time.perf_counter() - start_s) * 1e3)
            del out  # freed outside the timed region
    return times
