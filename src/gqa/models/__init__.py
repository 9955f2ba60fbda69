"""Llama-family decoders on gqa attention."""

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import CausalLM, set_left_padding, use_input_major_weights

__all__ = ["SUPPORTED_ARCHITECTURES", "CausalLM", "ModelConfig", "set_left_padding", "use_input_major_weights"]
