"""Qwen3 (q/k norm), Mistral (a sliding window), Gemma 2 (soft-capping, interleaved windows, sandwich norms) and
Gemma 3 (q/k norm, a local RoPE base, scaled global RoPE) from HF folders: gqa's model against transformers' own on
the same random weights — logits on sequences longer than the window, greedy generation well past it, and the config
written back loads in transformers."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import gqa
from tests.helpers.families import FAMILIES, family_model
from tests.helpers.serving import hf_greedy

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", FAMILIES)
def test_logits_match_transformers_past_the_window(tmp_path, arch):
    ref = family_model(arch, tmp_path)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    assert model.config.arch == arch
    cfg = model.config
    assert cfg.qk_norm == (arch in ("qwen3", "gemma3_text"))
    windows = {"qwen3": [None] * 2, "mistral": [(4, None)] * 2, "gemma2": [(4, None), None] * 2,
               "gemma3_text": [(4, None), (4, None), None], "smollm3": [None] * 4}  # fmt: skip
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == windows[arch]
    assert [cfg.layer_rotates(i) for i in range(cfg.num_layers)] == [
        arch != "smollm3" or i % 2 == 0 for i in range(cfg.num_layers)
    ]
    ids = torch.randint(3, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_generation_equals_transformers_well_past_the_window(tmp_path, arch):
    ref = family_model(arch, tmp_path)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    prompt = [5, 9, 17, 33, 2, 8, 40]
    ours = model.generate(prompt, max_new_tokens=24, eos_token_ids=[])
    theirs = hf_greedy(ref, prompt, 24)
    assert ours == theirs


@pytest.mark.parametrize("arch", FAMILIES)
def test_the_config_written_back_loads_in_transformers(tmp_path, arch):
    family_model(arch, tmp_path / "src")
    model = gqa.load_model(tmp_path / "src", tokenizer=False, dtype=torch.float32)
    cfg = model.config.to_hf()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text(json.dumps(cfg))
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert hf_cfg.model_type == arch
    if arch not in ("qwen3", "smollm3"):
        assert hf_cfg.sliding_window == 5
    if arch.startswith("gemma"):
        assert hf_cfg.layer_types == model.config.layer_types and hf_cfg.query_pre_attn_scalar == 12
    if arch == "smollm3":
        assert hf_cfg.no_rope_layers == [1, 0, 1, 0]
    assert gqa.models.ModelConfig.from_hf(hf_cfg.to_dict()) == model.config


@pytest.mark.filterwarnings("ignore:.*no usable tokenizer")  # the test folders hold weights only
@pytest.mark.parametrize("arch", FAMILIES)
def test_converting_to_more_kv_heads_keeps_the_qk_norm_and_the_window_exact(tmp_path, arch):
    """``gqa convert --kv-heads 6`` (MHA: heads copied) writes a checkpoint transformers loads and whose logits are
    the original's: the q/k norms and the window survive the conversion."""
    from gqa.cli import main as cli

    ref = family_model(arch, tmp_path / "src")
    assert cli(["convert", str(tmp_path / "src"), str(tmp_path / "mha"), "--kv-heads", "6", "--no-conversations"]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "mha", attn_implementation="eager").eval()
    assert hf.config.num_key_value_heads == 6 and hf.config.model_type == arch
    ids = torch.randint(3, 96, (1, 15), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", FAMILIES)
def test_merging_kv_heads_with_the_refit_keeps_each_familys_attention(tmp_path, arch):
    """2 -> 1 KV heads by the default ``pca`` merge with the ``v_proj``/``o_proj`` refit, streamed a layer at a time
    on calibration ids: the written checkpoint loads in transformers with gqa's logits, equals the in-memory refit,
    and is closer to the source on held-out ids (KL) than the plain mean merge: the refit's attention has the
    layer's window, soft-cap, q/k norms, RoPE (Gemma 3's local one, SmolLM3's none) and Gemma's norms around it."""
    from gqa.convert import convert_state
    from gqa.convert.refit import refit_convert_state
    from gqa.convert.streaming import stream_convert
    from gqa.loaders import read_model
    from gqa.loaders.lazy import open_lazy

    ref = family_model(arch, tmp_path / "src")
    g = torch.Generator().manual_seed(3)
    calibration = torch.randint(3, 96, (1500,), generator=g).tolist()
    held_out = torch.randint(3, 96, (4, 24), generator=g)
    (tmp_path / "out").mkdir()
    new_cfg, _ = stream_convert(open_lazy(tmp_path / "src"), tmp_path / "out", 1, "pca", calibration_ids=calibration,
                                refit=True, dtype=torch.float32)  # fmt: skip
    (tmp_path / "out" / "config.json").write_text(json.dumps(new_cfg.to_hf()))
    merged = gqa.load_model(tmp_path / "out", tokenizer=False, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    cfg, state = read_model(tmp_path / "src")
    _, in_memory = refit_convert_state(cfg, state, 1, "pca", calibration)
    _, mean = convert_state(cfg, state, 1, "mean")
    with torch.no_grad():
        torch.testing.assert_close(hf(held_out).logits, merged(held_out), atol=1e-4, rtol=1e-4)
        for name, t in in_memory.items():
            torch.testing.assert_close(merged.state_dict()[name], t, atol=1e-4, rtol=1e-4)
        source = torch.log_softmax(ref(held_out).logits, -1)

        def kl(model) -> float:
            return torch.nn.functional.kl_div(torch.log_softmax(model(held_out), -1), source, log_target=True,
                                              reduction="batchmean").item()  # fmt: skip

        mean_model = gqa.models.CausalLM.from_state(dataclasses.replace(cfg, num_kv_heads=1), mean)
        assert kl(merged) < kl(mean_model)


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "smollm3", "gemma2", "gemma3_text"])
def test_the_native_step_decodes_the_family_as_transformers_does(tmp_path, arch, monkeypatch):
    """On CPU the one-call native step (``gqa::decode_model``) takes Qwen3 (q/k norms), Mistral (a 5-key window, here
    far exceeded), SmolLM3 (NoPE layers), Gemma 2 (sandwich norms, GELU, attention and final soft-caps, alternating
    windows) and Gemma 3 (q/k norms, local RoPE) on every step: greedy tokens equal transformers' 40 tokens on, and
    the step's logits its eager forward's."""
    from gqa import kernels
    from gqa.decoding import native_step
    from gqa.decoding.steps import select_step

    if not kernels.vectorized():
        pytest.skip("the native step needs the SIMD kernels")
    ref = family_model(arch, tmp_path)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    assert native_step.whole_model(model)
    calls = []
    real = native_step.decode_step
    monkeypatch.setattr(native_step, "decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert select_step(model, model.new_caches(1, 8)).name == "native"
    prompt = [5, 9, 17]
    ours = model.generate(prompt, max_new_tokens=40, eos_token_ids=[])
    theirs = hf_greedy(ref, prompt, 40)
    assert ours == theirs
    assert len(calls) == 39  # every step after the prompt's
    caches = model.new_caches(2, 32)
    ids = torch.tensor([[5, 9, 17, 3, 40], [8, 1, 2, 60, 7]])
    with torch.no_grad():
        model(ids[:, :4], caches=caches)
    eager_caches = model.new_caches(2, 32)
    with torch.no_grad():
        model(ids[:, :4], caches=eager_caches)
        want = model(ids[:, 4:], caches=eager_caches)
        got = native_step.decode_step(model, ids[:, 4:], caches)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_gemma_in_bf16_stays_as_close_to_float32_as_transformers_does(tmp_path, arch):
    """bf16 logits are as close to transformers' float32 ones as transformers' own bf16 logits are."""
    ref = family_model(arch, tmp_path)
    ids = torch.randint(3, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    bf16 = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.bfloat16)
    with torch.no_grad():
        want = ref(ids).logits
        theirs = ref.to(torch.bfloat16)(ids).logits.float()
        ours = bf16(ids).float()
    assert (ours - want).abs().max() <= 1.25 * (theirs - want).abs().max()


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3_text"])
def test_window_caches_hold_the_window_and_decode_as_transformers_does(tmp_path, arch):
    """300 new tokens (past each layer's 5-key window and its 256 spare slots, so the slots move once): the sliding
    layers get a ``WindowKVCache`` of 261 slots, global layers a full static cache, and the greedy tokens are
    transformers', through the one-call native step (it reads window caches' slots) and through the eager one."""
    from gqa.cache.window import WindowKVCache
    from gqa.decoding import native_step
    from gqa.decoding.steps import select_step

    ref = family_model(arch, tmp_path, context=512)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    prompt, new = [5, 9, 17, 33, 2, 8, 40], 300
    caches = model.new_caches(1, len(prompt) + new)
    rings = [isinstance(c, WindowKVCache) for c in caches]
    assert rings == [model.config.layer_window(i) is not None for i in range(model.config.num_layers)]
    assert all(c.slots == 261 for c in caches if isinstance(c, WindowKVCache))
    assert select_step(model, caches).name == "native"
    ours = model.generate(prompt, max_new_tokens=new, eos_token_ids=[])
    theirs = hf_greedy(ref, prompt, new)
    assert ours == theirs
    with pytest.MonkeyPatch.context() as m:  # the eager step over the same caches
        m.setattr(native_step, "applies", lambda *a: False)
        assert model.generate(prompt, max_new_tokens=new, eos_token_ids=[]) == theirs


def test_info_reports_the_window_caches_memory(tmp_path, capsys):
    """``gqa info`` on Gemma 3 (two 5-key sliding layers, one global, 4096-token context): window-sized caches hold
    2 x (5 + 256) + 4096 token slots of the full 3 x 4096."""
    from gqa.cli import main as cli

    family_model("gemma3_text", tmp_path, context=4096)
    assert cli(["info", "--model", str(tmp_path), "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    per_slot = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head dim 16, fp32
    held, full = (2 * 261 + 4096) * per_slot, 3 * 4096 * per_slot
    assert "sliding window   5 keys on 2 of 3 layers (their caches: 5 + 256 slots)" in out
    assert f"{held / 2**20:.1f} MiB with window caches vs {full / 2**20:.1f} MiB full ({held / full:.2f}x)" in out


# llama.cpp's fixed layouts (tests/helpers/llamacpp_gguf.py): Gemma's scores scaled by head_dim's -1/2 power, Gemma 3's
# five sliding layers to one global, SmolLM3's NoPE on every fourth layer; Gemma files are tied
GGUF_LAYOUTS = {
    "qwen3": {},
    "gemma2": dict(query_pre_attn_scalar=16, tie_word_embeddings=True),
    "gemma3_text": dict(
        num_hidden_layers=6, sliding_window_pattern=6, query_pre_attn_scalar=16, tie_word_embeddings=True
    ),
    "smollm3": dict(no_rope_layer_interval=4),
}


@pytest.mark.parametrize("arch", list(GGUF_LAYOUTS))
def test_a_gguf_file_as_llama_cpp_writes_it_loads_as_transformers_runs_it(tmp_path, arch):
    """Each family written by llama.cpp's converter's rules (names from ``gguf``'s own map, Gemma norms plus one,
    SmolLM3's q/k permuted): the config as the HF one reads, logits equal to transformers' past the window, greedy
    decoding equal; with Q8_0 projections, logits within the int8 tolerance of transformers on the same blocks."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from tests.helpers.llamacpp_gguf import write_family_gguf

    ref = family_model(arch, tmp_path / "hf", **GGUF_LAYOUTS[arch])
    path = write_family_gguf(tmp_path / f"{arch}.gguf", ref)
    model = gqa.load_model(path, tokenizer=False, dtype=torch.float32)
    want = gqa.models.ModelConfig.from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    got = model.config
    assert (got.arch, got.qk_norm, got.rope_layers, got.layer_types) == (want.arch, want.qk_norm, want.rope_layers,
                                                                          want.layer_types)  # fmt: skip
    assert (got.sliding_window, got.attention_scale, got.attn_softcap, got.final_softcap) == (
        want.sliding_window, want.attention_scale, want.attn_softcap, want.final_softcap)  # fmt: skip

    def rope(cfg):
        scaling = {k: v for k, v in (cfg.rope_scaling or {}).items() if k != "rope_theta"}
        return cfg.rope_theta, cfg.rope_local_theta, scaling

    assert rope(got) == rope(want)
    ids = torch.randint(3, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-5, rtol=1e-5)
    prompt = [5, 9, 17, 33, 2, 8, 40]
    ours = model.generate(prompt, max_new_tokens=16, eos_token_ids=[])
    theirs = hf_greedy(ref, prompt, 16)
    assert ours == theirs

    def q8(name):
        return Q.Q8_0 if "proj" in name else Q.F32

    quantized = gqa.load_model(write_family_gguf(tmp_path / "q8.gguf", ref, q8), tokenizer=False, dtype=torch.float32)
    with torch.no_grad():  # transformers on the weights the blocks hold
        for name, p in ref.named_parameters():
            if "proj" in name and p.shape[-1] % 32 == 0:  # the rows that fill Q8_0 blocks
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), Q.Q8_0), Q.Q8_0)))
        want_q = ref(ids).logits
        got_q = quantized(ids)
    err = (got_q - want_q).abs().max() / want_q.abs().max()
    assert err < 0.03, err


@pytest.mark.parametrize("arch", ["qwen3", "mistral", "smollm3", "gemma2", "gemma3_text"])
def test_the_serving_engine_serves_the_family_as_transformers_decodes_it(tmp_path, arch):
    """Through the paged one-call step (``gqa::decode_paged``): Qwen3's q/k norms, Mistral's 5-key window on prompts
    and answers far longer than it (chunked prefill of 8, blocks of 4), SmolLM3's NoPE layers, Gemma's layers; four
    requests together give transformers' greedy tokens and each the same tokens served alone."""
    from gqa import kernels
    from gqa.serve.engine import Engine
    from gqa.serve.sampling import SamplingParams
    from tests.helpers.serving import serve_all

    if not kernels.vectorized():
        pytest.skip("the engine needs the SIMD kernels")
    ref = family_model(arch, tmp_path)
    model = gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32)
    prompts = [[5, 9, 17, 33, 2, 8, 40, 41, 7], [11], [7] * 20 + [12, 13], list(range(20, 50))]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    engine = Engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=8)
    free = engine.blocks.num_free
    together = serve_all(engine, prompts, params)
    assert engine.blocks.num_free == free
    for prompt, tokens in zip(prompts, together, strict=True):
        assert tokens == hf_greedy(ref, prompt, 16)
        assert serve_all(Engine(model, kv_cache_mib=1, block_size=4, prefill_chunk=8), [prompt], params) == [tokens]


def test_serving_a_sliding_window_model_gives_blocks_behind_the_window_back(tmp_path):
    """Mistral with a 5-key window on every layer, blocks of 4: once decoding, a 40-token prompt's request holds at
    most the 3 blocks its window can reach (not the 18 its 70 tokens fill), and its answer is transformers'."""
    from gqa import kernels
    from gqa.serve.engine import Engine
    from gqa.serve.sampling import SamplingParams

    if not kernels.vectorized():
        pytest.skip("the engine needs the SIMD kernels")
    ref = family_model("mistral", tmp_path)
    engine = Engine(
        gqa.load_model(tmp_path, tokenizer=False, dtype=torch.float32), kv_cache_mib=1, block_size=4, prefill_chunk=8
    )
    total = engine.blocks.num_free
    prompt = list(range(10, 50))
    r = engine.add(prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    tokens, held = [], []
    while engine.has_work:
        for out in engine.step():
            tokens += out.token_ids
        held.append(total - engine.blocks.num_free)
    assert tokens == hf_greedy(ref, prompt, 30) and r.finish_reason == "length"
    assert max(held[-25:]) <= 3 and held[-1] == 0 and engine.blocks.num_free == total
