"""The GPU decode step with fused projections (``gqa.decoding.fused_step``), run on CPU tensors: its split-KV
attention through Triton's interpreter, eagerly and compiled by Inductor (CPU), against HF transformers' Llama,
Qwen2 and every other family gqa loads (Qwen3, Mistral, Gemma 2, Gemma 3, SmolLM3) on the same random weights,
decoding past their sliding windows.

As in ``tests/kernels/test_split_kv.py``, the interpreter must be switched on before triton is imported, so the
kernel tests run in a child process started with ``TRITON_INTERPRET=1`` (``test_fused_step_in_interpreter_process``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import gqa
from gqa.cache.kv_dtypes import KV_DTYPES
from gqa.cache.quantize import quantize
from gqa.decoding.fused_step import fused_applies, fused_step, step_weights
from gqa.models import CausalLM
from gqa.models.config import ModelConfig
from tests.helpers.families import FAMILIES, family_model
from tests.helpers.interpreter import interpreting, run_interpreted

transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the split-KV kernel cannot run", allow_module_level=True)

INTERPRETED = interpreting()
CHILD = "GQA_TEST_FUSED_STEP_CHILD"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy in the interpreter: -inf - -inf


@pytest.mark.skipif(bool(os.environ.get(CHILD)), reason="the child process itself")
def test_fused_step_in_interpreter_process():
    run_interpreted(__file__, CHILD, min_passed=6)


def _models(arch: str):
    """HF's model and ours on the same random weights, float32: 2 layers, 6 query heads over 2 KV heads (D=16)."""
    common = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, vocab_size=300, rope_theta=10000.0, max_position_embeddings=256,
                  rms_norm_eps=1e-5, tie_word_embeddings=arch == "qwen2", bos_token_id=1, eos_token_id=2)  # fmt: skip
    config_cls = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
    model_cls = transformers.Qwen2ForCausalLM if arch == "qwen2" else transformers.LlamaForCausalLM
    torch.manual_seed(0)
    hf = model_cls(config_cls(**common, attn_implementation="eager")).eval()
    cfg = ModelConfig.from_hf(hf.config.to_dict() | {"model_type": arch})
    return hf, CausalLM.from_state(cfg, hf.state_dict()).eval()


def _hf_logits(hf, rows: list[list[int]]) -> list[torch.Tensor]:
    """Each row alone through HF (no padding): logits ``(len, vocab)``."""
    return [hf(torch.tensor([r])).logits[0] for r in rows]


def _run_steps(
    step, model, rows: list[list[int]], prompt_lens: list[int], steps: int, static=False, kv_dtype=None
) -> torch.Tensor:
    """Prefill each row's prompt (left-padded) with the eager model, then ``steps`` tokens through ``step``; the
    logits of each step ``(B, steps, vocab)``. ``static``: full caches for windowed layers too (what the graphed
    step decodes over); ``kv_dtype``: what the caches store."""
    width = max(prompt_lens)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (r, n) in enumerate(zip(rows, prompt_lens, strict=True)):
        ids[b, width - n :] = torch.tensor(r[:n])
    caches = model.new_caches(len(rows), width + steps + 5, window_caches=not static, kv_dtype=kv_dtype)
    for cache in caches:
        cache.set_left_padding([width - n for n in prompt_lens])
    model(ids, caches=caches, last_only=True)
    out = []
    for i in range(steps):
        tokens = torch.tensor([[r[n + i]] for r, n in zip(rows, prompt_lens, strict=True)])
        out.append(step(tokens, caches)[:, -1])
    return torch.stack(out, dim=1)


@needs_interpreter
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases (fused into one), tied embeddings
@torch.inference_mode()
def test_fused_step_matches_hf_on_ragged_rows(arch):
    hf, model = _models(arch)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 300, (12,), generator=g).tolist() for _ in range(3)]
    prompt_lens, steps = [9, 5, 7], 3
    weights = step_weights(model)
    ours = _run_steps(lambda t, c: fused_step(model, weights, t, c), model, rows, prompt_lens, steps)
    for b, ref in enumerate(_hf_logits(hf, rows)):
        want = ref[prompt_lens[b] : prompt_lens[b] + steps]
        torch.testing.assert_close(ours[b], want, atol=2e-4, rtol=2e-4)


@needs_interpreter
@pytest.mark.parametrize("arch", FAMILIES)
@torch.inference_mode()
def test_fused_step_takes_every_family_past_its_window(tmp_path, arch):
    """q/k norms, NoPE layers, Gemma 3's local RoPE table, windows of 5 keys (the static cache read from the
    window's first key on), Gemma 2's attention and final soft-caps, Gemma's sandwich norms and scaled embeddings:
    the fused step's logits are transformers' for 8 steps past 9- and 5-token prompts."""
    hf = family_model(arch, tmp_path)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    assert fused_applies(model) is None
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 96, (17,), generator=g).tolist() for _ in range(2)]
    prompt_lens, steps = [9, 5], 8
    weights = step_weights(model)
    ours = _run_steps(lambda t, c: fused_step(model, weights, t, c), model, rows, prompt_lens, steps, static=True)
    for b, ref in enumerate(_hf_logits(hf, rows)):
        torch.testing.assert_close(ours[b], ref[prompt_lens[b] : prompt_lens[b] + steps], atol=2e-4, rtol=2e-4)


