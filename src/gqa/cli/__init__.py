"""The ``gqa`` command line: the parser and dispatch here, a module per command (``generate``, ``info``, ``eval``,
``demo``, ``serve``, ``convert``; ``parallel`` runs one on tensor-parallel ranks) and per benchmark (in
``gqa.bench``), each in one shape: ``HELP``, ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(parser, args)``,
torch imported inside ``run`` so that ``gqa --help``, ``gqa COMMAND --help`` and ``gqa info`` run without it."""

from __future__ import annotations

__all__ = ["BENCHMARKS", "COMMANDS", "build_parser", "main"]

import argparse
import importlib
import os
import sys
from types import ModuleType

from .. import __version__
from ..options.common import HelpFormatter

# Every command and benchmark is a module with HELP, DESCRIPTION, add_arguments(parser) and run(parser, args) (or
# RUN, the module whose run that is), and imports no torch until run: the parser is built from all of them without
# it (gqa --help, gqa info).
COMMANDS = ("generate", "info", "eval", "demo", "serve", "convert")  # gqa.cli.NAME
BENCHMARKS = {"attention": "attention", "model": "model", "startup": "startup", "shared": "shared_cpu",
              "serve": "serve"}  # gqa bench NAME -> gqa.bench.MODULE (a package for the two larger ones)  # fmt: skip


def _add(sub: argparse._SubParsersAction, name: str, module: ModuleType) -> argparse.ArgumentParser:
    """``name`` as a subcommand run by ``module``'s ``run``, or by the ``run`` of the module its ``RUN`` names (a
    benchmark whose work imports torch at its top, imported when it runs); its ``--help`` shows the defaults."""
    parser = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION, formatter_class=HelpFormatter)

    def run(ns: argparse.Namespace) -> int:
        runner = module if hasattr(module, "run") else importlib.import_module(module.RUN)
        return runner.run(parser, ns)

    parser.set_defaults(run=run, prog=parser.prog)
    module.add_arguments(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The ``gqa`` parser: a subcommand per ``COMMANDS`` module, ``bench`` with one per ``BENCHMARKS`` module."""
    from ..options.dtypes import SPELLINGS

    parser = argparse.ArgumentParser(
        prog="gqa",
        description="Grouped-query attention for PyTorch.",
        epilog=f"Every --dtype takes {SPELLINGS}. 'gqa COMMAND --help' shows a command's options.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gqa {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        _add(sub, name, importlib.import_module(f".{name}", __name__))
    bench = sub.add_parser(
        "bench",
        help="benchmarks: attention implementations, or a whole model as MHA, GQA and MQA",
        description="Benchmarks; 'gqa bench BENCHMARK --help' shows a benchmark's options.",
        formatter_class=HelpFormatter,
    )
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    for name, module in BENCHMARKS.items():
        _add(benchmarks, name, importlib.import_module(f"..bench.{module}", __name__))
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    argv = sys.argv[1:] if argv is None else argv
    ns = build_parser().parse_args(argv)
    ns.argv = list(argv)  # the command line, for the benchmarks' records
    try:
        return ns.run(ns)
    except (ValueError, OSError) as e:
        print(f"{ns.prog}: error: {e}", file=sys.stderr)
        return 2
