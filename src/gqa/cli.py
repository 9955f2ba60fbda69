"""The ``gqa`` command line: ``gqa demo`` and ``gqa bench attention``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="gqa", description="Grouped-query attention for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="MHA vs GQA vs MQA: cache size, cached decoding checked against a full forward")
    bench = sub.add_parser("bench", help="benchmarks (run 'gqa bench attention --help')")
    bench.add_argument("what", choices=["attention"])
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    ns = parser.parse_args(argv)
    if ns.command == "demo":
        from .demo import main as demo

        return demo()
    from .bench.attention import main as bench_attention

    return bench_attention(ns.args)
