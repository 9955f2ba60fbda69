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
    Hkv = kp.shape[1]
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


@pytest.mark.parametrize("formats", [(None, "q8_0"), ("q4_1", "q4_0")], ids=["float-q8_0", "q4_1-q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_paged_equals_the_dense_step_on_ragged_rows(dtype, formats):
    """``gqa::decode_paged`` against ``gqa::decode_model`` on the same weights and tokens: rows of 5 to 300
    cached tokens in shuffled blocks of 7 slots vs left-padded dense caches, float and q8_0/q4_1/q4_0 layers; logits
    and the new K/V agree (to the rounding of a differently split softmax), and the paged row results do not depend on
    the batch (each row alone gives the same bits: a compiler that fuses a multiply-add in one batch width's loop and
    not in another's once broke that for q4_1)."""
    from helpers.step_weights import random_layers

    g = torch.Generator().manual_seed(3)
    E, F, Hq, Hkv, D, V, block = 192, 288, 6, 2, 16, 300, 7
    lengths = [5, 17, 300, 40, 9, 2]  # 4 + 2 rows: the GEMVs' 4-row and 2-row loops
    B, C = len(lengths), max(lengths) + 1
    layers = random_layers(g, dtype, list(formats), E, F, Hq, Hkv, D, biases=True)
    M = -(-C // block)
    ids = torch.randperm(B * M + 3, generator=g)[: B * M].view(B, M).contiguous()
    pools, dense = [], []
    for _ in layers:
        k = torch.randn(B * M + 3, Hkv, block, D, generator=g).to(dtype)
        v = torch.randn(B * M + 3, Hkv, block, D, generator=g).to(dtype)
        kd, vd = torch.zeros(B, Hkv, C + 1, D, dtype=dtype), torch.zeros(B, Hkv, C + 1, D, dtype=dtype)
        for b, n in enumerate(lengths):  # row b's slots [0, n) left-padded into [C - n, C)
            kd[b, :, C - n : C] = k[ids[b]].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :n]
            vd[b, :, C - n : C] = v[ids[b]].permute(1, 0, 2, 3).reshape(Hkv, -1, D)[:, :n]
        pools.append((k, v))
        dense.append((kd, vd))
    x = torch.randn(B, E, generator=g).to(dtype)
    angle = torch.tensor(lengths, dtype=torch.float32)[:, None] * torch.linspace(0.01, 1.0, D // 2)[None]
    cos, sin = angle.cos().repeat(1, 2).contiguous(), angle.sin().repeat(1, 2).contiguous()
    weights = [w for _, ws, _, _ in layers for w in ws]
    formats = [c for _, _, cs, _ in layers for c in cs]
    biases = [bb for *_, bs in layers for bb in bs]
    norms1, norms2 = [n[0] for n, *_ in layers], [n[1] for n, *_ in layers]
    final, head = torch.ones(E, dtype=dtype), torch.randn(V, E, generator=g).to(dtype)
    common = (cos, sin)
    tail = (D**-0.5, final, 1e-5, head, -1)
    starts = [torch.tensor([C - n for n in lengths]) for _ in layers]
    cursors = [torch.tensor(C) for _ in layers]
    want = torch.ops.gqa.decode_model(x, norms1, norms2, 1e-5, weights, formats, biases, *common,
                                      [k for k, _ in dense], [v for _, v in dense], starts, cursors, *tail)  # fmt: skip
    positions = torch.tensor(lengths)
    got = torch.ops.gqa.decode_paged(x, norms1, norms2, 1e-5, weights, formats, biases, *common,
                                     [k for k, _ in pools], [v for _, v in pools], ids, positions, *tail)  # fmt: skip
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = want.float().std().item()  # logits of ~10: bf16 rounds them to 1/16-1/8, through two layers
    torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=tol)
    for (k, v), (kd, vd) in zip(pools, dense, strict=True):
        for b, n in enumerate(lengths):  # the new token's K/V at slot n of row b
            torch.testing.assert_close(k[ids[b, n // block], :, n % block].float(), kd[b, :, C].float(), atol=tol,
                                       rtol=tol)  # fmt: skip
            torch.testing.assert_close(v[ids[b, n // block], :, n % block].float(), vd[b, :, C].float(), atol=tol,
                                       rtol=tol)  # fmt: skip
    for b in range(B):  # each row alone: the same bits (its K/V written again, to the same values)
        alone = torch.ops.gqa.decode_paged(
            x[b : b + 1], norms1, norms2, 1e-5, weights, formats, biases, cos[b : b + 1], sin[b : b + 1],
            [k for k, _ in pools], [v for _, v in pools], ids[b : b + 1], positions[b : b + 1], *tail,
        )  # fmt: skip
        assert torch.equal(alone[0], got[b])


@pytest.mark.parametrize("formats", [(None, "q8_0"), ("q4_1", "q4_0")], ids=["float-q8_0", "q4_1-q4_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_paged_takes_a_prompt_as_rows_and_gives_logits_for_the_rows_asked(dtype, formats):
    """A prompt of 13 tokens fed as 13 rows of one call (its block table row repeated, positions 0..12), beside a
    decode row of another sequence: every prompt row sees the rows before it, so the call leaves the same K/V bits
    and the same last-row logits as feeding the prompt a token per call; ``logit_rows`` gives those rows' logits
    (bit for bit the rows of the full result) and greedy picks, in the order asked; bad rows are refused."""
    from helpers.step_weights import random_layers

    g = torch.Generator().manual_seed(5)
    E, F, Hq, Hkv, D, V, block, L = 160, 224, 6, 2, 16, 257, 5, 13
    layers = random_layers(g, dtype, list(formats), E, F, Hq, Hkv, D, biases=True)
    weights = [w for _, ws, _, _ in layers for w in ws]
    formats_ = [c for _, _, cs, _ in layers for c in cs]
    biases = [bb for *_, bs in layers for bb in bs]
    norms1, norms2 = [n[0] for n, *_ in layers], [n[1] for n, *_ in layers]
    final, head = torch.ones(E, dtype=dtype), torch.randn(V, E, generator=g).to(dtype)
    tail = (D**-0.5, final, 1e-5, head, -1)
    prompt = torch.randn(L, E, generator=g).to(dtype)
    other = torch.randn(1, E, generator=g).to(dtype)  # a decode row at position 30 of a second sequence
    table = torch.tensor([[7, 2, 9, 0, 4, 11, 1], [3, 5, 6, 8, 10, 12, 13]])
    fresh = [tuple(torch.randn(14, Hkv, block, D, generator=g).to(dtype) for _ in "kv") for _ in layers]

    def rope(positions):
        angle = positions.float()[:, None] * torch.linspace(0.01, 1.0, D // 2)[None]
        return angle.cos().repeat(1, 2).contiguous(), angle.sin().repeat(1, 2).contiguous()

    def call(x, rows, positions, pools, **kw):
        return torch.ops.gqa.decode_paged(x, norms1, norms2, 1e-5, weights, formats_, biases, *rope(positions),
                                          [k for k, _ in pools], [v for _, v in pools], table[rows].contiguous(),
                                          positions, *tail, **kw)  # fmt: skip

    one = [(k.clone(), v.clone()) for k, v in fresh]
    steps = [call(prompt[i : i + 1], [0], torch.tensor([i]), one) for i in range(L)]
    call(other, [1], torch.tensor([30]), one)
    batch = [(k.clone(), v.clone()) for k, v in fresh]
    x = torch.cat([other, prompt])
    rows, positions = [1] + [0] * L, torch.tensor([30, *range(L)])
    full = call(x, rows, positions, batch)
    for (k1, v1), (kb, vb) in zip(one, batch, strict=True):
        assert torch.equal(k1, kb) and torch.equal(v1, vb)
    assert torch.equal(full[L], steps[-1][0]) and torch.equal(full[5], steps[4][0])
    assert not torch.equal(full[L], full[L - 1])
    again = [(k.clone(), v.clone()) for k, v in fresh]
    greedy = torch.empty(3, dtype=torch.long)
    picked = call(x, rows, positions, again, greedy=greedy, logit_rows=torch.tensor([L, 0, 5]))
    assert picked.shape == (3, V) and torch.equal(picked, full[[L, 0, 5]])
    assert torch.equal(greedy, full[[L, 0, 5]].argmax(-1))
    for bad, message in (([L + 1], "is not a row of x"), ([-1], "is not a row of x")):
        with pytest.raises(RuntimeError, match=message):
            call(x, rows, positions, again, logit_rows=torch.tensor(bad))
    with pytest.raises(RuntimeError, match="greedy must be"):
        call(x, rows, positions, again, greedy=torch.empty(L + 1, dtype=torch.long), logit_rows=torch.tensor([0]))
