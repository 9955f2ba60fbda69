"""LoRA adapters on the MLP while healing (``gqa.convert.lora``, ``heal(train="attention+mlp-lora")``): an adapted
model computes ``W x + (alpha / r) B A x`` (checked against weights changed by hand, in float64), folding gives the
same model with plain weights, and healing moves the attention projections fully and each MLP projection by a
rank-``r`` update, nothing else."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.checkpoints import TRAIN_IDS, tiny_pair

from gqa.convert import heal
from gqa.convert.lora import MLP_LORA_RANK, add_lora, fold_lora, has_lora
from gqa.evaluation.perplexity import mean_kl


def _randomize_adapters(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if has_lora(m):
                m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen) * 0.2)


def test_an_adapted_model_computes_the_low_rank_update_and_folds_into_it():
    _, student = tiny_pair()
    ids = torch.randint(0, 64, (2, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = student(ids)
    original = copy.deepcopy(student)
    params = add_lora(student, rank=3, alpha=12.0, seed=1)
    assert len(params) == 2 * 3 * 2  # (A, B) x gate/up/down x 2 layers
    with torch.no_grad():
        assert torch.equal(student(ids), plain)  # B = 0: exactly the model it was
    _randomize_adapters(student, seed=2)
    # the reference: a float64 copy of the original whose MLP weights are W + (alpha / r) B A, without adapters
    reference = original.double()
    adapted_modules = dict(student.named_modules())
    with torch.no_grad():
        for name, m in reference.named_modules():
            if has_lora(adapted_modules[name]):
                a, b = adapted_modules[name].lora_a.double(), adapted_modules[name].lora_b.double()
                m.weight += 4.0 * b @ a
        adapted, want = student(ids), reference(ids)
        # decode-sized: 3 rows, where the native GEMV would take the projections and skip an adapter's hook
        short, short_want = student(ids[:1, :3]), reference(ids[:1, :3])
    assert (adapted - plain).abs().max() > 0.1  # the adapters change the output
    torch.testing.assert_close(adapted.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(short.double(), short_want, atol=1e-4, rtol=1e-4)
    names = set(student.state_dict())
    assert fold_lora(student) == 6
    with torch.no_grad():
        folded = student(ids)
    torch.testing.assert_close(folded, adapted, atol=2e-5, rtol=1e-5)
    assert not any(has_lora(m) or m._forward_hooks for m in student.modules())
    assert set(student.state_dict()) == {n for n in names if not n.endswith(("lora_a", "lora_b"))}
    assert fold_lora(student) == 0


def test_healing_with_mlp_adapters_moves_attention_and_low_rank_mlp_updates_only():
    teacher, student = tiny_pair()
    _, attention_only = tiny_pair()
    before = {k: v.clone() for k, v in student.state_dict().items()}
    kl_before = mean_kl(student, teacher, TRAIN_IDS[:128], window=32)
    kw = dict(steps=12, lr=3e-3, seq_len=32, batch_size=2, progress=False)
    res = heal(student, teacher, TRAIN_IDS, train="attention+mlp-lora", **kw)
    heal(attention_only, teacher, TRAIN_IDS, train="attention", **kw)
    after = student.state_dict()
    assert set(after) == set(before)  # folded: no adapter tensors left, nothing renamed
    assert not any(has_lora(m) or m._forward_hooks for m in student.modules())
    assert all(p.requires_grad for p in student.parameters()) and not student.training
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    attention = {k for k in before if any(f".{p}_proj." in k for p in "qkvo")}
    mlp = {k for k in before if ".mlp." in k}
    assert changed == attention | mlp, changed ^ (attention | mlp)
    for k in mlp:  # (64, 48) or (48, 64) weights, each moved by (alpha / r) B A: rank <= r
        rank = torch.linalg.matrix_rank((after[k] - before[k]).double(), rtol=1e-6)
        assert 1 <= rank <= MLP_LORA_RANK, (k, rank)
    n_attention = sum(before[k].numel() for k in attention)
    n_adapters = sum(MLP_LORA_RANK * sum(before[k].shape) for k in mlp)
    assert res.trained_parameters == n_attention + n_adapters
    assert mean_kl(student, teacher, TRAIN_IDS[:128], window=32) < 0.8 * kl_before
    # the adapters' update is real: the attention-only run from the same start ends elsewhere
    assert not torch.allclose(attention_only.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                              after["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip


def test_a_failed_heal_leaves_no_adapters():
    teacher, student = tiny_pair()
    names = set(student.state_dict())

    def fail(step: int, loss: float) -> None:
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        heal(student, teacher, TRAIN_IDS, steps=6, seq_len=32, train="attention+mlp-lora", progress=False,
             callback=fail)  # fmt: skip
    assert set(student.state_dict()) == names and not any(m._forward_hooks for m in student.modules())
    with pytest.raises(ValueError, match="already has a LoRA adapter"):
        add_lora(student)
        add_lora(student)
    with pytest.raises(ValueError, match="LoRA rank must be an int >= 1, got 0"):
        add_lora(student, rank=0)
