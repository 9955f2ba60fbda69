"""Llama-family decoders on gqa attention. ``ModelConfig`` is importable without torch (``gqa info`` reads configs
without it); the torch modules (``CausalLM``, ...) are imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names
from .config import SUPPORTED_ARCHITECTURES, ModelConfig

if TYPE_CHECKING:
    from .llama import CausalLM, set_left_padding, use_input_major_weights

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelConfig", "set_left_padding", "use_input_major_weights"]

__getattr__ = lazy_names(__name__, dict.fromkeys(("CausalLM", "set_left_padding", "use_input_major_weights"), "llama"))


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
