"""The flags of ``gqa serve``, without torch (``gqa serve --help``); ``serve`` runs the command."""

from __future__ import annotations

import argparse

from ..options.common import add_model_arguments


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gqa serve`` on ``parser``."""
    add_model_arguments(
        parser,
        "weight dtype; auto: bf16 where the CPU multiplies bf16 natively, else fp32, and a GGUF's q8_0/q4_0/q4_1 "
        "weights stay quantized; the KV cache is in the activations' dtype",
        auto=True,
    )
    parser.add_argument(
        "--device", default="cpu", metavar="DEV",
        help="cpu (the native kernels) or cuda / cuda:N (the paged Triton kernel, KV pool in device memory; auto "
        "dtype is bf16 there, quantized weights are dequantized)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (0: any free one, printed at start)")
    parser.add_argument(
        "--kv-cache-mib", type=float, default=None, metavar="N",
        help="KV cache pool size in MiB (default: a quarter of the available memory, on CUDA half the free device "
        "memory, at most what --max-running full contexts need); fewer KV heads fit more sequences in it",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=16, metavar="N", help="token slots per KV cache block")
    parser.add_argument("--max-running", type=int, default=64, metavar="N", help="requests decoded together at most")
    parser.add_argument(
        "--max-queue", type=int, default=256, metavar="N",
        help="requests accepted beyond --max-running before the server answers 429 (retry later)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-chunk", type=int, default=64, metavar="N",
        help="prompt tokens per step while others decode (4x while none does; a long prompt delays streams a chunk)",
    )  # fmt: skip
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: open)")
    parser.add_argument("--served-model-name", default=None, help="the model's name in the API (default: from --model)")
