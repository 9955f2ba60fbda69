"""The dtype spellings every ``gqa`` command accepts: ``fp32``, ``bf16``, ``fp16``, or their long names ``float32``,
``bfloat16``, ``float16``, in any case. Flags store the short name; ``DTYPES`` maps it to the torch dtype."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALIASES: dict[str, str] = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
SPELLINGS = "fp32, bf16, fp16 (or float32, bfloat16, float16)"


def dtype_name(text: str) -> str:
    """The short name of a dtype spelling: ``"BFloat16"`` -> ``"bf16"``; ``ValueError`` for anything else."""
    name = text.strip().lower()
    name = ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {text!r}; choose from {SPELLINGS}")
    return name


def dtype_type(choices: Sequence[str] = tuple(DTYPES), keywords: Sequence[str] = ()) -> Callable[[str], str]:
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
    choices: Sequence[str] = tuple(DTYPES),
    keywords: Sequence[str] = (),
    **kwargs: Any,
) -> argparse.Action:
    """``parser.add_argument(flag, ...)`` taking any spelling of ``choices`` (plus ``keywords``) and storing the short
    name; ``--help`` lists the short names."""
    return parser.add_argument(flag, type=dtype_type(choices, keywords), choices=[*keywords, *choices], **kwargs)
