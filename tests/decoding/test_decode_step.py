"""The native one-token decode step (``gqa.decoding.native_step``), the path ``model.generate`` takes on CPU, against
HF transformers models built from small random configs: logits at every decoded position, left-padded batches,
float32 and bfloat16, quantized weights; and the cases it must leave to the eager path."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from helpers.step_weights import random_layers

import gqa
from gqa import kernels
from gqa.decoding import native_step as decode_step

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls that went through ``decode_step.decode_step`` (so a test knows the fast path ran)."""
    calls = []
    real = decode_step.decode_step

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_step, "decode_step", spy)
    return calls


def hf_model(tmp_path, arch: str, heads: int, kv_heads: int, head_dim: int):
    cls, cfg_cls = {
        "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
        "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config),
    }[arch]
    torch.manual_seed(0)
    hidden = 72 if heads % 3 == 0 else 64  # HF wants heads | hidden (head_dim is its own)
    config = cfg_cls(
        vocab_size=128, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=128, rope_theta=5000.0,
        tie_word_embeddings=arch == "llama", eos_token_id=3, bos_token_id=1,
    )  # fmt: skip
    ref = cls(config).eval()
    if arch == "qwen3":  # q/k norms away from their ones
        with torch.no_grad():
            for name, p in ref.named_parameters():
                if "q_norm" in name or "k_norm" in name:
                    p.uniform_(0.5, 1.5)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    return ref


def decode_logits(model, prompts: list[list[int]], steps: list[list[int]]) -> list[torch.Tensor]:
    """Prefill left-padded ``prompts``, then feed ``steps[i]`` (one token per row) through the step ``generate``
    takes (``select_step``) and collect each step's logits."""
    from gqa.decoding.generate import _left_pad
    from gqa.decoding.steps import select_step

    ids, pads = _left_pad(prompts, 0, torch.device("cpu"))
    caches = model.new_caches(len(prompts), ids.shape[1] + len(steps))
    gqa.models.set_left_padding(caches, pads)
    out = []
    with torch.inference_mode():
        model(ids, caches=caches, last_only=True)
        decode = select_step(model, caches)
        for step in steps:
            out.append(decode(torch.tensor(step)[:, None], caches)[:, 0])  # (B, vocab)
    return out


def hf_logits(ref, prompts: list[list[int]], steps: list[list[int]]) -> list[torch.Tensor]:
    """HF's logits for the same tokens: each row's real tokens alone, whole sequence, no cache."""
    out = []
    with torch.inference_mode():
        for i in range(len(steps)):
            rows = [
                ref(torch.tensor([p + [s[r] for s in steps[: i + 1]]])).logits[0, -1] for r, p in enumerate(prompts)
            ]
            out.append(torch.stack(rows))
    return out


@pytest.mark.parametrize(
    ("arch", "heads", "kv_heads", "head_dim"),
    [("llama", 6, 2, 10), ("qwen2", 18, 6, 4), ("llama", 4, 4, 16), ("qwen2", 4, 1, 32)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoded_logits_match_hf_with_left_padding(tmp_path, counted, arch, heads, kv_heads, head_dim, dtype):
    ref = hf_model(tmp_path, arch, heads, kv_heads, head_dim)
    model = gqa.load_model(tmp_path, dtype=dtype, tokenizer=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 128, (n,), generator=g).tolist() for n in (3, 7, 1)]
    steps = [torch.randint(4, 128, (3,), generator=g).tolist() for _ in range(5)]
    ours = decode_logits(model, prompts, steps)
    assert len(counted) == 5 and all(shape == (3, 1) for shape in counted)  # every step took the native path
    theirs = hf_logits(ref, prompts, steps)
    tol = 2e-4 if dtype == torch.float32 else 6e-2  # bf16: activations rounded to 8 bits per layer
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.float(), b, atol=tol, rtol=tol)


