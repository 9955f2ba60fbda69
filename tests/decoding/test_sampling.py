"""Sampling (``gqa.decoding.generate.sample_next``) against float64 references computed here: the nucleus is the set a
sort of the whole vocabulary gives, samples follow the restricted distribution, a row's token depends on its own logits
and number only; and generation that stops computing finished rows gives every row the tokens it gets otherwise."""

from __future__ import annotations

import pytest
import torch

from gqa.decoding import generate as generation
from gqa.decoding import sampling
from gqa.decoding.generate import generate
from gqa.decoding.sampling import sample_next
from gqa.models import CausalLM
from gqa.models.config import ModelConfig


def reference_allowed(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, min_p: float | None = None
):
    """Float64 reference: ``(allowed (B, V) bool, probs (B, V) restricted and renormalised)``; min-p first, on the
    temperature-scaled probabilities (vLLM's order), then top-k, then top-p."""
    x = logits.double() / temperature
    allowed = torch.ones_like(x, dtype=torch.bool)
    if min_p:
        p = x.softmax(-1)
        allowed = p >= min_p * p.amax(-1, keepdim=True)
    if top_k is not None and top_k < x.shape[-1]:
        allowed &= x >= x.masked_fill(~allowed, -torch.inf).topk(top_k, -1).values[:, -1:]
    if top_p is not None:
        sorted_p, order = x.masked_fill(~allowed, -torch.inf).softmax(-1).sort(-1, descending=True)
        allowed = torch.zeros_like(allowed).scatter(-1, order, sorted_p.cumsum(-1) - sorted_p < top_p)
    return allowed, x.masked_fill(~allowed, -torch.inf).softmax(-1)


