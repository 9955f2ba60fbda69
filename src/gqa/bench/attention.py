"""Attention benchmark: every gqa backend, ``auto`` and the peers side by side on the same inputs, against the
machine's limits measured in the same run. ``gqa bench attention --help`` (or ``python benchmarks/attention.py``).

Per case (see :mod:`gqa.bench.cases` for the grid, the masks and how bytes and FLOPs are counted) the inputs are
drawn once (fixed seed); every implementation (:mod:`gqa.bench.implementations`) is checked once against the
reference backend (tolerance by dtype), warmed up, then timed round-robin (one call of each per repetition, the
starting one rotated) so that drift of the machine hits all of them alike; the reports show the median. The read
bandwidth and matmul rates (:mod:`gqa.bench.limits`) are measured at the start and the end of the run.

What does not run is recorded with its reason, never a crash: a backend that raises ``ValueError`` /
``NotImplementedError`` / ``RuntimeError`` for a case or device; an implementation whose estimated extra memory
(copies of K/V, materialized scores) exceeds the memory budget; one whose checked call took longer than
``--max-call-s`` (checked, not timed); a case whose inputs exceed the budget, or that the ``--max-seconds`` budget
left no time for. Outputs: markdown on stdout (and ``--markdown``), ``--json`` with every raw number (rewritten
atomically after each case, so an interrupted run keeps what it measured), ``--plots DIR`` (two PNGs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..backends import BACKENDS
from . import write_json_atomic, write_text_atomic
from .cases import (
    CPU_FULL,
    CPU_QUICK,
    DTYPE_ALIASES,
    DTYPES,
    GPU_FULL,
    GPU_QUICK,
    KINDS,
    MASKS,
    Case,
    Grid,
    Inputs,
    build_cases,
    dtype_name,
    make_inputs,
)
from .implementations import REFUSALS, Impl, implementations_for
from .limits import Limits, measure_limits
from .report import COUNTING, annotate, fmt_ms, format_markdown, machine_description
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
    # full: the checked call is the warm-up; an implementation slower than 3 s per call (the score-materializing
    # ones at L=S=4096, the K/V-copying ones at B=32, S=16k) is checked once and not timed, so the run takes ~30 min.
    "full": Settings(10.0, 3, 25, 0, 3.0, 1024 * 2**20, 2048, 5),
}
GPU_SETTINGS = {
    "quick": Settings(0.5, 5, 20, 1, 300.0, 1024 * 2**20, 4096, 10),
    "full": Settings(1.5, 10, 50, 2, 300.0, 4096 * 2**20, 8192, 20),
}


def auto_choice(inputs: Inputs) -> str:
    """The backend ``auto`` runs for these inputs (``"?"`` if the policy cannot be asked)."""
    from .._checks import check_qkv
    from ..backends import choose_backend

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
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return int(0.6 * info["MemAvailable"])
    except (OSError, KeyError, ValueError, IndexError):
        return 8 * 2**30


def _gib(n: float) -> str:
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
            refused[impl.name] = (f"needs ~{_gib(extra)} beyond the inputs (K/V copies, scores); "
                                  f"memory budget left {_gib(memory_left)}")  # fmt: skip
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


def _skipped_row(case: Case, reason: str) -> dict:
    return {**case.to_json(), "status": "skipped", "skip_reason": reason}


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------------------------
# Command line


def _dtype(name: str) -> torch.dtype:
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)} (or fp32, bf16, fp16)")
    return DTYPES[name]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _size(text: str) -> int:
    """``4096``, ``4k`` or ``16K`` (k = 1024)."""
    t = text.strip().lower()
    scale = 1024 if t.endswith("k") else 1
    try:
        value = int(t.removesuffix("k")) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 4096 or 4k, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gqa bench attention",
        description="Time gqa's attention backends, auto and the peer implementations side by side against the "
        "machine's measured bandwidth and matmul rate; print a markdown report.",
    )
    p.add_argument("--quick", action="store_true", help="small grid, few repeats (under 2 minutes on 2 CPU cores)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu); cuda adds SDPA per kernel and flex")
    p.add_argument(
        "--kinds",
        "--cases",
        dest="kinds",
        nargs="+",
        choices=KINDS,
        default=list(KINDS),
        help="workloads (default: decode prefill)",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        type=_dtype,
        default=[torch.float32, torch.bfloat16],
        metavar="DTYPE",
        help="float32, bfloat16, float16 (default: float32 bfloat16)",
    )
    p.add_argument(
        "--kv-heads",
        nargs="+",
        type=_positive_int,
        default=[32, 8, 4, 1],
        metavar="H_KV",
        help="numbers of KV heads, each dividing H_q (default: 32 8 4 1)",
    )
    p.add_argument(
        "--batches",
        nargs="+",
        type=_positive_int,
        metavar="B",
        help="decode batch sizes; with --contexts or alone: every B x S pair (default: the preset's B=8 "
        "context sweep plus B=1 and B=32 at two contexts)",
    )
    p.add_argument(
        "--contexts",
        nargs="+",
        type=_size,
        metavar="S",
        help="decode context lengths, e.g. 1k 4k 16k (default: the preset's)",
    )
    p.add_argument(
        "--prefill-lens",
        nargs="+",
        type=_size,
        metavar="L",
        help="prefill lengths L = S (default: 1k 4k; --quick: 256)",
    )
    p.add_argument(
        "--masks",
        nargs="+",
        choices=MASKS,
        default=list(MASKS),
        help="how prefill gets its causal pattern (default: causal bool additive)",
    )
    p.add_argument("--impls", nargs="+", metavar="NAME", help="only these implementations (default: all)")
    p.add_argument("--q-heads", type=_positive_int, help="H_q (default: 32)")
    p.add_argument("--head-dim", type=_positive_int, help="D (default: 128)")
    p.add_argument("--repeats", type=_positive_int, help="timed repetitions per case (default: adaptive)")
    p.add_argument("--warmup", type=int, help="untimed rounds after the check (default: 0 on CPU, 2 on CUDA)")
    p.add_argument(
        "--max-call-s",
        type=_positive_float,
        help="an implementation whose checked call takes longer is "
        "not timed (default: 20 on CPU, 5 with --quick, 300 on CUDA)",
    )
    p.add_argument("--max-seconds", type=_positive_float, help="start no new case after this many seconds")
    p.add_argument(
        "--mem-budget-gb",
        type=_positive_float,
        help="memory a case may use (default: 60%% of the available RAM, 85%% of the free GPU memory)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="write every raw number and the machine here")
    p.add_argument("--markdown", type=Path, metavar="PATH", help="write the markdown report here")
    p.add_argument("--plots", type=Path, metavar="DIR", help="write attention-decode.png and attention-kv-bytes.png")
    p.add_argument("--from-json", type=Path, metavar="PATH", help="measure nothing: re-render a saved --json run")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default: 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p  # fmt: skip


def resolve_grid(args: argparse.Namespace, device: torch.device) -> Grid:
    """The preset (CPU or GPU, ``--quick`` or full) with the size flags applied. ``--batches`` / ``--contexts``
    replace the decode grid by every ``(B, S)`` pair (the missing one from the preset's main sweep: B=8 and its
    contexts)."""
    preset = {(False, False): CPU_FULL, (False, True): CPU_QUICK, (True, False): GPU_FULL, (True, True): GPU_QUICK}
    grid = preset[(device.type == "cuda", args.quick)]
    if args.batches or args.contexts:
        main_batch = grid.decode[0][0]
        batches = args.batches or [main_batch]
        contexts = args.contexts or [s for b, s in grid.decode if b == main_batch]
        grid = replace(grid, decode=tuple(dict.fromkeys((b, s) for b in batches for s in contexts)))
    if args.prefill_lens:
        grid = replace(grid, prefill=tuple(dict.fromkeys(args.prefill_lens)))
    grid = replace(grid, masks=tuple(dict.fromkeys(args.masks)))
    if args.q_heads:
        grid = replace(grid, q_heads=args.q_heads)
    if args.head_dim:
        grid = replace(grid, head_dim=args.head_dim)
    return grid


def _check_output_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    files = [(flag, path) for flag, path in (("--json", args.json), ("--markdown", args.markdown)) if path]
    for flag, path in files:
        if path.is_dir():
            parser.error(f"{flag} {path} is a directory; give a file path")
    if args.json and args.markdown and args.json.resolve() == args.markdown.resolve():
        parser.error("--json and --markdown point at the same file")
    if args.from_json and args.json and args.from_json.resolve() == args.json.resolve():
        parser.error("--json would overwrite the --from-json input")
    if args.plots:
        if args.plots.exists() and not args.plots.is_dir():
            parser.error(f"--plots {args.plots} exists and is not a directory")
        from .plots import check_plotting

        try:
            check_plotting()
        except ImportError as err:
            parser.error(str(err))


def _select_impls(parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> list[Impl]:
    impls = implementations_for(device)
    if not args.impls:
        return impls
    known = {impl.name for impl in impls}
    unknown = [name for name in args.impls if name not in known]
    if unknown:
        parser.error(f"--impls: unknown {unknown} on {device.type}; choose from {sorted(known)}")
    return [impl for impl in impls if impl.name in args.impls]


def _render(payload: dict, args: argparse.Namespace) -> str:
    text = format_markdown(payload)
    if args.markdown:
        write_text_atomic(args.markdown, text)
    if args.plots:
        from .plots import write_plots

        write_plots(payload, args.plots)
    return text


def main(argv: Sequence[str | os.PathLike[str]] | None = None) -> int:
    """Run the benchmark (or re-render ``--from-json``); print the markdown report on stdout, progress on stderr.

    Returns
    -------
    int
        0; 1 when an implementation's output did not match the reference backend or an adapter raised unexpectedly.
    """
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else [os.fspath(a) for a in argv]
    args = parser.parse_args(argv)
    _check_output_paths(parser, args)
    if args.from_json:
        try:
            payload = json.loads(args.from_json.read_text())
        except (OSError, json.JSONDecodeError) as err:
            parser.error(f"--from-json {args.from_json}: {err}")
        if payload.get("benchmark") != "attention" or "rows" not in payload:
            parser.error(f"--from-json {args.from_json} is not an attention benchmark run")
        print(_render(payload, args), end="")
        return 0

    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r}: only cpu and cuda are supported")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available in this torch build / machine")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device!r}: only cpu and cuda are supported")
    grid = resolve_grid(args, device)
    bad = [h for h in args.kv_heads if grid.q_heads % h]
    if bad:
        parser.error(f"--kv-heads {bad} must divide H_q={grid.q_heads}")
    impls = _select_impls(parser, args, device)
    settings = (GPU_SETTINGS if device.type == "cuda" else CPU_SETTINGS)["quick" if args.quick else "full"]
    if args.warmup is not None:
        if args.warmup < 0:
            parser.error(f"--warmup must be >= 0, got {args.warmup}")
        settings = replace(settings, warmup=args.warmup)
    if args.max_call_s is not None:
        settings = replace(settings, max_call_s=args.max_call_s)

    run_start = time.perf_counter()
    machine = machine_description(device)
    budget = memory_budget(device, args.mem_budget_gb)
    cases = build_cases(grid, args.kinds, args.dtypes, args.kv_heads)
    progress = not args.no_progress
    if progress:
        print(f"gqa bench attention: {len(cases)} cases, {len(impls)} implementations on {device}; measuring the "
              f"limits ...", file=sys.stderr, flush=True)  # fmt: skip
    limit_dtypes = list(dict.fromkeys([*args.dtypes, torch.float32]))
    read_bytes = max(min(settings.read_bytes, budget // 4), 16 * 2**20)
    limits_start = measure_limits(device, limit_dtypes, read_bytes=read_bytes,
                                  gemm_n=settings.gemm_n, repeats=settings.limit_repeats)  # fmt: skip
    payload: dict = {
        "benchmark": "attention",
        "version": 2,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "gqa bench attention " + shlex.join(argv),
        "machine": machine,
        "quick": args.quick,
        "seed": args.seed,
        "grid": asdict(grid),
        "kinds": list(args.kinds),
        "dtypes": [dtype_name(d) for d in args.dtypes],
        "kv_heads": list(args.kv_heads),
        "settings": asdict(settings) | {"repeats": args.repeats, "max_seconds": args.max_seconds},
        "memory_budget_bytes": budget,
        "tolerance": {dtype_name(d): dict(zip(("atol", "rtol"), t, strict=True)) for d, t in TOLERANCE.items()},
        "implementations": [{"name": i.name, "group": i.group, "description": i.description} for i in impls],
        "ours": [*BACKENDS, "auto"],
        "limits": limits_start.to_json(),
        "limits_start": limits_start.to_json(),
        "counting": COUNTING,
        "rows": [],
        "complete": False,
    }

    def save() -> None:
        payload["elapsed_s"] = time.perf_counter() - run_start
        if args.json:
            write_json_atomic(args.json, payload)

    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(cases), file=sys.stderr, unit="case", dynamic_ncols=True, mininterval=1.0)
    stopped = None
    try:
        for case in cases:
            if bar is not None:
                bar.set_postfix_str(case.label, refresh=True)
            t0 = time.perf_counter()
            if args.max_seconds is not None and t0 - run_start > args.max_seconds:
                stopped = stopped or f"--max-seconds {args.max_seconds:g} reached"
                row = _skipped_row(case, f"not run: {stopped}")
            elif case.input_bytes > budget:
                row = _skipped_row(case, f"inputs need {_gib(case.input_bytes)}, memory budget {_gib(budget)}")
            else:
                try:
                    row = run_case(case, impls, device=device, settings=settings, repeats=args.repeats,
                                   budget=budget, seed=args.seed)  # fmt: skip
                except (RuntimeError, MemoryError) as err:  # e.g. out of memory while drawing the inputs
                    row = _skipped_row(case, f"{type(err).__name__}: {err}"[:500])
                _free(device)
            payload["rows"].append(annotate(row, payload["limits"]))
            save()
            if bar is not None:
                bar.update()
                bar.write(_progress_line(row, time.perf_counter() - t0), file=sys.stderr)
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        if bar is not None:
            bar.close()

    if time.perf_counter() - run_start > 30 and stopped != "interrupted":  # long run: measure the ceilings again
        limits_end = measure_limits(device, limit_dtypes, read_bytes=read_bytes,
                                    gemm_n=settings.gemm_n, repeats=settings.limit_repeats)  # fmt: skip
        payload["limits_end"] = limits_end.to_json()
        payload["limits"] = Limits.best(limits_start, limits_end).to_json()
        payload["rows"] = [annotate(row, payload["limits"]) for row in payload["rows"]]
    payload["complete"] = stopped is None
    payload["stopped"] = stopped
    payload["loadavg_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    save()
    print(_render(payload, args), end="")
    failed = [f"{r['kind']} {r['dtype']} H_kv={r['H_kv']} S={r['S']} {r['mask']}: {name}"
              for r in payload["rows"] for name in [*r.get("mismatches", []), *r.get("errors", {})]]  # fmt: skip
    if failed:
        message = f"MISMATCH or error vs the reference backend: {'; '.join(failed)}"
        print(f"\n{message}")
        print(message, file=sys.stderr)
    return 1 if failed else 0


def _progress_line(row: dict, seconds: float) -> str:
    label = f"{row['kind']} {row['dtype']} B={row['B']} H_kv={row['H_kv']} L={row['L']} S={row['S']} {row['mask']}"
    if row.get("status") != "ran":
        return f"{label}: skipped ({row.get('skip_reason')})"
    med = row["median_ms"]
    note = f"  MISMATCH: {', '.join(row['mismatches'])}" if row.get("mismatches") else ""
    note += f"  ERROR: {', '.join(row['errors'])}" if row.get("errors") else ""
    return (f"{label}: auto({row['auto_backend']}) {fmt_ms(med.get('auto'))} ms, torch-sdpa "
            f"{fmt_ms(med.get('torch-sdpa'))} ms, x{row['repeats']} ({seconds:.1f} s){note}")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