@pytest.mark.parametrize("quantized", [False, True])
def test_a_large_ragged_batch_decodes_natively_and_matches_hf(tmp_path, counted, quantized):
    """37 rows (more than a GEMV tile's 4, not a multiple of it) of prompts of 1-9 tokens: every step native, each
    row's logits as HF computes that row alone (quantized: as the float64 model on the dequantized weights)."""
    ref = hf_model(tmp_path, "qwen2", 18, 6, 4)
    model = gqa.load_model(tmp_path, dtype=torch.float32, tokenizer=False)
    if quantized:
        from gqa.models.quantized import quantize_model

        quantize_model(model, "q8_0")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 128, (1 + i % 9,), generator=g).tolist() for i in range(37)]
    steps = [torch.randint(4, 128, (37,), generator=g).tolist() for _ in range(3)]
    ours = decode_logits(model, prompts, steps)
    assert counted == [(37, 1)] * 3
    if quantized:
        ref = gqa.load_model(tmp_path, dtype=torch.float64, tokenizer=False)
        ref.load_state_dict(dequantized_state(model), strict=False)
        for a, b in zip(ours, decode_logits(ref, prompts, steps), strict=True):
            assert (a.double() - b).abs().max() < 0.02 * b.abs().max()
        return
    for a, b in zip(ours, hf_logits(ref, prompts, steps), strict=True):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


