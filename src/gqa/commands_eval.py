"""``gqa eval``: perplexity of a model on a text, and its KL divergence from a reference model."""

from __future__ import annotations

import argparse
from pathlib import Path

from .cli_dtypes import DTYPES, add_dtype_argument
from .commands import loading, model_label
from .evaluate import DEFAULT_WINDOW, check_windows, default_eval_text, evaluate

EVAL_DTYPES = ("fp32", "bf16")


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
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
    add_dtype_argument(parser, "--dtype", choices=EVAL_DTYPES, default="fp32", help="weight dtype")


def load_text(path: str | None) -> tuple[str, str]:
    """``(text, description)`` of a text file, or of the default evaluation text when ``path`` is ``None``."""
    if path is None:
        return default_eval_text()
    return Path(path).read_text(encoding="utf-8"), path


def model_name(path: str | None) -> str:
    if path is not None:
        return path
    from .loaders import default_model_path

    return f"{default_model_path().name} (default)"


def run_eval(ns: argparse.Namespace) -> int:
    stride = check_windows(ns.window, None)  # evaluate() checks the rest before loading anything
    text, description = load_text(ns.text)
    what = f"{model_label(ns.model)} as {ns.dtype}"
    what += f" and reference {ns.reference} as fp32" if ns.reference is not None else ""
    with loading(f"{what}, then scoring {description}"):
        res = evaluate(
            ns.model,
            text,
            reference_path=ns.reference,
            window=ns.window,
            max_tokens=ns.max_tokens,
            dtype=DTYPES[ns.dtype],
        )
    print(f"model        {model_name(ns.model)}, {ns.dtype}")
    print(f"text         {description}")
    print(f"tokens       {res.tokens}  (window {ns.window}, stride {stride})")
    print(f"perplexity   {res.perplexity:.4f}")
    if res.kl is not None:
        print(f"mean KL      {res.kl:.6g} nats/token  (KL(reference || model), reference {ns.reference} in fp32)")
    return 0
