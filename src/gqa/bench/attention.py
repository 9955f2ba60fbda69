"""Attention benchmark: each gqa backend, ``auto`` and torch SDPA, measured side by side on the same inputs.

Two workloads, each for every dtype and number of KV heads ``H_kv``:

* **decode**: one new token against a long KV cache, ``q (B, H_q, 1, D)``, ``k, v (B, H_kv, S, D)``; no mask.
* **prefill**: a causal prompt, ``q (1, H_q, L, D)``, ``k, v (1, H_kv, L, D)`` with ``L == S`` (so torch's top-left
  ``is_causal`` agrees with gqa's bottom-right one).

Per case the inputs are created once (fixed seed); every implementation is checked once against the reference
backend, warmed up, then timed round-robin (one call of each implementation per repetition, the starting
implementation rotated) so that drift of the machine hits all of them alike. The table shows the median of the
repetitions. Run ``python benchmarks/attention.py --help`` for the flags.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

import gqa
from gqa._checks import check_qkv
from gqa.backends import BACKENDS, choose_backend
from gqa.bench import write_json_atomic
from gqa.cache import kv_cache_bytes

OURS: tuple[str, ...] = tuple(BACKENDS)  # ("reference", "grouped", "sdpa")
TORCH = "torch-sdpa"
IMPLEMENTATIONS: tuple[str, ...] = (*OURS, "auto", TORCH)
KINDS = ("decode", "prefill")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DTYPE_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

# Allowed difference to the reference backend's output, elementwise ``|out - ref| <= atol + rtol * |ref|`` (inputs
# ~ N(0, 1), so outputs are O(1)). Half-precision backends round the output (rtol: 2 ulp) and, in the grouped backend,
# the weights and the scaled query, which costs up to ~2 ulp of 1 in absolute terms (bf16: 2 ** -6 measured at
# L = S = 2048), so atol is about twice that. A real bug is off by O(0.1) or more.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {  # dtype: (atol, rtol)
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 2 * 2**-10),
    torch.bfloat16: (3e-2, 2 * 2**-7),
}

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Sizes:
    """Problem sizes and repetition counts of one run."""

    q_heads: int = 32
    head_dim: int = 128
    decode_batch: int = 8
    decode_len: int = 4096  # S of the KV cache
    prefill_len: int = 2048  # L == S
    decode_repeats: int = 25
    prefill_repeats: int = 5
    warmup: int = 2


FULL = Sizes()
QUICK = Sizes(decode_len=512, prefill_len=256, decode_repeats=5, prefill_repeats=3, warmup=1)


@dataclass(frozen=True)
class Case:
    """One benchmark case: ``q (B, H_q, L, D)``, ``k, v (B, H_kv, S, D)``."""

    kind: str  # "decode" or "prefill"
    dtype: torch.dtype
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    repeats: int

    @property
    def is_causal(self) -> bool:
        return self.kind == "prefill"

    @property
    def kv_cache_mib(self) -> float:
        """Size of this case's K and V in MiB (one layer)."""
        return kv_cache_bytes(1, self.kv_heads, self.head_dim, self.kv_len, self.batch, self.dtype) / 2**20

    @property
    def label(self) -> str:
        return f"{self.kind} {DTYPE_SHORT.get(self.dtype, str(self.dtype))} H_kv={self.kv_heads}"

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "dtype": str(self.dtype).removeprefix("torch."),
            "B": self.batch,
            "H_q": self.q_heads,
            "H_kv": self.kv_heads,
            "L": self.q_len,
            "S": self.kv_len,
            "D": self.head_dim,
            "is_causal": self.is_causal,
            "repeats": self.repeats,
            "kv_cache_mib": self.kv_cache_mib,
        }


@dataclass
class Check:
    """Each implementation's output compared with the reference backend's, on one case."""

    max_abs_diff: dict[str, float]  # max |out - ref|, per implementation that ran
    error_ratio: dict[str, float]  # max |out - ref| / (atol + rtol * |ref|); > 1 (or NaN) is a mismatch
    skipped: dict[str, str]  # implementation -> its ValueError message, where it refuses the case
    mismatches: list[str]  # implementations whose output is off (or has the wrong shape)


