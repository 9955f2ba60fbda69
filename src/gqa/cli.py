"""The ``gqa`` command line: ``generate``, ``info``, ``eval``, ``convert``, ``bench``, ``demo``."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    argv = sys.argv[1:] if argv is None else argv
    from .commands import add_generate_arguments, add_model_arguments, run_generate, run_info
    from .commands_convert import add_convert_arguments, run_convert
    from .commands_eval import add_eval_arguments, run_eval

    parser = argparse.ArgumentParser(prog="gqa", description="Grouped-query attention for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_arguments(sub.add_parser("generate", help="generate text with a model (default: embedded SmolLM2)"))
    add_model_arguments(sub.add_parser("info", help="a model's architecture and KV-cache size vs MHA and MQA"))
    add_eval_arguments(sub.add_parser("eval", help="perplexity on a text, and mean KL divergence from a reference"))
    sub.add_parser("demo", help="MHA vs GQA vs MQA: cache size, cached decoding checked against a full forward")
    add_convert_arguments(sub.add_parser("convert", help="change a model's number of KV heads; writes an HF folder"))
    bench = sub.add_parser("bench", help="benchmarks (e.g. 'gqa bench attention --help')")
    bench.add_argument("what", choices=["attention", "model"])
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that benchmark")
    ns = parser.parse_args(argv)
    try:
        if ns.command == "generate":
            return run_generate(ns)
        if ns.command == "info":
            return run_info(ns)
        if ns.command == "convert":
            return run_convert(ns)
        if ns.command == "eval":
            return run_eval(ns)
        if ns.command == "demo":
            from .demo import main as demo

            return demo()
        if ns.what == "model":
            from .bench.model import main as bench_model

            return bench_model(ns.args)
        from .bench.attention import main as bench_attention

        return bench_attention(ns.args)
    except (ValueError, OSError) as e:
        print(f"gqa {ns.command}: error: {e}", file=sys.stderr)
        return 2
