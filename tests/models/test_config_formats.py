"""Every family's ``config.json`` as transformers 5 writes it (``rope_parameters``: the RoPE base and scaling in one
dict, Gemma 3's in one per layer type) and as transformers 4 wrote the same config (``rope_theta``,
``rope_scaling``, Gemma 3's ``rope_local_base_freq``): both load to the same ``ModelConfig``, with the file's RoPE
base rather than the family's default, and give the logits of transformers' own model read from either file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import gqa
from tests.helpers.families import FAMILIES, family_model

transformers = pytest.importorskip("transformers")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # fmt: skip
# RoPE bases other than each family's default (10^4; SmolLM3 2 * 10^6; Gemma 3 10^6 and 10^4 on sliding layers), so
# that a default read in the file's place changes the logits; Llama's scaled as Llama 3.1 is, Gemma 3's linearly
ROPE = {
    "llama": {"rope_parameters": {"rope_theta": 31000.0, **LLAMA3}},
    "qwen2": {"rope_parameters": {"rope_theta": 31000.0, "rope_type": "default"}},
    "qwen3": {"rope_parameters": {"rope_theta": 31000.0, "rope_type": "default"}},
    "mistral": {"rope_parameters": {"rope_theta": 31000.0, "rope_type": "default"}},
    "gemma2": {"rope_parameters": {"rope_theta": 31000.0, "rope_type": "default"}},
    "smollm3": {"rope_parameters": {"rope_theta": 31000.0, "rope_type": "default"}},
    "gemma3_text": {"rope_theta": 31000.0, "rope_local_base_freq": 700.0},  # beside the helper's linear scaling
}
LOCAL_THETA = {"gemma3_text": 700.0}


def transformers4_form(cfg: dict) -> dict:
    """``cfg`` (a ``config.json`` transformers 5 wrote) as transformers 4 wrote the same config."""
    cfg = dict(cfg)
    rope = cfg.pop("rope_parameters")
    if "full_attention" in rope:  # Gemma 3: the global RoPE's keys at the top, the sliding layers' base beside them
        full = dict(rope["full_attention"])
        cfg["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
        cfg["sliding_window_pattern"] = cfg.pop("_sliding_window_pattern")
    else:
        full = dict(rope)
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_scaling"] = None if full.get("rope_type") == "default" else full
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    return cfg | {"transformers_version": "4.57.1"}


@pytest.mark.parametrize("arch", ["llama", "qwen2", *FAMILIES])
def test_both_transformers_config_formats_load_alike_and_match_transformers(tmp_path, arch):
    family_model(arch, tmp_path / "v5", **ROPE[arch])
    written = json.loads((tmp_path / "v5" / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written  # transformers 5's form
    shutil.copytree(tmp_path / "v5", tmp_path / "v4")
    (tmp_path / "v4" / "config.json").write_text(json.dumps(transformers4_form(written)))

    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))  # past Llama 3's 16 positions
    configs = []
    for form in ("v5", "v4"):
        model = gqa.load_model(tmp_path / form, tokenizer=False, dtype=torch.float32)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / form, attn_implementation="eager")
        with torch.no_grad():
            torch.testing.assert_close(model(ids), theirs.eval()(ids).logits, atol=1e-4, rtol=1e-4)
        configs.append(model.config)
    assert configs[0] == configs[1]
    cfg = configs[0]
    assert cfg.rope_theta == 31000.0 and cfg.rope_local_theta == LOCAL_THETA.get(arch)
    scaling = {"llama": LLAMA3, "gemma3_text": {"rope_type": "linear", "factor": 2.0}}.get(arch)
    assert cfg.rope_scaling == scaling


SIZES = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=4)  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2", *FAMILIES])
def test_a_config_without_rope_keys_takes_transformers_default_base(arch):
    hf = transformers.AutoConfig.for_model(arch, **SIZES).rope_parameters
    full, local = (hf["full_attention"], hf["sliding_attention"]) if "full_attention" in hf else (hf, None)
    cfg = gqa.models.ModelConfig.from_hf({"model_type": arch, **SIZES})
    assert cfg.rope_theta == full["rope_theta"] and cfg.rope_scaling is None
    assert cfg.rope_local_theta == (local and local["rope_theta"])


def test_the_older_type_key_names_the_scaling_as_transformers_reads_it():
    raw = {"model_type": "llama", **SIZES, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    hf = transformers.LlamaConfig.from_dict(raw).rope_parameters
    cfg = gqa.models.ModelConfig.from_hf(raw)
    assert (cfg.rope_theta, cfg.rope_scaling) == (hf["rope_theta"], {"rope_type": hf["rope_type"], "factor": 2.0})


@pytest.mark.parametrize(
    ("arch", "rope", "match"),
    [
        ("llama", {"rope_theta": 1e4, "rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("qwen3", {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e3}}, "per layer"),
        ("gemma3_text", {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}, "sliding layers"),
        ("llama", [1e4], "rope_parameters"),
    ],
)
def test_rope_parameters_this_model_lacks_are_refused(arch, rope, match):
    with pytest.raises(ValueError, match=match):
        gqa.models.ModelConfig.from_hf({"model_type": arch, **SIZES, "rope_parameters": rope})
