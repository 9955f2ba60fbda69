"""The flags of ``gqa convert``, without torch (``gqa convert --help``); ``convert`` runs the command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..options.defaults import (
    AFTER_LOCAL_LR,
    BUILTIN_METHODS,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_METHOD,
    END_TO_END_LR,
    HEAL_LOG_NAME,
    HEAL_PLOT_NAME,
    PRECISIONS,
    SHARDINGS,
    SIZE_UNITS,
    TRAINABLE,
    HealConfig,
)
from ..options.dtypes import add_dtype_argument

BUILTIN_HEAL_TEXT = "stdlib"


def method_names() -> list[str]:
    """The merge methods ``--method`` offers, sorted: the built-in ones, and any ``gqa.convert.register_method`` added
    where the registry is loaded already (it imports torch; the built-in names need not)."""
    methods = sys.modules.get("gqa.convert.methods")
    return sorted({*BUILTIN_METHODS, *(methods.METHODS if methods is not None else ())})


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gqa convert`` on ``parser``."""
    src_help = "GGUF file or HF folder (default: embedded SmolLM2-135M-Instruct); never modified"
    parser.add_argument("src", nargs="?", default=None, metavar="SRC", help=src_help)
    parser.add_argument("dst", metavar="DST", help="the HF checkpoint folder to write")
    parser.add_argument("--kv-heads", type=int, required=True, metavar="N", help="new number of KV heads")
    method_help = "how to merge KV heads when N is smaller; expanding is always exact"
    parser.add_argument("--method", choices=method_names(), default=DEFAULT_METHOD, help=method_help)
    parser.add_argument(
        "--calibration-text", type=Path, default=None, metavar="FILE",
        help="text for calibrated methods (default: standard-library docstrings)",
    )  # fmt: skip
    parser.add_argument(
        "--refit", action=argparse.BooleanOptionalAction, default=None,
        help="after each layer's merge, re-solve v_proj and o_proj by least squares against the source layer's output "
        "on the calibration text (default: on for pca, off for mean/first)",
    )  # fmt: skip
    parser.add_argument(
        "--conversations", action=argparse.BooleanOptionalAction, default=None,
        help="calibrate and heal (where no text is given) on conversations the source writes itself, mixed with "
        "docstrings; generated once per model and cached (default: on when the source has a chat template)",
    )  # fmt: skip
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    add_dtype_argument(
        parser, "--dtype", keywords=["source"], default="source",
        help="dtype of the written weights (default: the source's; a GGUF's quantized blocks give fp32); the "
        "arithmetic is fp32 either way",
    )  # fmt: skip
    parser.add_argument(
        "--device", default="auto", metavar="DEV",
        help="where calibration, merging, the refit and healing run: auto (the GPU if there is one), cpu, cuda, cuda:N",
    )  # fmt: skip
    parser.add_argument(
        "--max-shard-size", type=_shard_size, default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE",
        help=f"largest weight file, e.g. 5GB or 500MiB (default: {DEFAULT_MAX_SHARD_SIZE}); more is sharded with "
        f"model.safetensors.index.json. Units: {SIZE_UNITS}",
    )  # fmt: skip
    parser.add_argument(
        "--dry-run", action="store_true",
        help="print the memory and time the conversion is expected to take, and write nothing",
    )  # fmt: skip
    heal = parser.add_argument_group(
        "healing", "distil the merged model from SRC (KL on the logits) before writing it; "
        f"DST then also holds {HEAL_PLOT_NAME} (loss curve) and {HEAL_LOG_NAME}",
    )  # fmt: skip
    heal.add_argument("--heal-steps", type=int, default=0, metavar="N", help="optimizer steps (default: 0, no healing)")
    heal.add_argument(
        "--heal-minutes", type=float, default=None, metavar="M",
        help="wall-time budget: heal until M minutes are spent (or N steps, if --heal-steps is also given); the "
        "learning-rate schedule follows the time (default: no time limit)",
    )  # fmt: skip
    heal.add_argument(
        "--heal-text", default=None, metavar="FILE",
        help="UTF-8 text to heal on (default: the source's self-generated conversations mixed with docstrings, or "
        f"for a model without a chat template the docstrings alone); '{BUILTIN_HEAL_TEXT}' is the built-in ~1.2 MB "
        "of standard-library docstrings (disjoint from gqa eval's default text)",
    )  # fmt: skip
    d = HealConfig(steps=1)
    heal.add_argument("--heal-lr", type=float, default=None, metavar="LR",
                      help=f"peak learning rate of the end-to-end phase (default: {END_TO_END_LR:g}, or "
                           f"{AFTER_LOCAL_LR:g} after a layer-local phase)")  # fmt: skip
    heal.add_argument("--heal-seq-len", type=int, default=d.seq_len, metavar="L", help="tokens per window")
    heal.add_argument("--heal-batch", type=int, default=d.batch_size, metavar="B", help="windows per step")
    heal.add_argument(
        "--heal-train", choices=TRAINABLE, default=d.train,
        help="which parameters train: the q/k/v/o projections; those and LoRA adapters on the MLP (folded in at the "
        "end); or all",
    )  # fmt: skip
    heal.add_argument(
        "--heal-local-share", type=float, default=d.local_share, metavar="F",
        help="share of the budget (of --heal-minutes, else of --heal-steps) spent first on layer-local healing: each "
        "merged attention block trained alone to reproduce SRC's block on SRC's hidden states (default: %(default)s)",
    )  # fmt: skip
    heal.add_argument("--heal-seed", type=int, default=d.seed, metavar="S", help="seed of the window order")
    heal.add_argument(
        "--heal-sharding", choices=SHARDINGS, default=d.sharding,
        help="under torchrun: ddp replicates the models on every process, fsdp shards them (for a model too big for "
        "one device); auto: fsdp only where replicas and optimizer would not fit",
    )  # fmt: skip
    add_dtype_argument(
        heal, "--heal-precision", choices=[p for p in PRECISIONS if p != "auto"], keywords=["auto"],
        default=d.precision, help="bf16: the passes under bfloat16 autocast, float32 weights and optimizer; auto: "
        "bf16 where the hardware multiplies bf16 natively (AVX512-BF16/AMX CPU, recent GPU), else fp32",
    )  # fmt: skip


def _shard_size(text: str) -> str:
    """``--max-shard-size``'s value, checked (``parse_size``): a bad one is an argparse error naming the flag."""
    from ..convert.shards import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
