"""The Llama-family model on real SmolLM2 weights and on tiny random HF models, against HF transformers."""

from __future__ import annotations

import os

import pytest
import torch

import gqa
from gqa.decoding.generate import generate
from gqa.decoding.sampling import sample_next

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Grouped-query attention shares each key/value head between",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def ours():
    return gqa.load_model(dtype=torch.float32)


@pytest.fixture(scope="module")
def hf(hf_smollm2):
    return hf_smollm2


def test_logits_match_hf_transformers_on_the_same_gguf(ours, hf):
    tok = ours.tokenizer
    worst = 0.0
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt)])
            diff = (ours(ids) - hf(ids).logits).abs().max().item()
            worst = max(worst, diff)
    # measured 2026-11-22: max |ours - HF| = 5.4e-05 over logits of magnitude ~20 (fp32, same dequantized weights)
    print(f"max abs logit difference vs HF: {worst:.3e}")
    assert worst < 1e-3, f"max abs logit difference {worst:.3e}"


def test_greedy_generation_matches_hf(ours, hf):
    tok = ours.tokenizer
    ids = tok.apply_chat("Name three colours.")
    mine = ours.generate(ids, max_new_tokens=32, eos_token_ids=[])
    with torch.inference_mode():
        theirs = hf.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=2)
    assert mine == theirs[0, len(ids) :].tolist(), (tok.decode(mine), tok.decode(theirs[0, len(ids) :].tolist()))


def test_cached_decoding_equals_full_forward(ours):
    ids = torch.tensor([ours.tokenizer.encode(PROMPTS[3])])
    with torch.inference_mode():
        full = ours(ids)
        caches = ours.new_caches(1, ids.shape[1])
        steps = [ours(ids[:, :4], caches=caches)]
        steps += [ours(ids[:, i : i + 1], caches=caches) for i in range(4, ids.shape[1])]
    # one-token steps run GEMVs, the full forward GEMMs: fp32 summation order differs; over 30 layers the logits
    # (magnitude ~20) drift by ~2e-4
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-3, rtol=1e-4)


def test_batched_generation_equals_per_row(ours):
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS[:3]]
    assert len({len(p) for p in prompts}) == 3  # different lengths: left padding is exercised
    batched = ours.generate(prompts, max_new_tokens=12, eos_token_ids=[])
    for prompt, row in zip(prompts, batched, strict=True):
        assert row == ours.generate(prompt, max_new_tokens=12, eos_token_ids=[])


def test_chat_answer_and_eos(ours):
    tok = ours.tokenizer
    out = ours.generate(tok.apply_chat("What is the capital of France? Answer in one word."), max_new_tokens=24)
    assert out[-1] in tok.eos_token_ids  # stopped at EOS, not at the limit
    assert "Paris" in tok.decode(out)


def test_sampling_is_seeded_and_top_k_1_is_greedy(ours):
    ids = ours.tokenizer.encode(PROMPTS[0])
    a = ours.generate(ids, max_new_tokens=8, temperature=0.9, top_p=0.9, seed=7, eos_token_ids=[])
    b = ours.generate(ids, max_new_tokens=8, temperature=0.9, top_p=0.9, seed=7, eos_token_ids=[])
    assert a == b
    greedy = ours.generate(ids, max_new_tokens=8, eos_token_ids=[])
    assert ours.generate(ids, max_new_tokens=8, temperature=1.5, top_k=1, seed=3, eos_token_ids=[]) == greedy


def test_sample_next_restricts_to_top_k_and_nucleus():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0, -1.0]]).expand(4000, 5)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, temperature=1.0, top_k=2, generator=g).tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # p0 = 0.70, p0 + p1 = 0.96
    top_p = sample_next(logits, temperature=1.0, top_p=0.9, generator=g)
    assert set(top_p.tolist()) == {0, 1}
    assert abs((top_p == 0).float().mean().item() - probs[0] / probs[:2].sum()) < 0.03
    with pytest.raises(ValueError, match="top_p must be in"):
        sample_next(logits, temperature=1.0, top_p=1.5)