@needs_interpreter
@pytest.mark.parametrize("arch, kv", [("qwen2", ("q8_0", "q4_0")), ("gemma2", "q8_0")])
@torch.inference_mode()
def test_fused_step_over_quantized_caches_equals_the_eager_model(tmp_path, arch, kv):
    """Static caches of q8_0 / q4_0 blocks: the fused step quantizes each new row as it writes it and the split-KV
    kernel reads the blocks (Gemma 2: windows and soft-caps too); the eager model over the same kind of caches
    (the native CPU attention over the blocks, another implementation) gives the same logits."""
    family_model(arch, tmp_path, head_dim=32)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(3, 96, (16,), generator=g).tolist() for _ in range(2)]
    weights = step_weights(model)
    fused = _run_steps(lambda t, c: fused_step(model, weights, t, c), model, rows, [9, 5], 7, True, kv)
    eager = _run_steps(lambda t, c: model(t, caches=c), model, rows, [9, 5], 7, True, kv)
    torch.testing.assert_close(fused, eager, atol=2e-4, rtol=2e-4)


@needs_interpreter
@torch.inference_mode()
def test_static_step_over_quantized_caches_equals_the_eager_model(tmp_path):
    """``cuda_graphs.static_step`` (what the graph captures for Llama layers the fused step does not take): q4_0 K,
    q8_0 V written as blocks and read by the split-KV kernel, the eager model's logits."""
    from gqa.decoding.cuda_graphs import static_step

    family_model("llama", tmp_path, head_dim=32)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    model.model.rope.cos_sin(torch.tensor([63]))  # the table static_step looks positions up in
    rows = [torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(8)).tolist() for _ in range(2)]
    kv = ("q4_0", "q8_0")
    ours = _run_steps(lambda t, c: static_step(model, t, c), model, rows, [7, 4], 5, True, kv)
    torch.testing.assert_close(ours, _run_steps(lambda t, c: model(t, caches=c), model, rows, [7, 4], 5, True, kv),
                               atol=2e-4, rtol=2e-4)  # fmt: skip


@needs_interpreter
@torch.inference_mode()
def test_compiled_fused_step_matches_hf():
    """The step as ``torch.compile`` (Inductor) sees it, one graph (``fullgraph``): the attention kernel an opaque
    custom op, the rest fused; what ``GraphedDecoder(compile=True)`` captures on a GPU."""
    hf, model = _models("llama")
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, 300, (10,), generator=g).tolist() for _ in range(2)]
    weights = step_weights(model)
    compiled = torch.compile(fused_step, dynamic=False, fullgraph=True)
    ours = _run_steps(lambda t, c: compiled(model, weights, t, c), model, rows, [6, 6], 3)
    for b, ref in enumerate(_hf_logits(hf, rows)):
        torch.testing.assert_close(ours[b], ref[6:9], atol=2e-4, rtol=2e-4)


@torch.no_grad()
def test_step_weights_are_made_once_and_again_after_a_weight_changes():
    _, model = _models("qwen2")
    first = step_weights(model)
    assert step_weights(model) is first
    attn = model.model.layers[1].self_attn
    n_q = attn.q_proj.out_features
    torch.testing.assert_close(first.layers[1].qkv[n_q : n_q + attn.k_proj.out_features], attn.k_proj.weight)
    attn.k_proj.weight.add_(1.0)  # in place: the version counter moves
    again = step_weights(model)
    assert again is not first
    torch.testing.assert_close(again.layers[1].qkv[n_q : n_q + attn.k_proj.out_features], attn.k_proj.weight)
    torch.testing.assert_close(again.layers[1].qkv_bias[:n_q], attn.q_proj.bias)


def test_fused_step_refuses_hooked_projections():
    _, model = _models("llama")
    assert fused_applies(model) is None
    handle = model.model.layers[0].mlp.up_proj.register_forward_hook(lambda *args: None)
    assert "nn.Linear" in fused_applies(model)
    with pytest.raises(ValueError, match="fused decode step does not apply"):
        step_weights(model)
    handle.remove()


@needs_interpreter
@torch.inference_mode()
def test_compiled_fused_step_takes_a_gemma2(tmp_path):
    """The compiled step (one graph) on Gemma 2's layers: windows, both soft-caps, the sandwich, GELU."""
    hf = family_model("gemma2", tmp_path)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    rows = [torch.randint(3, 96, (16,), generator=torch.Generator().manual_seed(6)).tolist() for _ in range(2)]
    weights = step_weights(model)
    compiled = torch.compile(fused_step, dynamic=False, fullgraph=True)
    ours = _run_steps(lambda t, c: compiled(model, weights, t, c), model, rows, [8, 8], 6, static=True)
    for b, ref in enumerate(_hf_logits(hf, rows)):
        torch.testing.assert_close(ours[b], ref[8:14], atol=2e-4, rtol=2e-4)


@needs_interpreter
def test_the_split_kv_custom_op_passes_opcheck():
    """``gqa_triton::split_kv_decode``, the kernel as the compiler sees it: schema, fake kernel, dynamic shapes."""
    from gqa.kernels.triton.split_kv import decode_op

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 6, 1, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g), torch.randn(2, 2, 40, 16)
    results = torch.library.opcheck(decode_op, (q, k, v, torch.tensor([0, 3]), torch.tensor(30), 0.25))
    assert set(results.values()) == {"SUCCESS"}, results
    variant = (q, k, v, torch.tensor([0, 3]), torch.tensor(30), 0.25, 7, 3.0, torch.randn(6, generator=g))
    results = torch.library.opcheck(decode_op, variant)
    assert set(results.values()) == {"SUCCESS"}, results
    q = torch.randn(2, 6, 1, 64, generator=g)  # a quantized cache: q8_0 K, q4_0 V, blocks of 64 values a row
    k, v = (quantize(torch.randn(2, 2, 40, 64, generator=g), KV_DTYPES[n]) for n in ("q8_0", "q4_0"))
    quantized = (q, k, v, torch.tensor([0, 3]), torch.tensor(30), 0.25, -1, 0.0, None, 0, 1)
    results = torch.library.opcheck(decode_op, quantized)
    assert set(results.values()) == {"SUCCESS"}, results
