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
    parser: argparse.ArgumentParser, dtype_help: str = "weight dtype", *, auto: bool = False, model_help: str = ""
) -> None:
    """``--model`` and ``--dtype`` (default fp32; with ``auto``, the keyword ``auto`` is accepted and the default).
    ``model_help``: ``--model`` is repeatable (a list in the namespace) and this is its help."""
    if model_help:
        parser.add_argument("--model", action="append", default=None, help=model_help)
    else:
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


KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16", "q8_0", "q4_0", "fp8_e4m3", "fp8")  # kv_dtypes' names, and auto


def add_kv_dtype_arguments(parser: argparse.ArgumentParser) -> None:
    """``--kv-cache-dtype`` and the per-side ``--kv-cache-dtype-k`` / ``-v`` (llama.cpp's ``-ctk`` / ``-ctv``)."""
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
        help="what the KV cache stores: auto (the model's dtype), or llama.cpp's q8_0 / q4_0 blocks of 32 values with "
        "an fp16 scale (8.5 / 4.5 bits a value: 1.9x / 3.6x the tokens of bf16 in the same bytes), or on CUDA "
        "(compute capability 8.9+) fp8_e4m3 = fp8, vLLM's: a float8 byte a value, no scale (2x the tokens of bf16)",
    )  # fmt: skip
    for side in ("k", "v"):
        parser.add_argument(
            f"--kv-cache-dtype-{side}", default=None, choices=KV_CACHE_DTYPES,
            help=f"the {side.upper()} cache's type alone (default: --kv-cache-dtype)",
        )  # fmt: skip


def kv_dtype_choice(ns: argparse.Namespace) -> str | tuple[str, str]:
    """The flags' choice as ``load_model(kv_dtype=...)`` takes it: one name, or a ``(K, V)`` pair."""
    k = ns.kv_cache_dtype_k or ns.kv_cache_dtype
    v = ns.kv_cache_dtype_v or ns.kv_cache_dtype
    return k if k == v else (k, v)


def torch_device(text: str, flag: str = "--device"):
    """``--device`` as a torch device: cpu, or a CUDA device that exists here; else ``ValueError`` naming the flag."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise ValueError(f"{flag} must be cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag} must be cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {text}: no CUDA device on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def kv_flag_named(ns: argparse.Namespace, name: str) -> str:
    """The flag that chose the kv dtype ``name`` (a canonical name, as errors give it): the per-side flag(s) that
    asked for it, else ``--kv-cache-dtype``."""
    from ..cache.kv_dtypes import ALIASES  # torch-free, but not needed for --help

    chosen = {side: getattr(ns, f"kv_cache_dtype_{side}", None) for side in ("k", "v")}
    sides = [f"--kv-cache-dtype-{side}" for side, v in chosen.items() if v and ALIASES.get(v, v) == name]
    return " / ".join(sides) or "--kv-cache-dtype"


@contextmanager
def kv_flag_errors(ns: argparse.Namespace) -> Iterator[None]:
    """``load_model``'s ``ValueError`` about its ``kv_dtype`` argument, told with the flag that asked for the type
    (``--kv-cache-dtype-k fp8`` is named as that flag, not as ``--kv-cache-dtype``)."""
    try:
        yield
    except ValueError as e:
        text = str(e)
        if text.startswith("kv_dtype "):
            name = text.split()[1]
            raise ValueError(kv_flag_named(ns, name) + text[len("kv_dtype") :]) from None
        raise
