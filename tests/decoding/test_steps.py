"""``select_step``: which decode step a model gets, its name, and what each kind promises the generate loop."""

from __future__ import annotations

import pytest
import torch

from gqa import kernels
from gqa.decoding.generate import generate
from gqa.decoding.steps import DecodeStep, select_step
from gqa.models import CausalLM
from gqa.models.config import ModelConfig


@pytest.fixture
def model():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    return CausalLM(cfg).eval()


def test_the_step_on_cpu_is_named_and_equals_the_eager_forward(model):
    caches = model.new_caches(2, 8)
    ref_caches = model.new_caches(2, 8)
    with torch.inference_mode():
        step = select_step(model, caches)
        assert step.name == ("native" if kernels.vectorized() else "eager")
        assert step.finds_greedy == kernels.vectorized() and not step.fixed_batch
        tokens = torch.tensor([[3], [5]])
        greedy = torch.empty(2, dtype=torch.long) if step.finds_greedy else None
        logits = step(tokens, caches, greedy)
        want = model(tokens, caches=ref_caches)  # the model's forward: the eager one
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)
    if greedy is not None:
        assert greedy.tolist() == want[:, -1].argmax(-1).tolist()


def test_hooks_custom_steps_and_compile_are_chosen_and_named(model):
    caches = model.new_caches(1, 8)
    handle = model.register_forward_pre_hook(lambda *a: None)
    assert select_step(model, caches).name == "eager"  # a hook must see every step
    handle.remove()
    custom = select_step(model, caches, step_fn=lambda t, c: model(t, caches=c))
    assert (custom.name, custom.fixed_batch, custom.finds_greedy) == ("custom", True, False)
    with pytest.raises(ValueError, match="does not find greedy tokens"):
        custom(torch.tensor([[1]]), caches, torch.empty(1, dtype=torch.long))
    with pytest.raises(ValueError, match="either compile=True or a step_fn"):
        select_step(model, caches, compile=True, step_fn=lambda t, c: None)
    compiled = select_step(model, caches, compile=True)
    assert (compiled.name, compiled.fixed_batch) == ("compiled", True)


def test_generate_tells_which_step_decoded(model):
    seen: list[DecodeStep] = []
    out = generate(model, [1, 2, 3], max_new_tokens=3, eos_token_ids=[], on_step=seen.append)
    assert len(out) == 3 and [s.name for s in seen] == ["native" if kernels.vectorized() else "eager"]
    seen.clear()
    generate(model, [[1, 2, 3]], max_new_tokens=1, eos_token_ids=[], on_step=seen.append)
    assert len(seen) == 1  # chosen after the prompt even when no step runs