def test_native_step_equals_the_eager_step(tmp_path, monkeypatch):
    """Both paths round where the other does: float32 results agree to float32 precision, bf16 up to the order of
    float32 sums."""
    hf_model(tmp_path, "qwen2", 6, 2, 16)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        model = gqa.load_model(tmp_path, dtype=dtype, tokenizer=False)
        prompts, steps = [[5, 6, 7, 8], [9, 10]], [[11, 12], [13, 14], [15, 16]]
        fast = decode_logits(model, prompts, steps)
        with monkeypatch.context() as m:
            m.setattr(decode_step, "applies", lambda *a: False)
            eager = decode_logits(model, prompts, steps)
        for a, b in zip(fast, eager, strict=True):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("quantized", [None, "q4_1", "q5_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_per_step_equals_a_call_per_layer(tmp_path, monkeypatch, dtype, quantized, arch):
    """``gqa::decode_model`` (every layer, the final norm and lm_head in one native call) runs the per-layer ops in
    the same order: the same bits as a ``gqa::decode_layer`` call per layer from Python (Qwen3: the q/k norms inside
    the call, against ``rms_norm`` calls between the per-layer ops)."""
    from gqa.models.quantized import quantize_model

    hf_model(tmp_path, arch, 6, 2, 10)
    model = gqa.load_model(tmp_path, dtype=dtype, tokenizer=False)
    if quantized:
        quantize_model(model, quantized)
    calls = []
    real = decode_step.ops.decode_model

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    prompts, steps = [[5, 6, 7, 8], [9]], [[11, 12], [13, 14], [15, 16]]
    with monkeypatch.context() as m:
        m.setattr(decode_step.ops, "decode_model", spy)
        one_call = decode_logits(model, prompts, steps)
    assert len(calls) == 3  # each step was one decode_model call
    with monkeypatch.context() as m:
        m.setattr(decode_step, "decode_weights", lambda *a: None)
        per_layer = decode_logits(model, prompts, steps)
    for a, b in zip(one_call, per_layer, strict=True):
        assert torch.equal(a, b)


def test_the_step_sees_replaced_modules_and_weights(tmp_path):
    """The one-call step's arguments are cached per model: a module, weight or dtype changed after a step is used by
    the next one (the step's logits equal the eager path's after each change)."""
    from gqa.models.quantized import quantize_model

    hf_model(tmp_path, "llama", 4, 2, 16)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    prompts, steps = [[5, 6, 7]], [[9]]

    def check():
        fast = decode_logits(model, prompts, steps)[0]
        with torch.inference_mode():
            eager = model(torch.tensor([prompts[0] + steps[0]]))[:, -1]
        torch.testing.assert_close(fast, eager, atol=3e-2, rtol=3e-2)
        return fast

    before = check()
    down = model.model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight * 3)  # a new Parameter object in the same module
    assert not torch.allclose(check(), before, atol=1e-3)
    quantize_model(model, "q8_0")  # modules replaced
    check()
    model.to(torch.bfloat16)  # same Parameter objects, new dtype
    check()


def test_a_generation_gathers_the_one_calls_weights_once_not_at_every_token(tmp_path, monkeypatch):
    """``generate``'s step gathers what the one native call reads when it is chosen (a generation's life), not at every
    token (checking every module for a replacement cost ~0.45 ms a token); the tokens are the eager path's."""
    hf_model(tmp_path, "llama", 4, 2, 16)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    eager = model.generate([5, 6, 7], max_new_tokens=12, eos_token_ids=[], step_fn=lambda t, c: model(t, caches=c))
    calls = []
    real = decode_step.decode_weights
    monkeypatch.setattr(decode_step, "decode_weights", lambda *a: calls.append(1) or real(*a))
    assert model.generate([5, 6, 7], max_new_tokens=12, eos_token_ids=[]) == eager
    short = len(calls)
    model.generate([5, 6, 7], max_new_tokens=24, eos_token_ids=[])
    assert 1 <= short < 12 and len(calls) == 2 * short  # as many for 24 tokens as for 12: none per token


def test_quantized_model_decodes_natively_and_tracks_its_dequantized_self(tmp_path, counted):
    from gqa.models.quantized import QuantizedLinear, quantize_model

    hf_model(tmp_path, "llama", 4, 2, 16)
    model = gqa.load_model(tmp_path, dtype=torch.float32, tokenizer=False)
    quantize_model(model, "q8_0")
    assert isinstance(model.model.layers[1].mlp.down_proj, QuantizedLinear)
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.blocks is model.model.embed_tokens.blocks
    reference = gqa.load_model(tmp_path, dtype=torch.float64, tokenizer=False)
    reference.load_state_dict(dequantized_state(model), strict=False)
    prompts, steps = [[5, 6, 7], [8]], [[9, 10], [11, 12]]
    ours = decode_logits(model, prompts, steps)
    assert len(counted) == 2
    theirs = decode_logits(reference, prompts, steps)
    for a, b in zip(ours, theirs, strict=True):  # the only difference left: inputs quantized to int8 per block
        assert (a.double() - b).abs().max() < 0.02 * b.abs().max()


def dequantized_state(model) -> dict[str, torch.Tensor]:
    from gqa.models.quantized import QuantizedEmbedding, QuantizedLinear, dequantize

    state = {}
    for name, module in model.named_modules():
        if isinstance(module, (QuantizedLinear, QuantizedEmbedding)):
            K = module.in_features if isinstance(module, QuantizedLinear) else module.embedding_dim
            state[f"{name}.weight"] = dequantize(module.blocks, module.format, K).double()
    return state


def test_cases_left_to_the_eager_path(tmp_path, counted):
    from gqa.decoding.steps import select_step

    hf_model(tmp_path, "llama", 4, 2, 16)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    with torch.inference_mode():
        rows = decode_step.MAX_ROWS + 1
        caches = model.new_caches(rows, 4)
        step = select_step(model, caches)
        assert step.name == "native"
        step(torch.ones(rows, 1, dtype=torch.long), caches)  # more rows than the native step takes
        caches = model.new_caches(1, 4)
        step(torch.ones(1, 2, dtype=torch.long), caches)  # two tokens: a prefill
        model(torch.ones(1, 1, dtype=torch.long), caches=caches)  # the model's forward is always the eager one
    caches = model.new_caches(1, 4)
    step(torch.ones(1, 1, dtype=torch.long), caches)  # autograd on
    assert counted == []
    with torch.inference_mode():
        caches = model.new_caches(1, 2)
        step(torch.ones(1, 1, dtype=torch.long), caches)
        step(torch.ones(1, 1, dtype=torch.long), caches)
        assert len(counted) == 2
        # a full cache: the eager path's message, nothing written
        with pytest.raises(ValueError, match=r"overflow: 1 new tokens after 2 cached exceed max_len 2"):
            step(torch.ones(1, 1, dtype=torch.long), caches)
    assert len(counted) == 2 and caches[0].seq_len == 2
    handle = model.register_forward_hook(lambda *a: None)
    assert select_step(model, caches).name == "eager"  # a hooked model: its hooks must run
    handle.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_ops_against_float64(dtype):
    """The decode step's small ops on odd sizes (vector tails), extremes included."""
    g = torch.randn(3, 37, dtype=torch.float64) * 6
    g[0, :4] = torch.tensor([0.0, 90.0, -90.0, 1e-4])
    up = torch.randn(3, 37, dtype=torch.float64)
    out = torch.ops.gqa.silu_mul(g.to(dtype), up.to(dtype))
    ref = torch.nn.functional.silu(g.to(dtype).double()).to(dtype).double() * up.to(dtype).double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    x, w = torch.randn(5, 19, dtype=torch.float64), torch.randn(19, dtype=torch.float64)
    norm = torch.ops.gqa.rms_norm(x.to(dtype), w.to(dtype), 1e-6)
    xr = x.to(dtype).double()
    ref = w.to(dtype).double() * (xr / (xr.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).to(dtype).double()
    torch.testing.assert_close(norm.double(), ref, atol=tol, rtol=tol)


def test_decode_mode_evaluation_scores_through_the_step_and_matches_hf(tmp_path, counted):
    """``evaluate(decode=True)`` feeds one token at a time through the caches; its perplexity is HF's own (a full
    forward, float64 log-softmax) on the same tokens."""
    from gqa.evaluation.perplexity import _score

    ref = hf_model(tmp_path, "qwen2", 6, 2, 16)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    ids = torch.randint(4, 128, (40,), generator=torch.Generator().manual_seed(3))
    nll, _, count = _score(model, ids, window=16, stride=8, decode=True)
    assert count == 39 and len(counted) > 30  # windows of 16, every scored position a native step
    with torch.inference_mode():
        from gqa.evaluation.perplexity import sliding_windows

        expected = 0.0
        for begin, first, end in sliding_windows(40, 16, 8):
            logp = ref(ids[None, begin:end]).logits[0].double().log_softmax(-1)
            expected -= logp[first - 1 - begin : end - 1 - begin].gather(-1, ids[first:end, None]).sum().item()
    assert nll == pytest.approx(expected, rel=1e-5)


def test_compiled_generation_equals_the_native_step_and_buckets_the_cache(tmp_path, monkeypatch, counted):
    from gqa.decoding import compiled

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    hf_model(tmp_path / "model", "llama", 4, 2, 16)
    model = gqa.load_model(tmp_path / "model", dtype=torch.float32, tokenizer=False)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    native = model.generate(prompts, max_new_tokens=6, eos_token_ids=[])
    assert len(counted) == 5
    assert model.generate(prompts, max_new_tokens=6, eos_token_ids=[], compile=True) == native
    assert len(counted) == 5  # the compiled steps did not go through the native step
    assert compiled.cache_dir() == tmp_path / "inductor" and any((tmp_path / "inductor").iterdir())
    assert compiled.compiled_step(model) is compiled.compiled_step(model)  # one compiled step per model
    assert [compiled.cache_bucket(n, 300) for n in (1, 256, 257, 300)] == [256, 256, 300, 300]  # capped at the context
    assert [compiled.cache_bucket(n, 8192) for n in (1, 256, 257)] == [256, 256, 512]
    with pytest.raises(ValueError, match="either compile=True or a step_fn"):
        model.generate(prompts, max_new_tokens=2, compile=True, step_fn=lambda t, c: None)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("formats", "F", "D"), [((None, "q4_1", "q8_0", "q4_0"), 224, 16), ((None, None), 205, 6)], ids=["mixed", "float"]
)
def test_one_call_op_equals_decode_layer_per_layer_on_odd_shapes(dtype, threads, formats, F, D):
    """``gqa::decode_model`` against ``gqa::decode_layer`` per layer plus the final norm and lm_head, bit for bit:
    H_q=18 over H_kv=6, F=224 or 205 and a vocabulary of 1,001 (chunks that end mid-way), batch 3 with left padding,
    700 cached tokens (the context split across tasks), float and q4_1/q8_0/q4_0 layers mixed, 1-3 threads, and the
    caches and cursors it leaves behind."""
    g = torch.Generator().manual_seed(3)
    B, E, Hq, Hkv, V, C, pos = 3, 64, 18, 6, 1001, 720, 700
    layers = random_layers(g, dtype, formats, E, F, Hq, Hkv, D, biases=True)
    head = torch.randn(V, E, generator=g).to(dtype) / 8
    final_norm = (1 + 0.1 * torch.randn(E, generator=g)).to(dtype)
    x = torch.randn(B, E, generator=g).to(dtype)
    cos, sin = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    caches = [(torch.randn(B, Hkv, C, D, generator=g).to(dtype), torch.randn(B, Hkv, C, D, generator=g).to(dtype))
              for _ in layers]  # fmt: skip
    starts = [torch.tensor([0, 5, 699]) for _ in layers]
    scale, eps = D**-0.5, 1e-5

    def fresh():
        return [(k.clone(), v.clone()) for k, v in caches], [torch.tensor(pos) for _ in layers]

    big = torch.randn(E, generator=g).to(dtype) * 50
    head[[5, 700, 900]], head[[6, 701, 901]] = big, -big  # equal largest logits in 3 lm_head chunks: the first wins
    x[1, 3] = float("nan")  # row 1: every logit NaN, whose argmax is 0 (torch's: NaN is the largest)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kv1, cur1 = fresh()
        greedy = torch.empty(B, dtype=torch.long)
        one = torch.ops.gqa.decode_model(
            x, [n[0] for n, *_ in layers], [n[1] for n, *_ in layers], eps, [w for _, ws, _, _ in layers for w in ws],
            [c for _, _, cs, _ in layers for c in cs], [b for *_, bs in layers for b in bs], cos, sin,
            [k for k, _ in kv1], [v for _, v in kv1], starts, cur1, scale, final_norm, eps, head, -1, greedy,
        )  # fmt: skip
        kv2, cur2 = fresh()
        h = x
        for (norms, ws, cs, bs), (k, v), start, cursor in zip(layers, kv2, starts, cur2, strict=True):
            h = torch.ops.gqa.decode_layer(h, norms[0], norms[1], eps, ws, cs, bs, cos, sin, k, v, start, cursor, scale)
        per_layer = torch.ops.gqa.linear_rows(torch.ops.gqa.rms_norm(h, final_norm, eps), head, None)
    finally:
        torch.set_num_threads(previous)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:  # bit for bit, NaN where the other has NaN
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))

    assert same(one, per_layer)
    assert torch.equal(greedy, one.float().argmax(-1))  # torch's argmax, ties and NaN included
    assert one[1].isnan().all() and greedy[1] == 0 and {int(greedy[0]), int(greedy[2])} <= {5, 6}
    assert all(same(a, b) for (a, _), (b, _) in zip(kv1, kv2, strict=True))
    assert all(same(a, b) for (_, a), (_, b) in zip(kv1, kv2, strict=True))
    assert [int(c) for c in cur1] == [pos + 1] * len(layers) == [int(c) for c in cur2]
    assert one[0].float().std() > 0.1  # a real result, not zeros


