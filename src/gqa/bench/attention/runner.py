"""Running one case: its inputs, the reference output, each implementation checked, then timed round-robin.

Memory: a case whose inputs exceed the budget is skipped whole; an implementation whose estimated extra memory
(``Impl.extra_bytes``: copies of K/V, materialized scores) exceeds what is left is skipped with that reason.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...hardware import available_memory
from .cases import Case, Inputs, make_inputs
from .implementations import REFUSALS, Impl
from .timing import TOLERANCE, check_calls, reference_output, time_round_robin


@dataclass(frozen=True)
class Settings:
    """How long to measure: repetitions are chosen per case so that one round-robin pass of all implementations,
    times ``repeats``, takes about ``target_case_s`` (within ``min_repeats``..``max_repeats``)."""

    target_case_s: float
    min_repeats: int
    max_repeats: int
    warmup: int
    max_call_s: float
    read_bytes: int  # buffer of the bandwidth measurement
    gemm_n: int  # size of the matmul-rate measurement
    limit_repeats: int


CPU_SETTINGS = {
    "quick": Settings(0.25, 3, 5, 0, 5.0, 256 * 2**20, 1024, 5),
    # full: the checked call is the warm-up; an implementation slower than 10 s per call is checked once and not
    # timed (those that would copy K/V beyond the memory budget, e.g. at B=32, S=16k, are skipped before running).
    "full": Settings(10.0, 3, 25, 0, 10.0, 1024 * 2**20, 2048, 5),
}
GPU_SETTINGS = {
    "quick": Settings(0.5, 5, 20, 1, 300.0, 1024 * 2**20, 4096, 10),
    "full": Settings(1.5, 10, 50, 2, 300.0, 4096 * 2**20, 8192, 20),
}


def auto_choice(inputs: Inputs) -> str:
    """The backend ``auto`` runs for these inputs (``"?"`` if the policy cannot be asked)."""
    from ...attention.backends import choose_backend
    from ...attention.checks import check_qkv

    try:
        shape = check_qkv(inputs.q, inputs.k, inputs.v)
        return choose_backend(inputs.q, inputs.k, inputs.v, shape=shape, attn_mask=inputs.attn_mask, dropout_p=0.0,
                              is_causal=inputs.is_causal, scale=inputs.scale, return_weights=False)  # fmt: skip
    except Exception:
        return "?"


def memory_budget(device: torch.device, override_gb: float | None) -> int:
    """Bytes a case may allocate: ``--mem-budget-gb``, else 60% of the available RAM (CPU) or 85% of the free
    device memory (CUDA)."""
    if override_gb is not None:
        return int(override_gb * 2**30)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(0.85 * free)
    available = available_memory()
    return 8 * 2**30 if available is None else int(0.6 * available)


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def prepare_calls(
    impls: Sequence[Impl], case: Case, inputs: Inputs, *, memory_left: float = float("inf")
) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, str]]:
    """``(calls, refused)``: each implementation's prepared call, or why it does not run (its refusal, or an estimated
    extra memory over ``memory_left`` bytes)."""
    calls, refused = {}, {}
    for impl in impls:
        extra = impl.extra_bytes(case, inputs)
        if extra > memory_left:
            refused[impl.name] = (f"needs ~{gib(extra)} beyond the inputs (K/V copies, scores); "
                                  f"memory budget left {gib(memory_left)}")  # fmt: skip
            continue
        try:
            calls[impl.name] = impl.prepare(case, inputs)
        except REFUSALS as err:
            refused[impl.name] = f"{type(err).__name__}: {err}"
    return calls, refused


def run_case(
    case: Case,
    impls: Sequence[Impl],
    *,
    device: torch.device,
    settings: Settings,
    repeats: int | None,
    budget: int,
    seed: int,
) -> dict:
    """Check and time every implementation on one case; returns the case's JSON row."""
    inputs = make_inputs(case, device, seed)
    row: dict = {**case.to_json(), "status": "ran", "auto_backend": auto_choice(inputs)}
    with torch.no_grad():  # not inference_mode: torch.compile (flex) and inference tensors mix badly
        expected = reference_output(inputs)  # (B, H_q, L, D) float32
        left = budget - case.input_bytes - expected.numel() * 4
        calls, refused = prepare_calls(impls, case, inputs, memory_left=left)
        check = check_calls(calls, expected, *TOLERANCE[case.dtype])
        check.skipped.update(refused)
        not_timed = []
        for name, ms in check.first_call_ms.items():
            if ms > settings.max_call_s * 1e3 and name not in check.mismatches:
                not_timed.append(name)
                check.skipped[name] = (
                    f"one call took {ms / 1e3:.1f} s > --max-call-s {settings.max_call_s:g}: checked, not timed"
                )
        bad = {*check.skipped, *check.errors}
        timed = {name: call for name, call in calls.items() if name not in bad}
        estimate = {name: check.first_call_ms[name] for name in timed}
        for _ in range(settings.warmup):  # warm-up rounds, also a better estimate than the first (compiling) call
            for name, call in timed.items():
                start = time.perf_counter()
                call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                estimate[name] = min(estimate[name], (time.perf_counter() - start) * 1e3)
        if repeats is None:
            per_round_s = max(sum(estimate.values()) / 1e3, 1e-6)
            repeats = int(min(max(settings.target_case_s / per_round_s, settings.min_repeats), settings.max_repeats))
        times = time_round_robin(timed, repeats, 0, device)
    row |= {
        "repeats": repeats,
        "warmup": settings.warmup,
        "not_timed": not_timed,  # checked once (first_call_ms), slower than --max-call-s
        "median_ms": {i.name: (statistics.median(times[i.name]) if times.get(i.name) else None) for i in impls},
        "times_ms": times,
        "first_call_ms": check.first_call_ms,
        "max_abs_diff": check.max_abs_diff,
        "error_over_tolerance": check.error_ratio,
        "tolerance": dict(zip(("atol", "rtol"), TOLERANCE[case.dtype], strict=True)),
        "skipped": check.skipped,
        "errors": check.errors,
        "mismatches": check.mismatches,
    }
    return row


def skipped_row(case: Case, reason: str) -> dict:
    return {**case.to_json(), "status": "skipped", "skip_reason": reason}


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
