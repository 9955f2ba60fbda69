"""Shared by the serving tests: a tiny HF Qwen2 saved to a folder, serving prompts to completion, HF's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import torch


def tiny_qwen2(path: Path):
    """A 2-layer Qwen2 (H_q=6, H_kv=2, head_dim 16, q/k/v biases, untied) saved by HF to ``path``; HF's own model."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=160, hidden_size=72, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=5000.0, eos_token_id=3,
        bos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    ref = transformers.Qwen2ForCausalLM(config).eval()
    ref.save_pretrained(path, safe_serialization=True)
    return ref


def serve_all(engine, prompts, params) -> list[list[int]]:
    """Serve every prompt to completion on ``engine`` (a ``gqa.serve.engine.Engine``); each request's tokens."""
    ids = [engine.add(p, params).request_id for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(10_000):
        if not engine.has_work:
            break
        for o in engine.step():
            out[o.request_id] += o.token_ids
    assert not engine.has_work
    return [out[i] for i in ids]


def hf_greedy(ref, prompt: list[int], n: int) -> list[int]:
    """HF's greedy continuation of ``prompt``: ``n`` tokens, EOS ignored."""
    with torch.no_grad():
        ids = ref.generate(torch.tensor([prompt], device=ref.device), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)  # fmt: skip
    return ids[0, len(prompt) :].tolist()