@dataclass
class CaseResult:
    """Timings and correctness of every implementation on one case.

    ``times_ms[name]`` holds one time per repetition; an implementation that refused the case (``ValueError``) has
    no times and its reason in ``skipped``.
    """

    case: Case
    auto_backend: str
    check: Check
    times_ms: dict[str, list[float]]

    @property
    def skipped(self) -> dict[str, str]:
        return self.check.skipped

    @property
    def mismatches(self) -> list[str]:
        return self.check.mismatches

    def median_ms(self, name: str) -> float | None:
        times = self.times_ms.get(name)
        return statistics.median(times) if times else None

    @property
    def best_ours_ms(self) -> float | None:
        medians = [m for m in (self.median_ms(n) for n in OURS) if m is not None]
        return min(medians) if medians else None

    @property
    def auto_over_best_ours(self) -> float | None:
        """``auto / best-ours``: 1.00 means ``auto`` picked the fastest of our backends."""
        return _ratio(self.median_ms("auto"), self.best_ours_ms)

    @property
    def sdpa_over_auto(self) -> float | None:
        """``torch SDPA / auto``: > 1 means ``auto`` is faster than calling torch SDPA directly."""
        return _ratio(self.median_ms(TORCH), self.median_ms("auto"))

    def to_json(self) -> dict:
        return {
            **self.case.to_json(),
            "auto_backend": self.auto_backend,
            "median_ms": {name: self.median_ms(name) for name in IMPLEMENTATIONS},
            "times_ms": self.times_ms,
            "max_abs_diff": self.check.max_abs_diff,
            "error_over_tolerance": self.check.error_ratio,
            "tolerance": {"atol": TOLERANCE[self.case.dtype][0], "rtol": TOLERANCE[self.case.dtype][1]},
            "skipped": self.check.skipped,
            "mismatches": self.check.mismatches,
            "auto_over_best_ours": self.auto_over_best_ours,
            "sdpa_over_auto": self.sdpa_over_auto,
        }


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den == 0 else num / den


# ----------------------------------------------------------------------------------------------------------------
# Cases, inputs and implementations


def build_cases(
    sizes: Sizes, kinds: Sequence[str], dtypes: Sequence[torch.dtype], kv_heads: Sequence[int]
) -> list[Case]:
    """All cases of a run, in the order they are measured: kind, then dtype, then ``H_kv``."""
    cases = []
    for kind in kinds:
        if kind == "decode":
            batch, q_len, kv_len, repeats = sizes.decode_batch, 1, sizes.decode_len, sizes.decode_repeats
        else:
            batch, q_len, kv_len, repeats = 1, sizes.prefill_len, sizes.prefill_len, sizes.prefill_repeats
        for dtype in dtypes:
            for h_kv in kv_heads:
                cases.append(Case(kind, dtype, batch, sizes.q_heads, h_kv, q_len, kv_len, sizes.head_dim, repeats))
    return cases


