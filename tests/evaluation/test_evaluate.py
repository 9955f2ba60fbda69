"""``gqa.evaluation.perplexity``: perplexity and KL against independent computations, SmolLM2 on the default text,
``gqa eval``.

The tiny-model tests load a random HF ``LlamaForCausalLM`` (saved with ``save_pretrained``) into gqa and compare
with transformers' own loss on the same weights, in float64.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Categorical, kl_divergence

import gqa
from gqa.cli import main
from gqa.evaluation.perplexity import default_eval_text, mean_kl, perplexity, sliding_windows
from gqa.models import CausalLM

transformers = pytest.importorskip("transformers")

ENV = os.environ | {"HF_HUB_OFFLINE": "1"}
N = 61  # odd lengths and windows on purpose
# HF's float64 Llama still computes RMSNorm and RoPE's cos/sin in float32: ~1e-7 relative differences in perplexity.
# A token miscounted or scored twice would move it by ~1/N.
HF_RTOL = 1e-6


@pytest.fixture(scope="module", autouse=True)
def eval_cli():
    """``gqa eval --max-tokens 256`` on the defaults, started first so that its ~12 s of (mostly single-threaded)
    loading overlaps the other tests; one thread, so that it does not oversubscribe 2-core machines (~15 s in all
    instead of ~23 s run one after the other)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gqa", "eval", "--max-tokens", "256"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV | {"OMP_NUM_THREADS": "1"},
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        initializer_range=0.3,  # peaked, context-dependent predictions (0.02 gives near-uniform ones)
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    folder = tmp_path_factory.mktemp("tiny_llama")
    hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return gqa.load_model(tiny_dir, dtype=torch.float64, tokenizer=False)


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    return transformers.LlamaForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 101, (N,), generator=torch.Generator().manual_seed(1))


def hf_strided_perplexity(hf, ids: torch.Tensor, max_length: int, stride: int) -> float:
    """The loop of HF's "Perplexity of fixed-length models" guide, with the exact count of scored tokens.

    (The guide weights each window's mean loss by ``num_valid_tokens - batch_size``, one short for windows whose
    first label is masked; here the count is that of the shifted, unmasked labels.)
    """
    input_all = ids[None]  # (1, N)
    seq_len = input_all.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + max_length, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = input_all[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf(input_ids, labels=target_ids).loss
        n = int((target_ids[:, 1:] != -100).sum())
        nll_sum += loss.item() * n
        n_tokens += n
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return math.exp(nll_sum / n_tokens)


@pytest.mark.parametrize("window", [N, N + 7, 512])
def test_full_window_matches_direct_cross_entropy(tiny, hf_tiny, ids, window):
    with torch.no_grad():
        direct = math.exp(F.cross_entropy(tiny(ids[None])[0, :-1], ids[1:]).item())  # same logits: float64-exact
        hf = math.exp(hf_tiny(ids[None], labels=ids[None]).loss.item())
    assert perplexity(tiny, ids, window=window) == pytest.approx(direct, rel=1e-12)
    assert perplexity(tiny, ids.tolist(), window=window) == pytest.approx(direct, rel=1e-12)
    assert perplexity(tiny, ids, window=window) == pytest.approx(hf, rel=HF_RTOL)


@pytest.mark.parametrize("window,stride", [(16, 5), (16, None), (16, 16), (7, 3), (60, 59)])
def test_strided_matches_hf_guide_loop(tiny, hf_tiny, ids, window, stride):
    expected = hf_strided_perplexity(hf_tiny, ids, window, stride or window // 2)
    got = perplexity(tiny, ids, window=window, stride=stride)
    assert got == pytest.approx(expected, rel=HF_RTOL)
    full = perplexity(tiny, ids, window=N)
    assert abs(got - full) > 1e-6 * full  # the windows really cut the context: the comparison is not vacuous


@pytest.mark.parametrize("n,window,stride", [(2, 2, 1), (61, 16, 5), (61, 16, 16), (50, 7, 3), (10, 64, 32)])
def test_windows_score_each_token_once(n, window, stride):
    scored = [t for _, first, end in sliding_windows(n, window, stride) for t in range(first, end)]
    skipped = set(range(stride, n, stride)) if stride == window else set()  # disjoint windows: no context
    assert scored == [t for t in range(1, n) if t not in skipped]
    assert all(end - begin <= window and begin < first for begin, first, end in sliding_windows(n, window, stride))


def test_kl_with_itself_is_zero(tiny, tiny_dir, ids):
    twin = gqa.load_model(tiny_dir, dtype=torch.float64, tokenizer=False)
    assert mean_kl(tiny, tiny, ids, window=16) == 0.0
    assert mean_kl(twin, tiny, ids, window=16, stride=3) == 0.0


def test_kl_against_perturbed_copy_is_positive_and_matches_direct(tiny, tiny_dir, ids):
    perturbed = gqa.load_model(tiny_dir, dtype=torch.float64, tokenizer=False)
    with torch.no_grad():
        w = perturbed.model.layers[0].self_attn.q_proj.weight
        w.add_(0.1 * torch.randn(w.shape, generator=torch.Generator().manual_seed(2), dtype=w.dtype))
    kl = mean_kl(perturbed, tiny, ids, window=16)
    assert math.isfinite(kl) and kl > 1e-4

    short = ids[:20]  # one window: every position sees its whole prefix
    with torch.no_grad():
        p = Categorical(logits=tiny(short[None])[0, :-1])  # reference's next-token distributions (19, vocab)
        q = Categorical(logits=perturbed(short[None])[0, :-1])
    expected = kl_divergence(p, q).mean().item()
    assert mean_kl(perturbed, tiny, short, window=32) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(window=1), "window must be >= 2"),
        (dict(window=16, stride=0), "stride must be in [1, window=16]"),
        (dict(window=16, stride=17), "stride must be in [1, window=16]"),
        (dict(window=200), "exceeds the model's context of 128"),
    ],
)
def test_bad_windows_are_errors(tiny, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        perplexity(tiny, torch.arange(150) % 101, **kwargs)


def test_kl_needs_the_same_vocabulary(tiny):
    other = CausalLM(dataclasses.replace(tiny.config, vocab_size=50)).double().eval()
    with pytest.raises(ValueError, match="vocabularies differ: 101 vs 50"):
        mean_kl(tiny, other, torch.arange(20))


def test_too_few_ids_is_an_error(tiny):
    with pytest.raises(ValueError, match="at least 2 token ids"):
        perplexity(tiny, [5])


def test_smollm2_on_default_text():
    text, description = default_eval_text()
    assert "LICENSE.txt" in description and "Python Software Foundation" in text
    model = gqa.load_model()
    ids = model.tokenizer.encode(text)[:512]
    assert len(ids) == 512
    # Measured: 10.86 (SmolLM2-135M-Instruct Q4_1, fp32, one 512-token window).
    ppl = perplexity(model, ids, window=512)
    assert 5 < ppl < 25, ppl


def test_cli_prints_perplexity(eval_cli):
    out, err = eval_cli.communicate(timeout=240)
    assert eval_cli.returncode == 0, err
    assert "LICENSE.txt" in out and re.search(r"tokens\s+256\b", out)
    ppl = float(re.search(r"perplexity\s+([0-9.]+)", out).group(1))
    assert 5 < ppl < 30, out  # measured 12.82


def test_cli_bad_window_is_a_message(capsys):
    assert main(["eval", "--window", "0"]) == 2  # checked before anything is loaded
    assert "gqa eval: error: window must be >= 2" in capsys.readouterr().err