def _small_step_args(g: torch.Generator, dtype=torch.float32):
    """Arguments of a 2-layer ``gqa::decode_model`` call (float weights) and its ``(caches, cursors)``."""
    E, F, Hq, Hkv, D, V, C = 32, 64, 4, 2, 8, 50, 16
    layers = random_layers(g, dtype, [None, None], E, F, Hq, Hkv, D, biases=False)
    caches = [(torch.zeros(1, Hkv, C, D, dtype=dtype), torch.zeros(1, Hkv, C, D, dtype=dtype)) for _ in layers]
    cursors = [torch.tensor(0) for _ in layers]
    args = (
        torch.randn(1, E, generator=g).to(dtype), [n[0] for n, *_ in layers], [n[1] for n, *_ in layers], 1e-5,
        [w for _, ws, _, _ in layers for w in ws], [c for _, _, cs, _ in layers for c in cs],
        [b for *_, bs in layers for b in bs], torch.ones(1, D), torch.zeros(1, D), [k for k, _ in caches],
        [v for _, v in caches], [torch.tensor([0]) for _ in layers], cursors, D**-0.5, torch.ones(E, dtype=dtype),
        1e-5, torch.randn(V, E, generator=g).to(dtype), -1,
    )  # fmt: skip
    return args, caches, cursors