# nuclei of ~4,000, ~1,000, ~100 and a few tokens; all four in one batch ("mixed": some rows need more candidates)
@pytest.mark.parametrize("scale", [0.3, 2.0, 4.0, 12.0, "mixed"])
@pytest.mark.parametrize(("top_k", "top_p"), [(None, 0.95), (None, 0.5), (40, 0.9), (3000, 0.99)])
def test_nucleus_is_the_set_a_full_sort_gives(scale, top_k, top_p):
    """Exactly the float64 set where no token's preceding mass lies within float32 rounding of ``top_p`` (summing
    thousands of probabilities); elsewhere a prefix of the tokens by probability that ends within that rounding."""
    mixed = scale == "mixed"
    scale = torch.tensor([0.3, 12.0, 2.0, 4.0] * 4)[:, None] if mixed else scale
    g = torch.Generator().manual_seed(7 if mixed else int(scale * 10))
    logits = torch.randn(16, 5003, generator=g) * scale
    allowed, _ = reference_allowed(logits, 0.9, top_k, top_p)
    limit = 5003 if top_k is None else top_k
    values, order = sampling._nucleus(logits / 0.9, top_p, limit)
    if mixed:  # each row as it is alone: its candidates, padded with -inf to the batch's
        for i in range(16):
            v, o = sampling._nucleus(logits[i : i + 1] / 0.9, top_p, limit)
            assert torch.equal(values[i, : v.shape[1]], v[0]) and torch.equal(order[i, : o.shape[1]], o[0])
            assert bool((values[i, v.shape[1] :] == -torch.inf).all())
    ours = torch.zeros_like(allowed).scatter(-1, order, values > -torch.inf)
    x = logits.double() / 0.9
    if top_k is not None:
        x = x.masked_fill(x < x.topk(top_k, -1).values[:, -1:], -torch.inf)
    sorted_p, by_prob = x.softmax(-1).sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # (B, V) float64 mass ahead of each token
    tol = 1e-4
    close = ((before - top_p).abs() < tol).any(-1)
    assert torch.equal(ours[~close], allowed[~close])
    ours_sorted = ours.gather(-1, by_prob).int()
    n = ours_sorted.sum(-1)  # kept tokens per row
    assert torch.equal(ours_sorted.cummin(-1).values, ours_sorted)  # a prefix in order of probability
    assert bool((before.gather(-1, n[:, None] - 1) < top_p + tol).all())
    assert bool((before.gather(-1, n[:, None].clamp_max(5002)) >= top_p - tol).all())
    if not mixed and scale == 12.0:
        assert (~close).sum() >= 12  # nuclei of a few tokens: most rows checked exactly


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"),
    [(None, None, None), (None, 0.8, None), (3, None, None), (3, 0.8, None), (1, None, None), (None, None, 0.2),
     (None, None, 0.05), (2, 0.9, 0.3), (None, 0.95, 0.1), (None, None, 1.0)],
)  # fmt: skip
def test_samples_follow_the_restricted_distribution(top_k, top_p, min_p):
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, -3.0]]).expand(200_000, 6)
    allowed, probs = reference_allowed(logits[:1], 0.7, top_k, top_p, min_p)
    if min_p in (0.05, 0.2, 1.0):  # (p / p_max: 1, 0.24, 0.117, 0.014, 0.057, 0.0008): 4, 2 and 1 tokens kept
        assert int(allowed.sum()) == {0.05: 4, 0.2: 2, 1.0: 1}[min_p]
    drawn = sample_next(logits, temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p,
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    freq = torch.bincount(drawn, minlength=6).double() / len(drawn)
    assert torch.all(freq[probs[0] == 0] == 0)  # never a token outside the set
    torch.testing.assert_close(freq, probs[0], atol=4e-3, rtol=0)  # ~4 binomial SDs at p = 0.5


def test_a_rows_token_depends_on_its_logits_and_number_only():
    g = torch.Generator().manual_seed(1)
    logits, uniforms = torch.randn(9, 1000, generator=g) * 3, torch.rand(9, generator=g)
    kw = {"temperature": 0.8, "top_p": 0.9, "top_k": 200}
    whole = sample_next(logits, uniforms=uniforms, **kw)
    picked = torch.tensor([7, 2, 4])
    assert torch.equal(sample_next(logits[picked], uniforms=uniforms[picked], **kw), whole[picked])
    alone = [int(sample_next(logits[i : i + 1], uniforms=uniforms[i : i + 1], **kw)) for i in range(9)]
    assert whole.tolist() == alone
    # inverse CDF: the smallest number picks the most likely token, the largest the least likely kept one
    ends = sample_next(logits[:1].expand(2, -1), uniforms=torch.tensor([0.0, 1.0 - 2**-24]), **kw)
    allowed, probs = reference_allowed(logits[:1], 0.8, 200, 0.9)
    assert int(ends[0]) == int(probs[0].argmax())
    assert int(ends[1]) == int(probs[0].masked_fill(~allowed[0], 2.0).argmin())


@pytest.mark.parametrize("bad", ["nan", "all -inf"])
def test_rows_without_a_distribution_are_refused(bad):
    logits = torch.randn(3, 10)
    logits[1] = float("nan") if bad == "nan" else float("-inf")
    if bad == "nan":
        logits[1, 4] = 1.0  # one NaN among numbers is enough
        logits[1, :4] = 0.0
    for kw in ({}, {"top_p": 0.9}, {"top_k": 4}):
        with pytest.raises(ValueError, match="logits must hold finite values in every row"):
            sample_next(logits, temperature=1.0, **kw)


def tiny_model() -> CausalLM:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=2,
                      head_dim=16, max_position_embeddings=128, eos_token_id=[1],
                      tie_word_embeddings=False)  # fmt: skip
    model = CausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4)  # distributions neither flat nor one token
    return model


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dropping_finished_rows_changes_no_rows_tokens(monkeypatch, temperature):
    """12 prompts of 1-12 tokens, with end tokens that finish rows at different steps: the tokens with finished rows
    dropped from the batch (they were, and rows ran on after) equal those with every row computed to the end, and
    (greedy) each row generated alone."""
    model = tiny_model()
    prompts = [[(7 * i + j) % 60 + 2 for j in range(i + 1)] for i in range(12)]
    kw = {"max_new_tokens": 24, "temperature": temperature, "seed": 5}
    free = generate(model, prompts, **kw, eos_token_ids=[])
    counts = torch.bincount(torch.tensor([t for row in free for t in row[:12]]), minlength=64)
    ends = counts.argsort(descending=True)[:3].tolist()  # frequent tokens: most rows end, some late, some never
    kept = []
    real = type(model.new_caches(1, 1)[0]).keep_rows

    def spy(cache, rows):
        kept.append(len(rows))
        return real(cache, rows)

    monkeypatch.setattr(type(model.new_caches(1, 1)[0]), "keep_rows", spy)
    dropping = generate(model, prompts, **kw, eos_token_ids=ends)
    assert kept and min(kept) < 12  # rows were dropped ...
    assert max(len(r) for r in dropping) > min(len(r) for r in dropping) + 2  # ... and others ran on
    monkeypatch.setattr(generation, "DROP_FINISHED_AT", 0.0)
    kept.clear()
    computing_all = generate(model, prompts, **kw, eos_token_ids=ends)
    assert kept == [] and dropping == computing_all
    if temperature == 0:
        assert dropping == [generate(model, p, **kw, eos_token_ids=ends) for p in prompts]
