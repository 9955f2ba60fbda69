"""An HF Llama checkpoint with ``attention_bias=True`` (transformers then gives ``o_proj`` a bias as well as q/k/v):
loaded, run and decoded as transformers runs it; a Qwen2 config never has one; the HF config written back says so."""

from __future__ import annotations

import pytest
import torch

import gqa
from gqa.models.config import ModelConfig

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=120, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, attention_bias=True, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # biases are zero at init: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("llama-attention-bias")
    model.save_pretrained(path)
    return path, model


def test_config_reads_the_o_proj_bias():
    llama = ModelConfig.from_hf(transformers.LlamaConfig(attention_bias=True).to_dict())
    assert llama.attention_bias and llama.output_bias
    assert ModelConfig.from_hf(transformers.LlamaConfig().to_dict()).output_bias is False
    qwen = ModelConfig.from_hf(transformers.Qwen2Config().to_dict())
    assert qwen.attention_bias and not qwen.output_bias
    assert llama.to_hf()["attention_bias"] is True
    with pytest.raises(ValueError, match="one attention_bias for q/k/v and o_proj"):
        ModelConfig(attention_bias=True, output_bias=False).to_hf()


@torch.inference_mode()
def test_logits_and_greedy_decode_match_transformers(checkpoint):
    path, hf = checkpoint
    model = gqa.load_model(path, dtype=torch.float32, tokenizer=False)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    ids = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)
    prompt = ids[0].tolist()
    ours = model.generate(prompt, max_new_tokens=6, eos_token_ids=[])  # through the decode step, cache and all
    ref = hf.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)[0, 9:]
    assert ours == ref.tolist()