def test_prompt_too_long_is_a_clear_error(ours):
    with pytest.raises(ValueError, match=r"exceeds the model's context of 8192 tokens"):
        ours.generate([1] * 8190, max_new_tokens=5)
    with pytest.raises(ValueError, match="at least one token"):
        ours.generate([[1, 2], []], max_new_tokens=5)
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, 49152\)"):
        ours(torch.tensor([[49152]]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_hf_models_load_and_match(tmp_path, arch):
    torch.manual_seed(0)
    cls, cfg_cls = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
    }[arch]
    config = cfg_cls(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=5000.0, tie_word_embeddings=arch == "llama",
        eos_token_id=3, bos_token_id=1,
    )  # fmt: skip
    ref = cls(config).eval()
    ref.save_pretrained(tmp_path, safe_serialization=True)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    assert model.config.arch == arch and model.config.num_kv_heads == 2
    ids = torch.randint(0, 96, (2, 9))
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-5, rtol=1e-5)
        expected = ref.generate(ids[:1], max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    assert generate(model, ids[0].tolist(), max_new_tokens=10, eos_token_ids=[]) == expected[0, 9:].tolist()


def test_bf16_model_runs_and_tracks_fp32(ours):
    model = gqa.load_model(dtype=torch.bfloat16, tokenizer=False)
    ids = torch.tensor([ours.tokenizer.encode(PROMPTS[0])])
    with torch.inference_mode():
        lo, hi = model(ids), ours(ids)
    assert lo.dtype == torch.bfloat16
    assert lo[0, -1].argmax() == hi[0, -1].argmax()
    assert (lo.float() - hi).abs().max() < 1.0


def test_input_major_weights_keep_values_names_and_ties():
    from gqa.models import CausalLM, ModelConfig, use_input_major_weights

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip
    model = CausalLM(cfg).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 50, (2, 7))
    logits = model(ids)
    use_input_major_weights(model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]) and before[k].shape == after[k].shape, k
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.shape == (32, 32) and q.stride() == (1, 32)  # (out, in) values in (in, out) memory
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model(ids), logits, atol=1e-5, rtol=1e-5)
    model.load_state_dict(before)  # loading still works into the new layout
    torch.testing.assert_close(model(ids), logits, atol=1e-5, rtol=1e-5)


def tiny_model(tied: bool = True, **kw):
    from gqa.models import CausalLM, ModelConfig

    torch.manual_seed(0)
    sizes = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2)
    cfg = ModelConfig(**sizes, head_dim=8, max_position_embeddings=64, tie_word_embeddings=tied, **kw)
    return CausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("input_major", [False, True])
def test_state_dict_saves_with_safetensors_save_file(tmp_path, tied, input_major):
    """``save_file(model.state_dict())`` works for the models ``gqa.load_model`` makes (tied embeddings, and the
    input-major float32 layout it uses where the native GEMV is not built) and loads back to the same logits."""
    from safetensors.torch import load_file, save_file

    from gqa.models import CausalLM, use_input_major_weights

    model = tiny_model(tied)
    if input_major:
        use_input_major_weights(model)
    ids = torch.randint(0, 50, (2, 7))
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    state = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in state) == (not tied)  # a tied head is the embeddings: stored once, as HF stores it
    back = CausalLM(model.config).eval()
    back.load_state_dict(state)
    assert (back.lm_head.weight is back.model.embed_tokens.weight) == tied
    torch.testing.assert_close(back(ids), model(ids), rtol=0, atol=0)


def test_the_default_quantized_models_state_dict_saves_and_loads_back(tmp_path):
    """``gqa.load_model()``'s default (the GGUF's blocks kept): its tied head holds the embeddings' blocks; the
    state dict stores them once (save_file refused the shared tensor) and ``load_state_dict`` restores both."""
    from safetensors.torch import load_file, save_file

    model = gqa.load_model()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    save_file(model.state_dict(), tmp_path / "model.safetensors")
    state = load_file(tmp_path / "model.safetensors")
    assert not [k for k in state if k.startswith("lm_head.")] and "model.embed_tokens.blocks" in state
    back = gqa.load_model()
    back.model.embed_tokens.blocks.zero_()  # (the head shares them)
    back.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(back(ids), model(ids), rtol=0, atol=0)


