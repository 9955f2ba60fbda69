"""Llama-family decoders on gqa attention. ``ModelConfig`` is importable without torch (``gqa info`` reads configs
without it); the torch modules (``CausalLM``, ...) are imported on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .config import SUPPORTED_ARCHITECTURES, ModelConfig

if TYPE_CHECKING:
    from .llama import CausalLM, set_left_padding, use_input_major_weights

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelConfig", "set_left_padding", "use_input_major_weights"]

_FROM_LLAMA = ("CausalLM", "set_left_padding", "use_input_major_weights")


def __getattr__(name: str) -> Any:
    """``CausalLM``, ``set_left_padding``, ``use_input_major_weights``: imported from ``.llama`` on first use."""
    if name in _FROM_LLAMA:
        value = getattr(importlib.import_module(".llama", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
