"""The flags of ``gqa eval``, without torch (``gqa eval --help``); ``eval`` runs the command."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..options.defaults import DEFAULT_WINDOW, HELD_OUT_CONVERSATIONS, QUANT_FORMATS
from ..options.dtypes import add_dtype_argument

EVAL_DTYPES = ("fp32", "bf16")


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gqa eval`` on ``parser``."""
    parser.add_argument("model", nargs="?", default=None, help="GGUF file or HF directory (default: embedded SmolLM2)")
    parser.add_argument("--text", default=None, metavar="FILE", help="UTF-8 text file (default: CPython's LICENSE.txt)")
    parser.add_argument(
        "--reference",
        default=None,
        metavar="MODEL",
        help="model to report mean KL(reference || model) against, loaded in fp32",
    )
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="tokens per forward pass")
    parser.add_argument(
        "--max-tokens", type=int, default=None, metavar="N", help="evaluate only the first N tokens (default: all)"
    )
    add_dtype_argument(
        parser, "--dtype", choices=EVAL_DTYPES, keywords=("auto",), default="fp32",
        help="weight dtype; auto: as gqa generate's default (bf16 where native, a GGUF's q8_0/q4_0/q4_1 blocks kept)",
    )  # fmt: skip
    parser.add_argument(
        "--quantize",
        choices=sorted(QUANT_FORMATS),
        default=None,
        help="quantize the layers' weights to this block format",
    )
    parser.add_argument(
        "--decode", action="store_true",
        help="score every token through a one-token decode step with a KV cache, as generation runs the model "
        "(slower); a quantized model's int8 decode inputs only show this way",
    )  # fmt: skip
    suite = parser.add_argument_group(
        "suite", "judge a converted chat model against its original (--reference, default the embedded SmolLM2) on "
        "answers and prose: KL on held-out self-generated answers, agreement of greedy answers, the question set, "
        "and perplexity on three genres (both models in fp32; --text, --window, --max-tokens and --dtype do not apply)",
    )  # fmt: skip
    suite.add_argument("--suite", action="store_true", help="run the four measures instead of one perplexity")
    suite.add_argument(
        "--conversations", type=int, default=HELD_OUT_CONVERSATIONS, metavar="N",
        help="held-out conversations to score",
    )  # fmt: skip
    suite.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    suite.add_argument("--show-answers", action="store_true", help="print both models' replies to every question")
