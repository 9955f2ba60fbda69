"""The dtype spellings every ``gqa`` command accepts: ``fp32``, ``bf16``, ``fp16``, or their long names ``float32``,
``bfloat16``, ``float16``, in any case. Flags store the short name; ``torch_dtype`` (or ``DTYPES``) maps it to the
torch dtype when a command runs, so that the parser is built, and ``--help`` shown, without importing torch."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # short name -> torch's name
ALIASES: dict[str, str] = {long: short for short, long in NAMES.items()}
SPELLINGS = "fp32, bf16, fp16 (or float32, bfloat16, float16)"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a short name (``"bf16"`` -> ``torch.bfloat16``); imports torch."""
    import torch

    return getattr(torch, NAMES[name])


def __getattr__(name: str) -> Any:
    """``DTYPES``, short name -> torch dtype, made on first use (it imports torch)."""
    if name == "DTYPES":
        dtypes = {short: torch_dtype(short) for short in NAMES}
        globals()["DTYPES"] = dtypes
        return dtypes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(text: str) -> str:
    """The short name of a dtype spelling: ``"BFloat16"`` -> ``"bf16"``; ``ValueError`` for anything else."""
    name = text.strip().lower()
    name = ALIASES.get(name, name)
    if name not in NAMES:
        raise ValueError(f"unknown dtype {text!r}; choose from {SPELLINGS}")
    return name


def dtype_type(choices: Sequence[str] = tuple(NAMES), keywords: Sequence[str] = ()) -> Callable[[str], str]:
    """An argparse ``type``: a dtype spelling -> its short name, which must be one of ``choices``; each of
    ``keywords`` (e.g. ``"auto"``) is accepted as itself."""

    def dtype(text: str) -> str:
        if text.strip().lower() in keywords:
            return text.strip().lower()
        try:
            name = dtype_name(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if name not in choices:
            allowed = ", ".join([*keywords, *choices])
            raise argparse.ArgumentTypeError(f"dtype {text!r} is not supported here; choose from {allowed}")
        return name

    return dtype


def add_dtype_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str = "--dtype",
    *,
    choices: Sequence[str] = tuple(NAMES),
    keywords: Sequence[str] = (),
    **kwargs: Any,
) -> argparse.Action:
    """``parser.add_argument(flag, ...)`` taking any spelling of ``choices`` (plus ``keywords``) and storing the short
    name; ``--help`` lists the short names."""
    return parser.add_argument(flag, type=dtype_type(choices, keywords), choices=[*keywords, *choices], **kwargs)
