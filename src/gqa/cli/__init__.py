"""The ``gqa`` command line: the parser and dispatch here, a file per command (``generate``, ``info``, ``eval``,
``convert``, ``serve``, ``demo``) and one for its flags where the command imports torch (``generate_args``,
``eval_args``, ``convert_args``, ``serve_args``), so that ``gqa --help`` and ``gqa COMMAND --help`` run without
torch; ``bench``'s benchmarks live in ``gqa.bench``."""

from __future__ import annotations

__all__ = ["build_parser", "main"]

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType

from .. import __version__
from ..options.common import HelpFormatter

Handler = Callable[[argparse.Namespace, list[str]], int]  # (parsed flags, the command line)


def _subcommand(
    sub: argparse._SubParsersAction, name: str, help: str, handler: Handler, description: str | None = None
) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` shows the defaults; ``handler(ns, argv)`` runs it."""
    parser = sub.add_parser(name, help=help, description=description or help, formatter_class=HelpFormatter)
    parser.set_defaults(handler=handler, prog=parser.prog)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The ``gqa`` parser: a subcommand each, ``bench`` with a subcommand per benchmark. Built from the commands'
    flags alone (``*_args``, ``bench.*arguments``, ``bench.startup``): no torch is imported until a command runs."""
    from ..bench import serve as bench_serve
    from ..bench import shared_cpu as bench_shared
    from ..bench import startup as bench_startup
    from ..bench.arguments import DESCRIPTION as ATTENTION_DESCRIPTION
    from ..bench.arguments import add_arguments as add_attention_arguments
    from ..bench.model_arguments import DESCRIPTION as MODEL_DESCRIPTION
    from ..bench.model_arguments import add_arguments as add_model_bench_arguments
    from ..options.common import add_model_arguments
    from ..options.dtypes import SPELLINGS
    from .convert_args import add_convert_arguments
    from .eval_args import add_eval_arguments
    from .generate_args import add_generate_arguments
    from .serve_args import add_serve_arguments

    parser = argparse.ArgumentParser(
        prog="gqa",
        description="Grouped-query attention for PyTorch.",
        epilog=f"Every --dtype takes {SPELLINGS}. 'gqa COMMAND --help' shows a command's options.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gqa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_arguments(
        _subcommand(sub, "generate", "generate text with a model (default: embedded SmolLM2)", _ns("generate"))
    )
    info = _subcommand(sub, "info", "a model's architecture and KV-cache size vs MHA and MQA", _ns("info"))
    add_model_arguments(info, dtype_help="dtype of the KV cache (and weights, with --tp) in the tables")
    info.add_argument("--tp", type=int, default=None, metavar="N", help="also show each of N tensor-parallel ranks' "
                      "heads, weight bytes and KV-cache bytes per token (default: off)")  # fmt: skip
    add_eval_arguments(
        _subcommand(sub, "eval", "perplexity on a text, and mean KL divergence from a reference", _ns("eval"))
    )
    _subcommand(sub, "demo", "MHA vs GQA vs MQA: cache size, cached decoding checked against a full forward", _demo)
    add_serve_arguments(
        _subcommand(sub, "serve", "serve a model over an OpenAI-compatible HTTP API (continuous batching, paged KV "
                    "cache)", _ns("serve"))
    )  # fmt: skip
    add_convert_arguments(
        _subcommand(sub, "convert", "change a model's number of KV heads; writes an HF folder", _ns("convert"))
    )
    bench = sub.add_parser(
        "bench",
        help="benchmarks: attention implementations, or a whole model as MHA, GQA and MQA",
        description="Benchmarks; 'gqa bench BENCHMARK --help' shows a benchmark's options.",
        formatter_class=HelpFormatter,
    )
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    attention = _subcommand(
        benchmarks,
        "attention",
        "time gqa's attention backends and peer implementations against the machine's bandwidth and matmul rate",
        lambda ns, argv: _bench("attention").run(attention, ns, argv[argv.index("attention") + 1 :]),
        ATTENTION_DESCRIPTION,
    )
    add_attention_arguments(attention)
    model = _subcommand(
        benchmarks,
        "model",
        "KV-cache size, prefill and decode tokens/s of gqa vs HF transformers, the model as MHA, GQA and MQA",
        lambda ns, argv: _bench("model").run(model, ns),
        MODEL_DESCRIPTION,
    )
    add_model_bench_arguments(model)
    for name, summary, module in (
        ("startup", "process wall time of import gqa, gqa info, a first token and load_model, beside llama.cpp's",
         bench_startup),
        ("shared", "decode tok/s alone and beside busy processes: the share of its alone speed each engine keeps",
         bench_shared),
        ("serve", "OpenAI-compatible servers under 1-64 concurrent streaming clients: tok/s, TTFT, ITL, memory",
         bench_serve),
    ):  # fmt: skip
        _flag_only_benchmark(benchmarks, name, summary, module)
    return parser


def _flag_only_benchmark(benchmarks: argparse._SubParsersAction, name: str, summary: str, module: ModuleType) -> None:
    """``gqa bench NAME`` for a benchmark module that imports no torch at import: its ``DESCRIPTION``,
    ``add_arguments`` and ``run(parser, ns)``."""
    parser = _subcommand(benchmarks, name, summary, lambda ns, argv: module.run(parser, ns), module.DESCRIPTION)
    module.add_arguments(parser)


def _ns(command: str) -> Handler:
    """The handler of ``gqa COMMAND``: ``gqa.cli.COMMAND.run_COMMAND(ns)``, imported when it runs (most import
    torch)."""
    return lambda ns, argv: getattr(importlib.import_module(f".{command}", __name__), f"run_{command}")(ns)


def _bench(name: str) -> ModuleType:
    """``gqa.bench.NAME``, imported when the benchmark runs (it imports torch)."""
    return importlib.import_module(f"..bench.{name}", __name__)


def _demo(ns: argparse.Namespace, argv: list[str]) -> int:
    from .demo import main as demo

    return demo()


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser().parse_args(argv)
    try:
        return ns.handler(ns, argv)
    except (ValueError, OSError) as e:
        print(f"{ns.prog}: error: {e}", file=sys.stderr)
        return 2
