"""Sizes read from a file (``config.json``, GGUF metadata) or given to ``ModelConfig``, checked before anything
divides by them: a zero, negative, fractional or non-numeric count is a ``ValueError`` naming its key."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def positive_int(value: Any, name: str) -> int:
    """``value`` as an int when it is a whole number >= 1 (``4``, ``4.0``, a numpy integer; not ``True``), else
    ``ValueError`` naming ``name``."""
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            number = int(value) if isinstance(value, float) and value.is_integer() else None
        if number is not None and number >= 1:
            return number
    raise ValueError(f"{name} must be a positive integer, got {value!r}")


def positive_float(value: Any, name: str) -> float:
    """``value`` as a float when it is a finite number > 0, else ``ValueError`` naming ``name``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def derived_head_dim(hidden: int, heads: int, hidden_key: str, heads_key: str) -> int:
    """The head dimension of a file that gives none: ``hidden // heads``, which must divide evenly (transformers 5
    refuses such a config too)."""
    if hidden % heads:
        raise ValueError(f"{hidden_key} ({hidden}) must be divisible by {heads_key} ({heads}) without a head size")
    return hidden // heads


def or_none(check: Callable[[Any, str], T], value: Any, name: str) -> T | None:
    """``check(value, name)`` (``positive_int``, ``positive_float``), or None where ``value`` is None (JSON null)."""
    return None if value is None else check(value, name)
