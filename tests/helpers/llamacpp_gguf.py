"""Write a transformers model as GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does, for the families beyond
Llama/Qwen2 (``gemma2``, ``gemma3``, ``smollm3``, ``qwen3``), independently of gqa's reader: tensor names from the
``gguf`` package's own ``TensorNameMap``, metadata through ``GGUFWriter``'s ``add_*`` calls the converter makes, and
its tensor edits — Gemma's norm weights stored plus one, llama/smollm3 q/k rows permuted for interleaved RoPE, Gemma's
tied ``lm_head`` not written.

What llama.cpp does not read from the file (and so the model must agree with): Gemma 2 layers alternate sliding and
global, Gemma 3 has five sliding layers to one global and a local RoPE base of 10,000, SmolLM3 skips RoPE on every
fourth layer, and (but for the 27B sizes) Gemma's scores scale by ``head_dim ** -0.5``.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from .k_quants import quantize

GGUF_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3", "smollm3": "smollm3", "qwen3": "qwen3"}


def _permute(x: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: per head, rows (2, D/2) -> (D/2, 2)."""
    return x.reshape(n_heads, 2, x.shape[0] // n_heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def write_family_gguf(path: Path, model: torch.nn.Module, qtype=lambda name: gguf.GGMLQuantizationType.F32) -> Path:
    """``model`` (a transformers causal LM of a family in ``GGUF_ARCH``) as the GGUF file ``path``; ``qtype(hf_name)``
    picks each 2-D weight's type (1-D tensors, and rows not a whole number of blocks, are F32 as the converter keeps
    them)."""
    c = model.config
    arch = GGUF_ARCH[c.model_type]
    gemma = arch.startswith("gemma")
    arch_enum = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(arch_enum, c.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if gemma or arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
    rope = getattr(c, "rope_parameters", None) or {}  # transformers 5: per layer type where they differ
    full = rope.get("full_attention", rope)
    theta = getattr(c, "rope_theta", None) or full.get("rope_theta")
    if arch != "gemma2":  # the Gemma 2 converter writes no base (llama.cpp's default, 10,000, is HF's)
        w.add_rope_freq_base(float(theta))
    if gemma:
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma3" and full.get("rope_type") == "linear":  # the global layers' scaling
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    # a sentencepiece vocabulary of placeholder pieces: the reader takes the vocabulary size from its length
    w.add_tokenizer_model("llama" if gemma else "gpt2")
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id if isinstance(c.eos_token_id, int) else c.eos_token_id[0])
    state = model.state_dict()
    for name, t in state.items():
        if name == "lm_head.weight" and (gemma or c.tie_word_embeddings):
            continue
        x = t.detach().float().numpy()
        if gemma and name.endswith("norm.weight"):
            x = x + 1
        if arch == "smollm3" and ".q_proj." in name:
            x = _permute(x, c.num_attention_heads)
        elif arch == "smollm3" and ".k_proj." in name:
            x = _permute(x, c.num_key_value_heads)
        kind = qtype(name) if x.ndim == 2 else gguf.GGMLQuantizationType.F32
        if x.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0]:  # rows that do not fill whole blocks stay float, as there
            kind = gguf.GGMLQuantizationType.F32
        target = names.get_name(name.removesuffix(".weight").removesuffix(".bias"))
        assert target is not None, name
        target += ".weight" if name.endswith(".weight") else ".bias"
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(target, x)
        else:
            w.add_tensor(target, quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
