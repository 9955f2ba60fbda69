"""The paged decode kernels (``gqa::paged_attention``, ``gqa::decode_paged``) against independent references: float64
attention over K/V gathered from shuffled block tables, and the dense one-call step on the same weights and tokens."""

from __future__ import annotations

import pytest
import torch

from gqa import kernels

pytestmark = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")


def paged_case(g: torch.Generator, B, Hq, Hkv, D, Dv, block, lengths, dtype, spare_blocks=5):
    """q (B, H_q, D), pools (N, H_kv, block, D|Dv) filled with noise, a shuffled block table (B, M) and the lengths."""
    M = max(1, max(-(-n // block) for n in lengths))
    N = B * M + spare_blocks
    ids = torch.randperm(N, generator=g)[: B * M].view(B, M)  # every row's blocks scattered through the pool
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    kp = torch.randn(N, Hkv, block, D, generator=g).to(dtype)
    vp = torch.randn(N, Hkv, block, Dv, generator=g).to(dtype)
    return q, kp, vp, ids.long().contiguous(), torch.tensor(lengths, dtype=torch.long)


def reference(q, kp, vp, table, lengths, scale) -> torch.Tensor:
    """Float64 attention of each row over its gathered slots, the K/V heads repeated for the reference only."""
    B, Hq, _ = q.shape
    Hkv, block = kp.shape[1], kp.shape[2]
    out = torch.zeros(B, Hq, vp.shape[-1], dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        k = kp[table[b]].double().permute(1, 0, 2, 3).reshape(Hkv, -1, kp.shape[-1])[:, :n]  # (H_kv, n, D)
        v = vp[table[b]].double().permute(1, 0, 2, 3).reshape(Hkv, -1, vp.shape[-1])[:, :n]
        k, v = k.repeat_interleave(Hq // Hkv, 0), v.repeat_interleave(Hq // Hkv, 0)
        w = torch.softmax((q[b].double().unsqueeze(1) @ k.transpose(1, 2)) * scale, -1)  # (H_q, 1, n)
        out[b] = (w @ v).squeeze(1)
    assert block >= 1
    return out


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("Hq", "Hkv", "D", "Dv", "block", "lengths"),
    [
        (18, 6, 5, 7, 3, [7, 1, 0, 11]),  # odd dims, tiny blocks, an empty row, lengths ending mid-block
        (9, 3, 64, 64, 16, [700, 33, 16, 1]),  # SmolLM2's heads, several 256-key splits
        (8, 1, 16, 16, 64, [300, 129]),  # MQA, chunks as long as a block
        (4, 4, 8, 8, 5, [600, 601]),  # MHA, a block size that divides neither 64 nor 256
    ],
)
def test_paged_attention_matches_float64_over_shuffled_blocks(dtype, Hq, Hkv, D, Dv, block, lengths):
    g = torch.Generator().manual_seed(len(lengths) * 1000 + block)
    q, kp, vp, table, n = paged_case(g, len(lengths), Hq, Hkv, D, Dv, block, lengths, dtype)
    scale = D**-0.5
    out = torch.ops.gqa.paged_attention(q, kp, vp, table, n, scale)
    assert out.dtype == dtype and out.shape == (len(lengths), Hq, Dv)
    torch.testing.assert_close(out.double(), reference(q, kp, vp, table, n, scale), atol=TOL[dtype], rtol=TOL[dtype])
    if 0 in lengths:
        assert out[lengths.index(0)].abs().sum() == 0  # a row that sees nothing: zeros, not NaN


def test_paged_attention_reads_only_the_listed_blocks():
    """Blocks outside a row's table (and slots past its length) may hold anything, NaN included."""
    g = torch.Generator().manual_seed(0)
    q, kp, vp, table, n = paged_case(g, 3, 6, 2, 8, 8, 4, [5, 9, 2], torch.float32)
    expected = torch.ops.gqa.paged_attention(q, kp, vp, table, n, 0.3)
    used = torch.zeros(kp.shape[0], kp.shape[2], dtype=torch.bool)
    for b in range(3):
        for j in range(int(n[b])):
            used[table[b, j // 4], j % 4] = True
    kp[~used.unsqueeze(1).expand(-1, 2, -1)] = float("nan")  # (N, H_kv, block) slots nobody reads
    vp[~used.unsqueeze(1).expand(-1, 2, -1)] = float("nan")
    assert torch.equal(torch.ops.gqa.paged_attention(q, kp, vp, table, n, 0.3), expected)


def test_a_row_does_not_depend_on_the_rest_of_the_batch():
    """Each row of a batch gives bit for bit what it gives alone: the splits of a paged context are fixed."""
    g = torch.Generator().manual_seed(1)
    q, kp, vp, table, n = paged_case(g, 5, 9, 3, 64, 64, 16, [900, 17, 300, 1, 513], torch.float32)
    batched = torch.ops.gqa.paged_attention(q, kp, vp, table, n, 0.125)
    for b in range(5):
        alone = torch.ops.gqa.paged_attention(q[b : b + 1], kp, vp, table[b : b + 1], n[b : b + 1], 0.125)
        assert torch.equal(alone[0], batched[b])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(table=a["table"].int()), "block_table must be a contiguous int64"),
        (lambda a: a.update(lengths=a["lengths"] + 100), "does not fit its"),
        (lambda a: a["table"].__setitem__((0, 0), 99), r"row 0 block 0 is 99, not in \[0, "),
        (lambda a: a["table"].__setitem__((1, 0), -1), "row 1 block 0 is -1"),
        (lambda a: a.update(lengths=a["lengths"][:1]), "lengths must be a contiguous int64 \\(B,\\)"),
        (lambda a: a.update(q=a["q"][:, :5]), "H_q = 5 is not a multiple of H_kv = 2"),
        (lambda a: a.update(q=a["q"].double()), "must share a dtype"),
    ],
)
def test_paged_attention_refuses_bad_tables_clearly(change, message):
    g = torch.Generator().manual_seed(2)
    q, kp, vp, table, n = paged_case(g, 2, 6, 2, 8, 8, 4, [5, 3], torch.float32)
    args = {"q": q, "table": table, "lengths": n}
    change(args)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.gqa.paged_attention(args["q"], kp, vp, args["table"], args["lengths"], 1.0)