def make_inputs(case: Case, device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q (B, H_q, L, D)``, ``k (B, H_kv, S, D)``, ``v (B, H_kv, S, D)`` ~ N(0, 1), drawn in float32 from ``seed``."""
    gen = torch.Generator().manual_seed(seed)

    def randn(heads: int, length: int) -> torch.Tensor:
        t = torch.randn(case.batch, heads, length, case.head_dim, generator=gen)  # (B, H, length, D)
        return t.to(device=device, dtype=case.dtype)

    return randn(case.q_heads, case.q_len), randn(case.kv_heads, case.kv_len), randn(case.kv_heads, case.kv_len)


def make_implementations(case: Case) -> dict[str, Attention]:
    """Every implementation as ``fn(q, k, v) -> out (B, H_q, L, D)``, in table order."""
    causal = case.is_causal

    def ours(backend: str) -> Attention:
        return lambda q, k, v: gqa.grouped_attention(q, k, v, is_causal=causal, backend=backend)

    impls: dict[str, Attention] = {name: ours(name) for name in (*OURS, "auto")}
    # Decode (L=1) needs no mask; prefill has L == S, where torch's top-left is_causal is the right mask.
    impls[TORCH] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return impls


def auto_choice(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The backend ``auto`` runs for this case."""
    shape = check_qkv(q, k, v)
    return choose_backend(
        q,
        k,
        v,
        shape=shape,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=case.is_causal,
        scale=shape.D**-0.5,
        return_weights=False,
    )


# ----------------------------------------------------------------------------------------------------------------
# Measuring


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_outputs(impls: dict[str, Attention], inputs: tuple[torch.Tensor, ...], atol: float, rtol: float) -> Check:
    """Run each implementation once and compare it with the reference backend, elementwise
    ``|out - ref| <= atol + rtol * |ref|``; an implementation that raises ``ValueError`` is skipped."""
    expected = impls["reference"](*inputs).float()  # (B, H_q, L, D)
    bound = atol + rtol * expected.abs()  # (B, H_q, L, D)
    check = Check({}, {}, {}, [])
    for name, fn in impls.items():
        try:
            out = fn(*inputs)
        except ValueError as err:
            check.skipped[name] = str(err)
            continue
        if out.shape != expected.shape:
            check.mismatches.append(name)
            continue
        err = (out.float() - expected).abs()  # (B, H_q, L, D)
        check.max_abs_diff[name] = err.max().item()
        check.error_ratio[name] = (err / bound).max().item()
        if not check.error_ratio[name] <= 1.0:  # `not <=` also catches NaN
            check.mismatches.append(name)
    return check


def time_interleaved(
    impls: dict[str, Attention],
    inputs: tuple[torch.Tensor, ...],
    repeats: int,
    warmup: int,
    device: torch.device,
) -> dict[str, list[float]]:
    """Per implementation, ``repeats`` wall-clock times in ms, measured round-robin.

    Each repetition calls every implementation once; the starting implementation rotates, so none of them always
    runs first (after the others have warmed or evicted the caches).
    """
    names = list(impls)
    for _ in range(warmup):
        for name in names:
            impls[name](*inputs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            _synchronize(device)
            start = time.perf_counter()
            out = impls[name](*inputs)
            _synchronize(device)
            times[name].append((time.perf_counter() - start) * 1e3)
            del out  # freed outside the timed region
    return times


def run_case(case: Case, *, warmup: int, device: torch.device, seed: int) -> CaseResult:
    """Check and time every implementation on one case."""
    inputs = make_inputs(case, device, seed)
    impls = make_implementations(case)
    with torch.inference_mode():
        check = check_outputs(impls, inputs, *TOLERANCE[case.dtype])
        runnable = {name: fn for name, fn in impls.items() if name not in check.skipped}
        times = time_interleaved(runnable, inputs, case.repeats, warmup, device)
    return CaseResult(case, auto_backend=auto_choice(case, *inputs), check=check, times_ms=times)


def run_cases(
    cases: Sequence[Case], *, warmup: int, device: torch.device, seed: int = 0, progress: bool = True
) -> list[CaseResult]:
    """Run every case in turn; with ``progress``, one line per case on stderr."""
    results = []
    for i, case in enumerate(cases, 1):
        start = time.perf_counter()
        result = run_case(case, warmup=warmup, device=device, seed=seed)
        results.append(result)
        if progress:
            note = f"  MISMATCH: {', '.join(result.mismatches)}" if result.mismatches else ""
            print(
                f"[{i}/{len(cases)}] {case.label}: auto({result.auto_backend}) {_fmt_ms(result.median_ms('auto'))} ms, "
                f"torch SDPA {_fmt_ms(result.median_ms(TORCH))} ms ({time.perf_counter() - start:.1f} s){note}",
                file=sys.stderr,
                flush=True,
            )
    return results


# ----------------------------------------------------------------------------------------------------------------
# Reporting


def _fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "n/a"
    if ms < 1:
        return f"{ms:.3f}"
    return f"{ms:.2f}" if ms < 100 else f"{ms:.1f}"


def _fmt_ratio(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}"


def _cell(result: CaseResult, name: str) -> str:
    text = _fmt_ms(result.median_ms(name))
    return f"**{text} MISMATCH**" if name in result.mismatches else text


def format_table(results: Sequence[CaseResult]) -> str:
    """The results as a markdown table; times are median ms."""
    header = ["case", "dtype", "H_kv", "KV-cache MiB", *OURS, "auto", "auto uses", "torch SDPA"]
    header += ["auto / best-ours", "SDPA / auto"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(header) - 3)) + "|"]
    for r in results:
        row = [r.case.kind, DTYPE_SHORT.get(r.case.dtype, str(r.case.dtype)), str(r.case.kv_heads)]
        row += [f"{r.case.kv_cache_mib:.1f}", *(_cell(r, name) for name in OURS), _cell(r, "auto")]
        row += [r.auto_backend, _cell(r, TORCH), _fmt_ratio(r.auto_over_best_ours), _fmt_ratio(r.sdpa_over_auto)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def describe_sizes(sizes: Sizes) -> str:
    return (
        f"H_q={sizes.q_heads}, D={sizes.head_dim}; "
        f"decode: B={sizes.decode_batch}, L=1, S={sizes.decode_len}, median of {sizes.decode_repeats}; "
        f"causal prefill: B=1, L=S={sizes.prefill_len}, median of {sizes.prefill_repeats}; "
        f"warmup {sizes.warmup}; times in ms"
    )


LEGEND = (
    "n/a: the backend refuses the case (ValueError). auto / best-ours: 1.00 means auto ran the fastest of our "
    "backends. SDPA / auto: > 1 means auto beats calling torch's F.scaled_dot_product_attention(enable_gqa=True)."
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_description(device: torch.device) -> dict:
    """What the numbers were measured on."""
    info = {
        "torch": torch.__version__,
        "gqa": gqa.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "device": str(device),
    }
    if hasattr(os, "getloadavg"):
        info["loadavg_at_start"] = os.getloadavg()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# ----------------------------------------------------------------------------------------------------------------
# Command line


def _dtype(name: str) -> torch.dtype:
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/attention.py",
        description="Time gqa's attention backends, auto and torch SDPA side by side; print a markdown table.",
    )
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (seconds)")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write all raw numbers and the machine here")
    p.add_argument("--dtypes", nargs="+", type=_dtype, default=[torch.float32, torch.bfloat16], metavar="DTYPE",
                   help="float32, bfloat16, float16 (default: float32 bfloat16)")  # fmt: skip
    p.add_argument("--kv-heads", nargs="+", type=_positive_int, default=[32, 8, 1], metavar="H_KV",
                   help="numbers of KV heads (default: 32 8 1)")  # fmt: skip
    p.add_argument("--cases", nargs="+", choices=KINDS, default=list(KINDS), help="which workloads (default: both)")
    p.add_argument("--repeats", type=_positive_int, help="timed repetitions per case (default: 7 decode, 5 prefill)")
    p.add_argument("--warmup", type=int, help="untimed rounds before timing (default: 2)")
    p.add_argument("--q-heads", type=_positive_int, help="H_q (default: 32)")
    p.add_argument("--head-dim", type=_positive_int, help="D (default: 128)")
    p.add_argument("--decode-batch", type=_positive_int, help="B of decode (default: 8)")
    p.add_argument("--decode-len", type=_positive_int, help="S of decode (default: 4096; --quick: 512)")
    p.add_argument("--prefill-len", type=_positive_int, help="L = S of prefill (default: 2048; --quick: 256)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    return p


def resolve_sizes(args: argparse.Namespace) -> Sizes:
    """The preset (``--quick`` or full) with any explicit size flags applied."""
    base = QUICK if args.quick else FULL
    explicit = {
        "q_heads": args.q_heads,
        "head_dim": args.head_dim,
        "decode_batch": args.decode_batch,
        "decode_len": args.decode_len,
        "prefill_len": args.prefill_len,
        "decode_repeats": args.repeats,
        "prefill_repeats": args.repeats,
        "warmup": args.warmup,
    }
    return Sizes(**{**base.__dict__, **{k: v for k, v in explicit.items() if v is not None}})


def main(argv: Sequence[str | os.PathLike[str]] | None = None) -> int:
    """Run the benchmark; print the table on stdout and progress on stderr.

    Returns
    -------
    int
        0, or 1 when an implementation's output did not match the reference backend.
    """
    parser = build_parser()
    args = parser.parse_args(None if argv is None else [os.fspath(a) for a in argv])
    sizes = resolve_sizes(args)
    bad = [h for h in args.kv_heads if sizes.q_heads % h]
    if bad:
        parser.error(f"--kv-heads {bad} must divide H_q={sizes.q_heads}")
    device = torch.device(args.device)

    machine = machine_description(device)
    cases = build_cases(sizes, args.cases, args.dtypes, args.kv_heads)
    print(f"{len(cases)} cases; {describe_sizes(sizes)}; torch {torch.__version__}, "
          f"{machine['torch_threads']} threads, {machine['cpu_model']}", file=sys.stderr)  # fmt: skip
    start = time.perf_counter()
    results = run_cases(cases, warmup=sizes.warmup, device=device, seed=args.seed)
    elapsed = time.perf_counter() - start

    print(f"Attention, {describe_sizes(sizes)}; torch {torch.__version__}, {machine['torch_threads']} threads, "
          f"{machine['cpu_model']}\n")  # fmt: skip
    print(format_table(results))
    print(f"\n{LEGEND}")
    mismatched = [f"{r.case.label}: {name}" for r in results for name in r.mismatches]
    if mismatched:
        message = f"MISMATCH vs the reference backend: {'; '.join(mismatched)}"
        print(f"\n{message}")
        print(message, file=sys.stderr)
    if args.json is not None:
        payload = {
            "benchmark": "attention",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": machine,
            "sizes": sizes.__dict__,
            "quick": args.quick,
            "seed": args.seed,
            "elapsed_s": elapsed,
            "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "implementations": list(IMPLEMENTATIONS),
            "rows": [r.to_json() for r in results],
        }
        write_json_atomic(args.json, payload)
    return 1 if mismatched else 0


if __name__ == "__main__":
    raise SystemExit(main())