def _step_in_child(queue) -> None:
    import time

    sums = []
    for _ in range(4):  # the child's workers go to sleep between steps, and each step wakes them
        args, _, _ = _small_step_args(torch.Generator().manual_seed(0))
        sums.append(torch.ops.gqa.decode_model(*args).sum().item())
        time.sleep(0.05)
    queue.put(sums)


def test_the_step_works_in_a_forked_child_and_after_a_thread_count_change():
    """The step's worker pool is made again where its threads are gone (a forked child, whose parent's workers were
    asleep, running several steps) and when the thread count changes: the same logits, no hang."""
    import multiprocessing
    import time

    args, _, _ = _small_step_args(torch.Generator().manual_seed(0))
    here = torch.ops.gqa.decode_model(*args).sum().item()  # the pool exists in this process now
    time.sleep(0.1)  # its workers are asleep on the condition variable when the process forks
    queue = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(target=_step_in_child, args=(queue,), daemon=True)
    child.start()
    child.join(timeout=60)
    if child.exitcode is None:  # hung (the parent's condition variable, copied with its sleepers, once did that)
        child.kill()
        child.join(10)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == [here] * 4
    previous = torch.get_num_threads()
    try:
        for _ in range(100):  # workers made and stopped again before their threads first ran once hung the stop
            for threads in (3, 1, 2, 4):
                torch.set_num_threads(threads)
                args, _, _ = _small_step_args(torch.Generator().manual_seed(0))
                assert torch.ops.gqa.decode_model(*args).sum().item() == here
    finally:
        torch.set_num_threads(previous)


