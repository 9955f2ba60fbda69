"""Deprecated alias of ``gqa.integrations.hf`` (where the HF transformers integration moved), kept for one release:
importing it, and each name read from it, warns with a ``DeprecationWarning``; the names are the new module's own
objects."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

__all__ = ["gqa_attention_forward", "register"]  # noqa: F822 (what gqa.hf exported; __getattr__ serves them)

_MOVED = "gqa.hf moved to gqa.integrations.hf; import it from there (the old name goes in the next release)"


def _warn(stacklevel: int) -> None:
    warnings.warn(_MOVED, DeprecationWarning, stacklevel=stacklevel + 1)


def __getattr__(name: str) -> Any:
    """A name of ``gqa.integrations.hf``, with the warning (transformers is imported only by ``register()``)."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("gqa.integrations.hf"), name)
    _warn(2)
    return value


_warn(2)
