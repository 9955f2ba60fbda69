"""The flags of ``gqa bench attention``: the parser, the grid they select, and their validation. The parser is
built without importing torch (``gqa bench attention --help``); what the flags select is resolved with it."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ...options.dtypes import dtype_type, torch_dtype
from .workloads import KINDS, MASKS

if TYPE_CHECKING:
    import torch

    from .cases import Grid
    from .implementations import Impl

DEFAULT_DTYPES = ("fp32", "bf16")  # --dtypes when not given


def _dtype(text: str) -> torch.dtype:
    """Any spelling of ``gqa.options.dtypes`` -> the torch dtype."""
    return torch_dtype(dtype_type()(text))


def resolve_dtypes(args: argparse.Namespace) -> list[torch.dtype]:
    """``--dtypes``, or the default (float32 and bfloat16) where it was not given: set on ``args`` and returned."""
    if args.dtypes is None:
        args.dtypes = [torch_dtype(name) for name in DEFAULT_DTYPES]
    return args.dtypes


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


RUN = "gqa.bench.attention.benchmark"  # the module whose run(parser, args) runs the benchmark (it imports torch)
HELP = "time gqa's attention backends and peer implementations against the machine's bandwidth and matmul rate"
DESCRIPTION = (
    "Time gqa's attention backends, auto and the peer implementations side by side against the machine's measured "
    "bandwidth and matmul rate; print a markdown report."
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``gqa bench attention`` (what ``python benchmarks/attention.py`` runs)."""
    from ...options.common import HelpFormatter

    parser = argparse.ArgumentParser(prog="gqa bench attention", description=DESCRIPTION, formatter_class=HelpFormatter)
    add_arguments(parser)
    return parser


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``gqa bench attention`` on ``p``."""
    p.add_argument("--quick", action="store_true", help="small grid, few repeats (under 2 minutes on 2 CPU cores)")
    p.add_argument("--device", default="cpu", help="torch device; cuda adds SDPA per kernel and flex")
    p.add_argument(
        "--kinds",
        "--cases",
        dest="kinds",
        nargs="+",
        choices=KINDS,
        default=list(KINDS),
        help="workloads",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        type=_dtype,
        default=None,  # resolve_dtypes: float32 and bfloat16, without importing torch here
        metavar="DTYPE",
        help=f"fp32, bf16, fp16 (or float32, bfloat16, float16) (default: {' '.join(DEFAULT_DTYPES)})",
    )
    p.add_argument(
        "--kv-heads",
        nargs="+",
        type=_positive_int,
        default=[32, 8, 4, 1],
        metavar="H_KV",
        help="numbers of KV heads, each dividing H_q",
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
        help="how prefill gets its causal pattern",
    )
    p.add_argument(
        "--backward", action="store_true",
        help="instead: forward + backward of causal prefill (--prefill-lens, default 4k 8k 16k on CUDA, 512 on CPU; "
        "B=1) of gqa auto vs SDPA (on CUDA held to each kernel too), gradients checked, TFLOPS",
    )  # fmt: skip
    p.add_argument(
        "--variants", action="store_true",
        help="instead: decode (--contexts, default 32k; 4k with --quick) plain, with a --window, the same window as a "
        "bool mask, soft-capping 50 and sinks, each checked, then timed: the window's speed-up, softcap's and sinks' "
        "cost",
    )  # fmt: skip
    p.add_argument(
        "--window", type=_positive_int, help="--variants: keys in the window (default: 4096, 512 with --quick)"
    )
    p.add_argument("--impls", nargs="+", metavar="NAME", help="only these implementations (default: all)")
    p.add_argument("--q-heads", type=_positive_int, help="H_q (default: 32)")
    p.add_argument("--head-dim", type=_positive_int, help="D (default: 128)")
    p.add_argument("--repeats", type=_positive_int, help="timed repetitions per case (default: adaptive)")
    p.add_argument("--warmup", type=int, help="untimed rounds after the check (default: 0 on CPU, 1-2 on CUDA)")
    p.add_argument(
        "--max-call-s",
        type=_positive_float,
        help="an implementation whose checked call takes longer is "
        "not timed (default: 10 on CPU, 5 with --quick, 300 on CUDA)",
    )
    p.add_argument(
        "--max-seconds", type=_positive_float, help="start no new case after this many seconds (default: no limit)"
    )
    p.add_argument(
        "--mem-budget-gb",
        type=_positive_float,
        help="memory a case may use (default: 60%% of the available RAM, 85%% of the free GPU memory)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="write every raw number and the machine here")
    p.add_argument("--markdown", type=Path, metavar="PATH", help="write the markdown report here")
    p.add_argument("--plots", type=Path, metavar="DIR", help="write attention-decode.png and attention-kv-bytes.png")
    p.add_argument("--from-json", type=Path, metavar="PATH", help="measure nothing: re-render a saved --json run")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def resolve_grid(args: argparse.Namespace, device: torch.device) -> Grid:
    """The preset (CPU or GPU, ``--quick`` or full) with the size flags applied. ``--batches`` / ``--contexts``
    replace the decode grid by every ``(B, S)`` pair (the missing one from the preset's main sweep: B=8 and its
    contexts)."""
    from .cases import CPU_FULL, CPU_QUICK, GPU_FULL, GPU_QUICK

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


def check_output_paths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
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


def select_impls(parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> list[Impl]:
    from .implementations import implementations_for

    impls = implementations_for(device)
    if not args.impls:
        return impls
    known = {impl.name for impl in impls}
    unknown = [name for name in args.impls if name not in known]
    if unknown:
        parser.error(f"--impls: unknown {unknown} on {device.type}; choose from {sorted(known)}")
    return [impl for impl in impls if impl.name in args.impls]
