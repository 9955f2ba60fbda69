"""Small random transformers models of the families gqa loads beside Llama/Qwen2 (Qwen3, Mistral, Gemma 2, Gemma 3
text, SmolLM3), each with what makes it differ turned up: windows shorter than the test sequences, soft-caps low
enough to bend the scores, a scale other than head_dim's, norms and weights far from their defaults."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")


FAMILIES = ["qwen3", "mistral", "gemma2", "gemma3_text", "smollm3"]
GEMMA = dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=12)  # a scale other than head_dim's


def family_model(arch: str, path, context: int = 128, **extra):
    """A random transformers model of ``arch`` (``FAMILIES``, or plain ``llama`` / ``qwen2``) saved in ``path``;
    ``extra`` overrides its config's keys."""
    torch.manual_seed(0)
    kw = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=context, rms_norm_eps=1e-6, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False, attn_implementation="eager")  # fmt: skip
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw | extra))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw | extra))
    elif arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kw | dict(head_dim=16) | extra))
    elif arch == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**kw | dict(sliding_window=5) | extra))
    elif arch == "gemma2":  # soft-caps low enough to bend these scores; sliding and global layers alternate
        kw |= dict(num_hidden_layers=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**kw | GEMMA | extra))
    elif arch == "smollm3":  # layers 1 and 3 without RoPE (NoPE)
        kw |= dict(num_hidden_layers=4, no_rope_layer_interval=2, pad_token_id=0)
        model = transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(**kw | extra))
    else:  # two sliding layers, then a global one whose RoPE is scaled
        kw |= dict(num_hidden_layers=3, sliding_window_pattern=3, rope_scaling={"rope_type": "linear", "factor": 2.0})
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kw | GEMMA | extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.3)
            else:  # Gemma's norms scale by 1 + weight
                p.uniform_(-0.5, 0.5) if arch.startswith("gemma") else p.uniform_(0.5, 1.5)
    model.eval().save_pretrained(path, safe_serialization=True)
    return model
