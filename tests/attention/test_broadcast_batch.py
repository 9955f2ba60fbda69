"""Batch dims that broadcast between query and key/value, as torch SDPA and transformers' sdpa function allow them
(e.g. learned queries of batch 1 against K/V of batch N): right against a float64 reference on the expanded
tensors, K/V never copied (peak memory), the kernels that need one batch refusing by name, and the HF integration
agreeing with transformers' own sdpa function."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.reference import attention64
from torch import nn

import gqa

SHAPES = [  # (query batch, key/value batch)
    ((1,), (3,)),  # learned queries
    ((4,), (1,)),  # one shared K/V for every query row: folded into the rows
    ((2, 1), (1, 3)),  # both sides broadcast
    ((), ()),  # no batch dims at all (no broadcast): the plain path still right
]


def expand(t: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    return t.expand(*batch, *t.shape[-3:])


@pytest.mark.parametrize("q_batch, kv_batch", SHAPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_broadcast_matches_reference(q_batch, kv_batch, is_causal, with_mask):
    g = torch.Generator().manual_seed(len(q_batch) + 10 * is_causal)
    H_q, H_kv, L, S, D = 18, 6, 3, 7, 5
    q = torch.randn(*q_batch, H_q, L, D, generator=g)
    k, v = (torch.randn(*kv_batch, H_kv, S, D, generator=g) for _ in range(2))
    batch = torch.broadcast_shapes(q_batch, kv_batch)
    mask = torch.rand(*batch, 1, L, S, generator=g) > 0.3 if with_mask else None
    out, weights = gqa.grouped_attention(q, k, v, mask, is_causal=is_causal, return_weights=True)
    ref, ref_w = attention64(expand(q, batch), expand(k, batch), expand(v, batch), mask, is_causal=is_causal)
    assert out.shape == (*batch, H_q, L, D) and weights.shape == (*batch, H_q, L, S)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.double(), ref_w, atol=1e-5, rtol=1e-5)
    plain = gqa.grouped_attention(q, k, v, mask, is_causal=is_causal)
    if q_batch != kv_batch:
        assert gqa.last_backend() == "grouped"  # the matmuls broadcast as views; the kernels want one batch
    torch.testing.assert_close(plain.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        gqa.grouped_attention(q, k, v, mask, is_causal=is_causal, backend="reference").double(), ref, atol=1e-5,
        rtol=1e-5,
    )  # fmt: skip


def test_broadcast_gradients_match_the_expanded_call():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, 2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 2, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda *t: gqa.grouped_attention(*t, is_causal=True), (q, k, v))


@pytest.mark.parametrize("backend", ["sdpa", "fused", "triton"])
def test_kernels_that_need_one_batch_refuse_by_name(backend, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # its checks then take CPU tensors; it refuses before running
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    with pytest.raises(ValueError, match="broadcast"):
        gqa.grouped_attention(q, k, v, backend=backend)


def test_batch_dims_that_do_not_broadcast_are_refused():
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 8)
    with pytest.raises(ValueError, match=r"batch dims do not broadcast: query \(2, 4, 1, 8\), key \(3, 2, 5, 8\)"):
        gqa.grouped_attention(q, k, v)


SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch, gqa
    torch.manual_seed(0)
    q = torch.randn(16, 8, int(sys.argv[1]), 64)  # 16 query rows against one shared K/V of 16 MiB each
    k = torch.randn(1, 1, 65536, 64)
    v = torch.randn(1, 1, 65536, 64)
    gqa.grouped_attention(q[:, :, :1], k[..., :8, :], v[..., :8, :])  # warm up lazy init
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.inference_mode():
        out = gqa.grouped_attention(q, k, v)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)  # MiB
    """
)


@pytest.mark.parametrize("L", [1, 2])
def test_shared_kv_is_not_copied_per_query_row(L):
    """Broadcasting K/V of batch 1 to 16 query rows in a matmul would copy them 16 times (2 x 16 x 16 MiB)."""
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(L)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    grown = int(res.stdout.split()[-1])
    scores = 16 * 8 * L * 65536 * 4 / 2**20  # fp32 scores and weights of the call itself
    assert grown < 2 * scores + 64, f"peak RSS grew {grown} MiB; a copy of K/V per row is 512 MiB"


class FakeAttention(nn.Module):
    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def test_hf_function_broadcasts_a_batch_1_query_as_transformers_sdpa_does():
    hf_sdpa = pytest.importorskip("transformers.integrations.sdpa_attention")
    import gqa.integrations.hf

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 6, 4, 8, generator=g)  # learned queries, batch 1
    k, v = (torch.randn(3, 2, 9, 8, generator=g) for _ in range(2))
    mask = torch.rand(3, 1, 4, 9, generator=g) > 0.3
    mask[..., -1] = True  # no empty row (torch SDPA gives NaN there, gqa zeros)
    module = FakeAttention(groups=3).eval()
    for m in (None, mask):
        ref, _ = hf_sdpa.sdpa_attention_forward(module, q, k, v, m, dropout=0.0, scaling=0.3, is_causal=False)
        out, _ = gqa.integrations.hf.gqa_attention_forward(
            module, q, k, v, m, dropout=0.0, scaling=0.3, is_causal=False
        )
        assert out.shape == ref.shape == (3, 4, 6, 8)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
