"""Attention benchmark: every gqa backend, ``auto`` and the peers side by side on the same inputs, against the
machine's limits measured in the same run. ``gqa bench attention --help`` (or ``python benchmarks/attention.py``).

Per case (see :mod:`gqa.bench.attention.cases` for the grid, the masks and how bytes and FLOPs are counted) the inputs
are drawn once (fixed seed); every implementation (:mod:`gqa.bench.attention.implementations`) is checked once against
the reference backend (tolerance by dtype), warmed up, then timed round-robin (one call of each per repetition, the
starting one rotated) so that drift of the machine hits all of them alike; the reports show the median. The read
bandwidth and matmul rates (:mod:`gqa.bench.attention.limits`) are measured at the start and the end of the run.

What does not run is recorded with its reason, never a crash: a backend that raises ``ValueError`` /
``NotImplementedError`` / ``RuntimeError`` for a case or device; an implementation whose estimated extra memory (copies
of K/V, materialized scores) exceeds the memory budget; one whose checked call took longer than ``--max-call-s``
(checked, not timed); a case whose inputs exceed the budget, or that the ``--max-seconds`` budget left no time for.
Outputs: markdown on stdout (and ``--markdown``), ``--json`` with every raw number (rewritten atomically after each
case, so an interrupted run keeps what it measured), ``--plots DIR`` (two PNGs).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from datetime import datetime, timezone

import torch

from ...attention.backends import BACKENDS
from .. import write_json_atomic, write_text_atomic
from .arguments import (
    DESCRIPTION,
    add_arguments,
    build_parser,
    check_output_paths,
    resolve_dtypes,
    resolve_grid,
    select_impls,
)
from .cases import build_cases, dtype_name
from .limits import Limits, measure_limits
from .report import COUNTING, annotate, fmt_ms, format_markdown, machine_description
from .runner import (
    CPU_SETTINGS,
    GPU_SETTINGS,
    Settings,
    free_memory,
    gib,
    memory_budget,
    prepare_calls,
    run_case,
    skipped_row,
)
from .timing import TOLERANCE

__all__ = [
    "CPU_SETTINGS",
    "DESCRIPTION",
    "GPU_SETTINGS",
    "Settings",
    "add_arguments",
    "build_parser",
    "main",
    "prepare_calls",
    "resolve_grid",
    "run",
    "run_case",
]


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
    args.argv = ["attention", *argv]
    return run(parser, args)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The benchmark on the flags ``parser`` (``build_parser``, or one ``add_arguments`` filled) parsed into ``args``
    (``args.argv``: the command line, recorded in the results); bad flags are ``parser.error``."""
    full = list(getattr(args, "argv", None) or sys.argv[1:])
    argv = full[full.index("attention") + 1 :] if "attention" in full else full
    check_output_paths(parser, args)
    resolve_dtypes(args)
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
    if args.backward:
        from .backward import run as run_backward

        return run_backward(parser, args, device)
    if args.variants:
        from .variants import run as run_variants

        return run_variants(parser, args, device)
    grid = resolve_grid(args, device)
    bad = [h for h in args.kv_heads if grid.q_heads % h]
    if bad:
        parser.error(f"--kv-heads {bad} must divide H_q={grid.q_heads}")
    impls = select_impls(parser, args, device)
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
                row = skipped_row(case, f"not run: {stopped}")
            elif case.input_bytes > budget:
                row = skipped_row(case, f"inputs need {gib(case.input_bytes)}, memory budget {gib(budget)}")
            else:
                try:
                    row = run_case(case, impls, device=device, settings=settings, repeats=args.repeats,
                                   budget=budget, seed=args.seed)  # fmt: skip
                except (RuntimeError, MemoryError) as err:  # e.g. out of memory while drawing the inputs
                    row = skipped_row(case, f"{type(err).__name__}: {err}"[:500])
                free_memory(device)
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