def test_generate_takes_tensor_prompts():
    model = tiny_model()
    ids = [3, 14, 15, 9, 2, 6]
    want = model.generate(ids, max_new_tokens=5, eos_token_ids=[])
    assert model.generate(torch.tensor(ids), max_new_tokens=5, eos_token_ids=[]) == want  # one prompt, one list
    batch = model.generate(torch.tensor([ids, ids]), max_new_tokens=5, eos_token_ids=[])  # (B, L): one list per row
    assert batch == [want, want]
    assert model.generate([torch.tensor(ids), ids[:3]], max_new_tokens=5, eos_token_ids=[])[0] == want
    with pytest.raises(TypeError, match="integer token ids"):
        model.generate(torch.tensor([1.0, 2.0]), max_new_tokens=2)
    with pytest.raises(ValueError, match="1-D"):
        model.generate(torch.ones(1, 2, 3, dtype=torch.long), max_new_tokens=2)


FULLGRAPH_SCRIPT = """
import torch
from torch._dynamo.testing import CompileCounter
from gqa.models import CausalLM, ModelConfig

torch.manual_seed(0)
cfg = ModelConfig(vocab_size=50, hidden_size=36, intermediate_size=48, num_layers=2, num_heads=9, num_kv_heads=3,
                  head_dim=4, max_position_embeddings=128)
model = CausalLM(cfg).eval().to({dtype})
counter = CompileCounter()
step = torch.compile(lambda ids, caches: model(ids, caches=caches), backend=counter, fullgraph=True)
ids = torch.randint(0, 50, (2, 40))
with torch.inference_mode():
    eager_caches, caches = model.new_caches(2, 48), model.new_caches(2, 48)
    eager = [model(ids, caches=eager_caches)] + [model(ids[:, i : i + 1], caches=eager_caches) for i in range(3)]
    compiled = [step(ids, caches)] + [step(ids[:, i : i + 1], caches) for i in range(3)]
for a, b in zip(eager, compiled):
    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
print("frames", counter.frame_count)
"""


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_compiled_prefill_and_decode_trace_as_one_graph(dtype):
    """A fresh process (the native kernels not loaded yet, as on a user's first call) compiles the model's prefill
    (SDPA-sized: 9 query heads x 40 tokens) and decode steps with ``fullgraph=True``: no graph break anywhere."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", FULLGRAPH_SCRIPT.format(dtype=dtype)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "frames 2" in proc.stdout  # one graph for the prefill shape, one for the decode shape


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_the_mlp_in_place_without_autograd_and_out_of_place_with_it_equal_the_formula(act):
    """``MLP`` takes the product in place into ``act(gate)`` when no gradient is wanted (a prompt's temporaries
    fewer): the same values as the plain formula, the input and the projections' outputs untouched (a forward hook
    holding them sees what the projection gave); with autograd, the formula's gradients."""
    from gqa.models.layers import MLP

    torch.manual_seed(0)
    mlp = MLP(12, 20, act).double()
    f = torch.nn.functional.silu if act == "silu" else (lambda t: torch.nn.functional.gelu(t, approximate="tanh"))
    wg, wu, wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight

    def formula(x):
        return (f(x @ wg.T) * (x @ wu.T)) @ wd.T

    x = torch.randn(2, 3, 12, dtype=torch.float64)
    kept = x.clone()
    held = []
    hooks = [
        m.register_forward_hook(lambda mod, i, out: held.append((out, out.clone())))
        for m in (mlp.gate_proj, mlp.up_proj)
    ]
    with torch.no_grad():
        want = formula(x)
        torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)
    for hook in hooks:
        hook.remove()
    assert len(held) == 2 and all(torch.equal(out, copy) for out, copy in held)
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)
    assert torch.equal(x, kept)
    x.requires_grad_()
    mlp(x).square().sum().backward()
    got = [x.grad, wg.grad, wu.grad, wd.grad]
    mlp.zero_grad()
    x.grad = None
    formula(x).square().sum().backward()
    for a, b in zip(got, [x.grad, wg.grad, wu.grad, wd.grad], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