def test_a_full_cache_is_refused_before_any_work():
    """A layer whose cache is full is a clear error, and no cache or cursor was touched."""
    args, caches, cursors = _small_step_args(torch.Generator().manual_seed(0))
    cursors[1].fill_(16)  # layer 1 full
    before = [k.clone() for k, _ in caches]
    with pytest.raises(RuntimeError, match="layer 1's cache is full"):
        torch.ops.gqa.decode_model(*args)
    assert [int(c) for c in cursors] == [0, 16]
    assert all(torch.equal(a, k) for a, (k, _) in zip(before, caches, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_generation_takes_the_native_argmax_and_gives_the_same_tokens(tmp_path, monkeypatch, dtype):
    """Greedy ``generate`` uses the argmax the one-call step finds while writing the logits, with the tokens that
    ``sample_next`` picks from the same logits; a hooked model goes through ``model(...)``, eager."""
    from gqa.decoding import generate as generation

    hf_model(tmp_path, "qwen2", 6, 2, 16)
    model = gqa.load_model(tmp_path, dtype=dtype, tokenizer=False)
    prompts = [[5, 6, 7, 8], [9, 10]]
    picked = []
    real = decode_step.decode_step

    def spy(*args, **kwargs):
        picked.append(kwargs.get("greedy") is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_step, "decode_step", spy)
    native = generation.generate(model, prompts, max_new_tokens=6, eos_token_ids=[])
    assert picked == [True] * 5  # every step after the prefill found its tokens natively
    picked.clear()
    real_select = generation.select_step

    def without_greedy(*args, **kwargs):  # the same native step, its argmax not asked for: sample_next picks
        step = real_select(*args, **kwargs)
        return dataclasses.replace(step, run=lambda t, c: step.run(t, c, None), finds_greedy=False)

    with monkeypatch.context() as m:
        m.setattr(generation, "select_step", without_greedy)
        plain = generation.generate(model, prompts, max_new_tokens=6, eos_token_ids=[])
    assert picked == [False] * 5 and native == plain
    picked.clear()
    handle = model.register_forward_hook(lambda *a: None)
    try:
        assert generation.generate(model, prompts, max_new_tokens=6, eos_token_ids=[]) == native
    finally:
        handle.remove()
    assert picked == []  # a model with hooks decodes through its forward (eager), so every hook sees every step
