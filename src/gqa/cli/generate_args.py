"""The flags of ``gqa generate``, without torch (``gqa generate --help``); ``generate`` runs the command."""

from __future__ import annotations

import argparse

from ..options.common import add_model_arguments, add_tp_argument
from ..options.defaults import QUANT_FORMATS


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gqa generate`` on ``parser``."""
    parser.add_argument("prompt", help="the prompt (a user message, or plain text with --raw)")
    add_model_arguments(
        parser,
        "weight dtype; auto: bf16 where the CPU multiplies bf16 natively (AVX512-BF16/AMX), else fp32, and a GGUF's "
        "q8_0/q4_0/q4_1 weights stay quantized; a float dtype dequantizes them",
        auto=True,
    )
    parser.add_argument(
        "--quantize", choices=sorted(QUANT_FORMATS), default=None,
        help="quantize the layers' weights to this block format after loading (embeddings and output: q8_0)",
    )  # fmt: skip
    parser.add_argument(
        "--compile", action="store_true",
        help="decode through torch.compile (compiled once per cache size, kept on disk; ~10 s per process even when "
        "cached). Off by default: the native CPU decode step is as fast without the wait",
    )  # fmt: skip
    parser.add_argument("--raw", action="store_true", help="plain continuation, no chat template")
    parser.add_argument("--system", default=None, help="system message for the chat template (default: none)")
    parser.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="stop after N new tokens")
    parser.add_argument(
        "--temperature", type=float, default=0.0, metavar="T", help="sampling temperature; 0 is greedy decoding"
    )
    parser.add_argument(
        "--top-k", type=int, default=None, metavar="K", help="with T > 0: sample from the K most likely tokens "
        "(default: off)"
    )  # fmt: skip
    parser.add_argument(
        "--top-p", type=float, default=None, metavar="P",
        help="with T > 0: sample from the most likely tokens that make up probability P (default: off)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="with T > 0: random seed (default: unseeded)")
    parser.add_argument(
        "--stats", action="store_true",
        help="print prefill/decode tokens per second, and what ran (decode path, dtype, weights), to stderr",
    )  # fmt: skip
    add_tp_argument(parser)
