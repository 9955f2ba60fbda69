"""What the CLI's commands share: how a model is named in messages, the loading line, the model and ``--tp`` flags.
Imports no torch: the parser is built from these (``gqa --help``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .dtypes import add_dtype_argument


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with every option's default as ``(default: X)``: appended here unless the help text states it
    already (defaults that need words, e.g. ``(default: embedded SmolLM2)``) or there is none to show (``None``, or
    ``False`` for an on/off flag). Lists show as they are typed: ``(default: 128 1024 4096)``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "(default" in text or default is None or default is False or default == argparse.SUPPRESS:
            return text
        if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


EMBEDDED_MODEL = "embedded SmolLM2-135M-Instruct"


def model_label(path: str | None) -> str:
    """How messages name a model: the path as given, or the embedded SmolLM2."""
    return EMBEDDED_MODEL if path is None else path


@contextmanager
def loading(what: str, *, timed: bool = True, quiet: bool = False) -> Iterator[None]:
    """``Loading {what} ...`` on stderr (stdout stays the command's output) before the slow part this wraps; when
    ``timed``, the line ends with the seconds it took (or just ends, if it fails). ``quiet``: no line at all (the
    ranks other than the lead one of a tensor-parallel run)."""
    if quiet:
        yield
        return
    print(f"Loading {what} ...", end="" if timed else "\n", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        if timed:
            print(file=sys.stderr, flush=True)
        raise
    if timed:
        print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)


def add_model_arguments(
    parser: argparse.ArgumentParser, dtype_help: str = "weight dtype", *, auto: bool = False
) -> None:
    """``--model`` and ``--dtype`` (default fp32; with ``auto``, the keyword ``auto`` is accepted and the default)."""
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M)")
    keywords = ("auto",) if auto else ()
    add_dtype_argument(parser, "--dtype", keywords=keywords, default="auto" if auto else "fp32", help=dtype_help)


def add_tp_argument(parser: argparse.ArgumentParser) -> None:
    """``--tp N``: the tensor-parallel ranks a command runs on (``gqa.cli.parallel``)."""
    parser.add_argument(
        "--tp", type=int, default=None, metavar="N",
        help="tensor parallelism over N local processes that gqa starts (gloo on CPU); under torchrun the world "
        "size is used (default: 1, or torchrun's world size)",
    )  # fmt: skip
