"""The Triton split-KV decode kernel (``gqa.kernels.triton.split_kv``), run on CPU tensors by Triton's interpreter.

Compared against a float64 oracle written here with plain torch. bfloat16 does not run in the interpreter: float32
and float16 only. Each kernel call takes ~0.1-1 s there, so the shapes are small and few.

The interpreter is a process-wide switch: ``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported,
because ``triton.jit`` decides at decoration time, for triton's own ``tl.max``/``tl.sum`` as well as for our kernels.
``import gqa`` already imports triton (through ``torch._dynamo``), so by the time pytest collects this module another
test module has usually imported it compiled, and setting the variable here would come too late — and would leak into
every later test of the session (on a GPU machine ``tests/decoding/test_gpu.py`` would run interpreted). So the kernel
tests run here only in a process started with ``TRITON_INTERPRET=1``; otherwise they are skipped and
``test_kernel_tests_in_interpreter_process`` runs this file in such a process. Directly:
``TRITON_INTERPRET=1 python -m pytest tests/test_split_kv.py``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the split-KV kernel cannot run", allow_module_level=True)

import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

import gqa
from gqa.cache.kv_dtypes import KV_DTYPES
from gqa.cache.quantize import quantize
from gqa.kernels.triton.split_kv import (
    DEFAULT_CONFIG,
    MIN_CHUNK,
    SHARED_MEMORY_HEADROOM,
    config_for,
    pipeline_bytes,
    plan_splits,
    split_kv_attention,
    supports,
)
from tests.helpers.kv_blocks import stored_as

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and isinstance(tl.max, InterpretedFunction)
CHILD = "GQA_TEST_SPLIT_KV_CHILD"  # set in the process test_kernel_tests_in_interpreter_process starts
if os.environ.get(CHILD) and not INTERPRETED:  # never start a process from that process
    raise RuntimeError("TRITON_INTERPRET=1 was set, yet triton is not interpreting: imported before it was set?")

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),  # numpy in the interpreter:
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),  # -inf - -inf, log(0) of
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),  # rows that see nothing, NaN rows
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),  # scores over a tiny soft-cap: +-inf
]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def test_kernel_tests_in_interpreter_process():
    """Runs this file where triton interprets, so that the kernel tests run (only defined in such a process)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", CHILD: "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    summary = re.findall(r"(\d+) (passed|skipped|failed|error)", tail.strip().splitlines()[-1])
    counts = {word: int(n) for n, word in summary}
    assert "skipped" not in counts and counts.get("passed", 0) > 100, tail


def kernel(test):
    """Marks a test that runs the kernel: defined only in a process where triton interprets (end of the module)."""
    test.runs_kernel = True
    return test


@pytest.fixture(autouse=True)
def _interpret_env(monkeypatch):
    """``supports`` reads ``TRITON_INTERPRET`` per call: on for every test here (refusals get past the device check)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# the oracle -----------------------------------------------------------------------------------------------------


def reference(q, k, v, *, scale=None, is_causal=False, mask=None, start=None, end=None, window=None, softcap=None,
              sinks=None):  # fmt: skip
    """float64 attention: ``(B, H_kv, G, L, D)`` einsums, visibility as explicit boolean masks, empty rows -> 0;
    ``window (left, right)`` around ``end - L + l``, ``softcap`` on the scaled scores, ``sinks (H_q,)`` as one more
    key of value zero per head."""
    *batch, H_q, L, D = q.shape
    H_kv, S, D_v = k.shape[-3], k.shape[-2], v.shape[-1]
    G, N = H_q // H_kv, math.prod(batch)
    qq = q.double().reshape(N, H_kv, G, L, D)
    kk = k.double().reshape(N, H_kv, S, D)
    vv = v.double().reshape(N, H_kv, S, D_v)
    scores = torch.einsum("nhgld,nhsd->nhgls", qq, kk) * (D**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)

    def per_row(t, default):
        t = torch.full((N,), default, dtype=torch.int64) if t is None else torch.as_tensor(t).long()
        return t.expand(N).reshape(N, 1, 1, 1, 1)

    j = torch.arange(S).reshape(1, 1, 1, 1, S)
    row = torch.arange(L).reshape(1, 1, 1, L, 1)
    lo, hi = per_row(start, 0), per_row(end, S).clamp(max=S)
    visible = (j >= lo) & (j < hi)
    if is_causal:
        visible = visible & (j <= hi - L + row)
    if window is not None:
        left, right = window
        if left is not None:
            visible = visible & (j >= hi - L + row - left)
        if right is not None:
            visible = visible & (j <= hi - L + row + right)
    if mask is not None:
        m = mask.expand(*batch, H_q, L, S).reshape(N, H_kv, G, L, S)
        if m.dtype == torch.bool:
            visible = visible & m
        else:
            scores = scores + m.double()
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:  # one more key, of value zero
        sink = sinks.double().view(1, H_kv, G, 1, 1).expand(N, H_kv, G, L, 1)
        weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :S]
    else:
        any_key = ~(scores == float("-inf")).all(-1, keepdim=True)  # NaN scores count as seen
        weights = torch.softmax(scores.masked_fill(~any_key, 0.0), -1) * any_key
    out = torch.einsum("nhgls,nhsd->nhgld", weights, vv)
    return out.reshape(*batch, H_q, L, D_v)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def check(out, ref, dtype):
    assert out.dtype == dtype
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], err


def qkv(batch, H_q, H_kv, L, S, D, D_v=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, H_q, L, D, generator=g).to(dtype)
    k = torch.randn(*batch, H_kv, S, D, generator=g).to(dtype)
    v = torch.randn(*batch, H_kv, S, D if D_v is None else D_v, generator=g).to(dtype)
    return q, k, v


def test_oracle_sanity():
    """The oracle itself: one key -> its value; causal L == S first row sees key 0 only; an empty row is 0."""
    q, k, v = qkv((1,), 2, 1, 3, 3, 4, dtype=torch.float64)
    out = reference(q, k, v, is_causal=True)
    torch.testing.assert_close(out[0, :, 0], v[0, 0, 0].expand(2, 4))
    assert reference(q, k, v, end=torch.tensor(0)).abs().sum() == 0
    w = torch.softmax((q @ k.transpose(-1, -2)) * 0.5, -1)
    torch.testing.assert_close(reference(q, k, v), w @ v)


# shapes, splits and dtypes --------------------------------------------------------------------------------------

SHAPES = {
    # id: (batch, H_q, H_kv, L, S, D, D_v, is_causal, num_splits)
    "nobatch-causal": ((), 18, 6, 3, 150, 40, None, True, None),
    "batch1-3splits": ((1,), 18, 6, 3, 257, 40, None, False, 3),
    "batch2-L1-1split": ((2, 2), 18, 6, 1, 120, 40, None, True, 1),
    "default-splits-S300": ((1,), 18, 6, 1, 300, 40, None, True, None),
    "mha": ((2,), 4, 4, 3, 100, 40, None, True, 3),
    "mqa": ((2,), 8, 1, 1, 200, 40, None, False, None),
    "mqa-96rows": ((1,), 32, 1, 3, 130, 40, None, True, 3),
    "dv-ne-d": ((1,), 4, 2, 3, 100, 40, 24, True, 3),
    "d256": ((1,), 4, 2, 2, 100, 256, None, True, None),
    "L-gt-S-causal": ((1,), 6, 2, 5, 3, 40, None, True, None),
    "L16": ((1,), 4, 1, 16, 100, 40, None, True, 3),
}


@kernel
@pytest.mark.parametrize("case", list(SHAPES), ids=list(SHAPES))
def test_matches_reference(case):
    batch, H_q, H_kv, L, S, D, D_v, causal, splits = SHAPES[case]
    q, k, v = qkv(batch, H_q, H_kv, L, S, D, D_v)
    out = split_kv_attention(q, k, v, is_causal=causal, num_splits=splits)
    ref = reference(q, k, v, is_causal=causal)
    check(out, ref, torch.float32)
    if case == "L-gt-S-causal":  # rows l < L - S see no key: exactly zero
        assert (out[..., : L - S, :] == 0).all()
        assert (out[..., L - S :, :] != 0).any()


@kernel
@pytest.mark.parametrize("case", ["nobatch-causal", "batch2-L1-1split", "mqa-96rows", "d256"])
def test_matches_reference_float16(case):
    batch, H_q, H_kv, L, S, D, D_v, causal, splits = SHAPES[case]
    q, k, v = qkv(batch, H_q, H_kv, L, S, D, D_v, dtype=torch.float16, seed=1)
    out = split_kv_attention(q, k, v, is_causal=causal, num_splits=splits)
    check(out, reference(q, k, v, is_causal=causal), torch.float16)


@kernel
def test_splits_agree_and_scale():
    q, k, v = qkv((1,), 6, 2, 2, 200, 40, seed=2)
    ref = reference(q, k, v, scale=0.37)
    outs = [split_kv_attention(q, k, v, scale=0.37, num_splits=n) for n in (1, 7)]
    for out in outs:
        check(out, ref, torch.float32)
    assert rel_err(split_kv_attention(q, k, v, num_splits=7), ref) > 1e-2  # the scale matters


@kernel
def test_split_entirely_beyond_end():
    """4 splits of 50 keys, ``end`` 70 / 60: splits 2 and 3 see nothing and must not disturb the merge."""
    q, k, v = qkv((2,), 6, 2, 3, 200, 40, seed=3)
    end = torch.tensor([70, 60])
    start = torch.tensor([0, 20])
    out = split_kv_attention(q, k, v, is_causal=True, start=start, end=end, num_splits=4)
    check(out, reference(q, k, v, is_causal=True, start=start, end=end), torch.float32)


def test_bad_num_splits():
    q, k, v = qkv((1,), 2, 1, 1, 10, 8)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="num_splits"):
            split_kv_attention(q, k, v, num_splits=bad)


# causal, masks, start/end ---------------------------------------------------------------------------------------


@kernel
def test_causal_with_scalar_end():
    """A 0-dim ``end``: row ``l`` sees keys ``j <= end - L + l``; keys at and after ``end`` are ignored."""
    q, k, v = qkv((2,), 6, 2, 3, 120, 40, seed=4)
    end = torch.tensor(90)
    out = split_kv_attention(q, k, v, is_causal=True, end=end, num_splits=2)
    check(out, reference(q, k, v, is_causal=True, end=end), torch.float32)
    k2, v2 = k.clone(), v.clone()
    k2[..., 90:, :] = float("nan")  # beyond the cursor: never read into the result
    v2[..., 90:, :] = float("nan")
    torch.testing.assert_close(split_kv_attention(q, k2, v2, is_causal=True, end=end, num_splits=2), out)


def _bool_mask(kind, B, H_q, L, S, g):
    if kind == "S":
        return torch.rand(S, generator=g) > 0.3
    if kind == "B11S":
        return torch.rand(B, 1, 1, S, generator=g) > 0.5
    m = torch.rand(B, H_q, L, S, generator=g) > 0.5
    m[1, 5, 2] = False  # one row sees nothing
    return m


@kernel
@pytest.mark.parametrize("kind", ["S", "B11S", "BHLS"])
def test_bool_mask(kind):
    B, H_q, H_kv, L, S = 2, 18, 6, 3, 130
    q, k, v = qkv((B,), H_q, H_kv, L, S, 40, seed=5)
    mask = _bool_mask(kind, B, H_q, L, S, torch.Generator().manual_seed(5))
    out = split_kv_attention(q, k, v, attn_mask=mask, is_causal=kind == "B11S", num_splits=3)
    ref = reference(q, k, v, mask=mask, is_causal=kind == "B11S")
    check(out, ref, torch.float32)
    if kind == "BHLS":
        assert (out[1, 5, 2] == 0).all()
        assert (out[1, 5, 1] != 0).any()


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_additive_mask_with_neg_inf(dtype):
    B, H_q, H_kv, L, S = 2, 6, 2, 3, 150
    q, k, v = qkv((B,), H_q, H_kv, L, S, 40, dtype=dtype, seed=6)
    g = torch.Generator().manual_seed(6)
    mask = torch.randn(B, 1, L, S, generator=g)
    mask[torch.rand(B, 1, L, S, generator=g) > 0.6] = float("-inf")
    mask[0, 0, 1] = float("-inf")  # row l=1 of batch 0 sees nothing, in every head
    mask = mask.to(dtype)
    out = split_kv_attention(q, k, v, attn_mask=mask, num_splits=2)
    ref = reference(q, k, v, mask=mask)
    check(out, ref, dtype)
    assert (out[0, :, 1] == 0).all()
    assert (out[1, :, 1] != 0).any()
    assert rel_err(out, reference(q, k, v)) > 1e-2  # the mask matters


@kernel
def test_ragged_start_end():
    """Left padding and per-row cursors (int32), with causal and a mask; one row whose window is empty."""
    B, H_q, H_kv, L, S = 4, 6, 2, 2, 140
    q, k, v = qkv((B,), H_q, H_kv, L, S, 40, seed=7)
    start = torch.tensor([0, 5, 40, 100], dtype=torch.int32)
    end = torch.tensor([140, 130, 77, 100], dtype=torch.int32)
    mask = torch.rand(B, 1, 1, S, generator=torch.Generator().manual_seed(7)) > 0.2
    out = split_kv_attention(q, k, v, is_causal=True, attn_mask=mask, start=start, end=end, num_splits=3)
    check(out, reference(q, k, v, is_causal=True, mask=mask, start=start, end=end), torch.float32)
    assert (out[3] == 0).all()
    assert (out[:3] != 0).any(-1).all()


@kernel
def test_bad_start_end():
    q, k, v = qkv((2,), 2, 1, 1, 10, 8)
    with pytest.raises(ValueError, match="start"):
        split_kv_attention(q, k, v, start=torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="end"):
        split_kv_attention(q, k, v, end=torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(TypeError, match="start"):
        split_kv_attention(q, k, v, start=torch.zeros(2))


# window, soft-cap, sinks ---------------------------------------------------------------------------------------

VARIANTS = {
    # id: (batch, H_q, H_kv, L, S, D, is_causal, window, softcap, sinks, num_splits, start/end)
    "left-causal-3splits": ((2,), 18, 6, 3, 700, 40, True, (100, None), None, False, 3, False),
    "left-default-splits": ((1,), 18, 6, 1, 3000, 40, True, (600, None), None, False, None, False),
    "left-right-no-causal": ((2,), 6, 2, 4, 150, 16, False, (20, 2), None, False, 2, False),
    "left0": ((1,), 4, 2, 3, 100, 16, True, (0, None), None, False, None, False),
    "right-only": ((1,), 4, 2, 3, 6, 16, False, (None, 0), None, False, 2, False),
    "window-larger-than-S": ((1,), 4, 2, 2, 50, 16, True, (500, 600), None, False, None, False),
    "left-ragged-rows": ((3,), 6, 2, 2, 400, 16, True, (64, None), None, False, 2, True),
    "softcap": ((2,), 18, 6, 3, 300, 40, True, None, 5.0, False, 3, False),
    "softcap-1split": ((1,), 18, 6, 1, 100, 40, True, None, 0.7, False, 1, False),
    "sinks-3splits": ((2,), 18, 6, 3, 300, 40, True, None, None, True, 3, False),
    "sinks-1split": ((1,), 18, 6, 1, 100, 5, True, None, None, True, 1, False),
    "all-ragged": ((3,), 6, 2, 2, 400, 16, True, (64, None), 20.0, True, None, True),
    "d256-all": ((1,), 4, 2, 2, 120, 256, True, (30, None), 50.0, True, 2, False),
}


HALF_VARIANTS = ("left-causal-3splits", "softcap", "sinks-3splits", "all-ragged")  # float16: a few (it is slow here)


@kernel
@pytest.mark.parametrize(
    ("case", "dtype"),
    [(c, torch.float32) for c in VARIANTS] + [(c, torch.float16) for c in HALF_VARIANTS],
    ids=[*VARIANTS, *(f"{c}-fp16" for c in HALF_VARIANTS)],
)
def test_window_softcap_sinks_match_reference(case, dtype):
    batch, H_q, H_kv, L, S, D, causal, window, softcap, with_sinks, splits, ragged = VARIANTS[case]
    q, k, v = qkv(batch, H_q, H_kv, L, S, D, dtype=dtype, seed=11)
    if dtype == torch.float32:
        q = q * 3  # scores large enough that the soft-cap bends them
    sinks = torch.randn(H_q, generator=torch.Generator().manual_seed(12)) * 2 + 7 if with_sinks else None
    bounds = {}
    if ragged:  # left padding and cursors: the window follows each row's cursor; row 2 is shorter than its window
        bounds = dict(start=torch.tensor([0, 50, 300])[: math.prod(batch)], end=torch.tensor([400, 333, 340]))
    out = split_kv_attention(q, k, v, is_causal=causal, window=window, softcap=softcap, sinks=sinks,
                             num_splits=splits, **bounds)  # fmt: skip
    ref = reference(q, k, v, is_causal=causal, window=window, softcap=softcap, sinks=sinks, **bounds)
    check(out, ref, dtype)
    plain = reference(q, k, v, is_causal=causal, **bounds)
    assert rel_err(out, plain) > 1e-2 or case == "window-larger-than-S"  # each option changes the answer


@kernel
def test_a_window_reads_only_its_keys():
    """Keys before each row's window (its cursor - L - left) are NaN: never read. 4,096 keys, a 100-key window."""
    q, k, v = qkv((2,), 6, 2, 2, 4096, 16, seed=13)
    end = torch.tensor([4096, 2500])
    ref = split_kv_attention(q, k, v, is_causal=True, window=100, end=end)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, : 4096 - 2 - 100] = float("nan")
    v2[0, :, : 4096 - 2 - 100] = float("nan")
    k2[1, :, : 2500 - 2 - 100] = float("nan")
    v2[1, :, : 2500 - 2 - 100] = float("nan")
    out = split_kv_attention(q, k2, v2, is_causal=True, window=100, end=end)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    check(out, reference(q, k, v, is_causal=True, window=(100, None), end=end), torch.float32)


@kernel
def test_sinks_take_weight_from_rows_that_see_nothing_and_from_the_rest():
    """A row that sees no key is zeros with a sink as without; a huge sink drives every row to zero."""
    q, k, v = qkv((1,), 4, 2, 2, 60, 16, seed=14)
    out = split_kv_attention(q, k, v, end=torch.tensor(0), sinks=torch.zeros(4))
    assert (out == 0).all()
    sinks = torch.tensor([float("-inf"), 0.5, float("-inf"), -1.0])  # a sink of -inf is no sink
    assert (split_kv_attention(q, k, v, end=torch.tensor(0), sinks=sinks) == 0).all()
    check(split_kv_attention(q, k, v, sinks=sinks, num_splits=2), reference(q, k, v, sinks=sinks), torch.float32)
    out = split_kv_attention(q, k, v, sinks=torch.full((4,), 80.0), num_splits=2)
    assert out.abs().max() < 1e-20


@kernel
def test_softcap_keeps_float32_accuracy_for_every_cap():
    """``cap * tanh(s / cap)`` to float32's rounding whatever the finite cap: ``(1 - e) / (1 + e)`` alone lost the
    scores' digits to cancellation near ``s / cap = 0`` (large caps); a cap beyond float32's range (inf in the
    kernel) leaves the scores as they are."""
    q, k, v = qkv((1,), 6, 2, 2, 100, 16, seed=16)
    q = q * 3
    for cap in (1e-300, 1e-2, 30.0, 1e4, 1e7, 1e39):
        out = split_kv_attention(q, k, v, softcap=cap, num_splits=2)
        ref = reference(q, k, v, softcap=cap)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-6, (cap, err)


@kernel
def test_grouped_attention_passes_window_softcap_sinks_to_the_kernel():
    """``grouped_attention(backend="triton")`` with every option: the float64 oracle; the window reaches the kernel as
    a window (the keys before it are trimmed on the host, then only the window's are read)."""
    q, k, v = qkv((2,), 18, 6, 3, 500, 40, seed=15)
    sinks = torch.randn(18, generator=torch.Generator().manual_seed(15)) + 4
    mask = torch.rand(2, 1, 1, 500, generator=torch.Generator().manual_seed(16)) > 0.2
    out = gqa.grouped_attention(q, k, v, mask, is_causal=True, window=(64, None), softcap=3.0, sinks=sinks,
                                backend="triton")  # fmt: skip
    assert gqa.last_backend() == "triton"
    ref = reference(q, k, v, mask=mask, is_causal=True, window=(64, None), softcap=3.0, sinks=sinks)
    check(out, ref, torch.float32)
    grad_sinks = sinks.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="sinks that require grad"):
        gqa.grouped_attention(q, k, v, sinks=grad_sinks, backend="triton")
    with torch.no_grad():
        out = gqa.grouped_attention(q, k, v, sinks=grad_sinks, backend="triton")
    check(out, reference(q, k, v, sinks=sinks), torch.float32)


def test_variant_arguments_are_checked():
    q, k, v = qkv((1,), 4, 2, 1, 32, 16)
    with pytest.raises(ValueError, match="window"):
        split_kv_attention(q, k, v, window=-1)
    with pytest.raises(ValueError, match="softcap"):
        split_kv_attention(q, k, v, softcap=0.0)
    with pytest.raises(ValueError, match="sinks"):
        split_kv_attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="sinks"):
        split_kv_attention(q, k, v, sinks=torch.zeros(4, dtype=torch.long))


# layouts, dtypes, NaN -------------------------------------------------------------------------------------------


@kernel
@pytest.mark.parametrize(
    ("dtype", "layout"), [(torch.float32, "transposed"), (torch.float16, "transposed"), (torch.float32, "every-other")]
)
def test_strided_inputs(dtype, layout):
    """K/V: ``[:, :, :S]`` views of a longer cache; query: ``(B, L, H, D).transpose(1, 2)``, or also a last dim of
    stride 2 (which the launcher copies)."""
    B, H_q, H_kv, L, S, S_max, D = 2, 18, 6, 3, 110, 192, 40
    g = torch.Generator().manual_seed(8)
    cache_k = torch.randn(B, H_kv, S_max, D, generator=g).to(dtype)
    cache_v = torch.randn(B, H_kv, S_max, D, generator=g).to(dtype)
    wide = 2 if layout == "every-other" else 1
    q = torch.randn(B, L, H_q, D * wide, generator=g).to(dtype)[..., ::wide].transpose(1, 2)
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    assert q.stride(-1) == wide
    out = split_kv_attention(q, k, v, is_causal=True)
    check(out, reference(q, k, v, is_causal=True), dtype)
    assert out.is_contiguous()


@kernel
@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_query_row(num_splits):
    q, k, v = qkv((2,), 6, 2, 3, 100, 40, seed=9)
    q[1, 4, 2, 7] = float("nan")
    out = split_kv_attention(q, k, v, num_splits=num_splits)
    bad = torch.zeros(out.shape[:-1], dtype=torch.bool)
    bad[1, 4, 2] = True
    assert out[bad].isnan().all()
    assert torch.isfinite(out[~bad]).all()
    ref = reference(q, k, v)
    assert rel_err(out[~bad], ref[~bad]) < TOL[torch.float32]


# a quantized cache: uint8 rows of q8_0 / q4_0 blocks or of fp8 e4m3 bytes ------------------------------------------

QUANTIZED = {
    # id: (K kind, V kind, batch, H_q, H_kv, L, S, D, dtype, options); None: float rows
    "q8_0-D64": ("q8_0", "q8_0", (2,), 18, 6, 3, 300, 64, torch.float32, dict(is_causal=True, num_splits=3)),
    "q4_0-D32-nobatch": ("q4_0", "q4_0", (), 18, 6, 1, 150, 32, torch.float32, dict(is_causal=True)),
    "q8_0-q4_0-window-softcap-sinks-ragged": (
        "q8_0", "q4_0", (3,), 6, 2, 2, 400, 32, torch.float32,
        dict(is_causal=True, window=(64, None), softcap=20.0, sinks=True, ragged=True, num_splits=2),
    ),
    "float-q4_0-mask": (None, "q4_0", (2,), 18, 6, 2, 130, 64, torch.float32, dict(mask=True, num_splits=2)),
    "q4_0-float": ("q4_0", None, (1,), 4, 2, 3, 100, 32, torch.float32, {}),
    "q8_0-q4_0-fp16": ("q8_0", "q4_0", (2,), 18, 6, 2, 200, 64, torch.float16, dict(is_causal=True, num_splits=2)),
    "fp8-D64": ("fp8_e4m3", "fp8_e4m3", (2,), 18, 6, 3, 300, 64, torch.float32, dict(is_causal=True, num_splits=3)),
    "fp8-D40-fp16-window-softcap-sinks": (
        "fp8_e4m3", "fp8_e4m3", (1,), 18, 6, 3, 170, 40, torch.float16,
        dict(is_causal=True, window=(64, None), softcap=20.0, sinks=True, num_splits=2),
    ),
    "fp8-q4_0-mask": ("fp8_e4m3", "q4_0", (2,), 6, 2, 1, 130, 32, torch.float32, dict(mask=True)),
}  # fmt: skip


@kernel
@pytest.mark.parametrize("case", list(QUANTIZED), ids=list(QUANTIZED))
def test_quantized_cache_matches_float64_over_its_values(case):
    """K and/or V as uint8 rows of blocks, read where they lie: the float64 oracle over the values the blocks hold
    (``cache.quantize.dequantize``), with every option the kernel takes."""
    k_name, v_name, batch, H_q, H_kv, L, S, D, dtype, options = QUANTIZED[case]
    q, k, v = qkv(batch, H_q, H_kv, L, S, D, dtype=dtype, seed=21)
    key, k_format, k_values = stored_as(k, k_name, key=True)
    value, v_format, v_values = stored_as(v, v_name)
    g = torch.Generator().manual_seed(22)
    kw = {name: options[name] for name in ("is_causal", "window", "softcap") if name in options}
    if options.get("sinks"):
        kw["sinks"] = torch.randn(H_q, generator=g) + 3
    if options.get("ragged"):
        kw |= dict(start=torch.tensor([0, 50, 300]), end=torch.tensor([400, 333, 340]))
    mask = torch.rand(*batch, 1, 1, S, generator=g) > 0.3 if options.get("mask") else None
    out = split_kv_attention(q, key, value, attn_mask=mask, num_splits=options.get("num_splits"), k_format=k_format,
                             v_format=v_format, **kw)  # fmt: skip
    assert out.shape == (*batch, H_q, L, D)
    check(out, reference(q, k_values, v_values, mask=mask, **kw), dtype)


@kernel
def test_quantized_rows_outside_the_window_and_past_the_cursor_are_never_read():
    """Blocks whose every byte is 0xFF (a NaN scale) before each row's window and after its cursor: the same bits."""
    q, k, v = qkv((2,), 6, 2, 1, 700, 32, seed=23)
    key, _, _ = stored_as(k, "q4_0", key=True)
    value, _, _ = stored_as(v, "q8_0")
    end = torch.tensor([700, 500])
    kw = dict(is_causal=True, window=100, end=end, k_format=1, v_format=0)
    expected = split_kv_attention(q, key, value, **kw)
    for row, stop in enumerate(end.tolist()):
        for t in (key, value):
            t[row, :, : stop - 1 - 100] = 0xFF
            t[row, :, stop:] = 0xFF
    assert torch.equal(split_kv_attention(q, key, value, **kw), expected)
    assert torch.isfinite(expected).all()


def test_quantized_cache_arguments_are_checked():
    q, k, v = qkv((1,), 4, 2, 1, 32, 32)
    blocks = quantize(k, KV_DTYPES["q8_0"])
    with pytest.raises(
        ValueError, match=r"k_format must be -1 .* or a block format code: 0 \(q8_0\), .* 2 \(fp8_e4m3\)"
    ):
        split_kv_attention(q, blocks, v, k_format=3)
    with pytest.raises(ValueError, match="v_format"):
        split_kv_attention(q, k, v, v_format=True)
    with pytest.raises(ValueError, match=r"key must be uint8 rows of q8_0 blocks \(34 bytes each\)"):
        split_kv_attention(q, k, v, k_format=0)  # float rows given as blocks
    with pytest.raises(ValueError, match="value must be uint8 rows of q4_0 blocks"):
        split_kv_attention(q, k, blocks[..., :33], v_format=1)  # not whole blocks
    with pytest.raises(ValueError, match=r"key head dim \(64\) must equal query head dim \(32\)"):
        split_kv_attention(q, quantize(torch.randn(1, 2, 32, 64), KV_DTYPES["q8_0"]), v, k_format=0)
    with pytest.raises(TypeError, match="must share a dtype"):
        split_kv_attention(q, blocks, v.half(), k_format=0)  # the float side is still checked


# supports, the backend ------------------------------------------------------------------------------------------


def _refusals():
    q, k, v = qkv((1,), 4, 2, 1, 32, 16)
    grad = q.clone().requires_grad_(True)
    return {
        "L = 17": (qkv((1,), 4, 2, 17, 32, 16), {}),
        "head dim 512": (qkv((1,), 4, 2, 1, 32, 512), {}),
        "head dim 512 (D_v)": (qkv((1,), 4, 2, 1, 32, 16, D_v=512), {}),
        "weights": ((q, k, v), dict(return_weights=True)),
        "dropout": ((q, k, v), dict(dropout_p=0.1)),
        "gradients": ((grad, k, v), {}),
        "dtype torch.float64": (qkv((1,), 4, 2, 1, 32, 16, dtype=torch.float64), {}),
        "empty": (qkv((1,), 4, 2, 1, 0, 16), {}),
        "last dim is not contiguous": ((q, torch.randn(1, 2, 32, 32)[..., ::2], v), {}),
    }


@pytest.mark.parametrize("name", list(_refusals()))
def test_supports_reasons(name):
    (q, k, v), kw = _refusals()[name]
    reason = supports(q, k, v, **kw)
    assert reason is not None
    key = name.split(" (")[0]
    assert {"weights": "weights", "dropout": "dropout", "gradients": "gradients"}.get(key, key) in reason
    with pytest.raises(ValueError, match="backend 'triton' cannot run this call"):
        gqa.grouped_attention(q, k, v, backend="triton", **kw)
    if not kw:
        with pytest.raises(ValueError, match="triton split-KV kernel cannot run"):
            split_kv_attention(q, k, v)


def test_supports_accepts():
    q, k, v = qkv((1,), 4, 2, 16, 32, 256)
    assert supports(q, k, v) is None
    grad = q.clone().requires_grad_(True)
    with torch.no_grad():
        assert supports(grad, k, v) is None  # inference under no_grad is fine


def test_supports_reads_env_per_call(monkeypatch):
    q, k, v = qkv((1,), 4, 2, 1, 32, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "device cpu" in supports(q, k, v)
    with pytest.raises(ValueError, match="device cpu"):
        gqa.grouped_attention(q, k, v, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert supports(q, k, v) is None


@kernel
def test_grouped_attention_backend():
    B, H_q, H_kv, L, S = 2, 18, 6, 2, 100
    q, k, v = qkv((B,), H_q, H_kv, L, S, 40, seed=10)
    mask = torch.rand(B, 1, 1, S, generator=torch.Generator().manual_seed(10)) > 0.3
    gqa.grouped_attention(q, k, v, backend="grouped")
    assert gqa.last_backend() == "grouped"
    out = gqa.grouped_attention(q, k, v, mask, is_causal=True, scale=0.2, backend="triton")
    assert gqa.last_backend() == "triton"
    check(out, reference(q, k, v, mask=mask, is_causal=True, scale=0.2), torch.float32)


# plan_splits ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("programs", [1, 2, 7, 32, 132, 1000])
@pytest.mark.parametrize("S", [1, 63, 64, 65, 255, 256, 257, 1000, 4096, 32768, 131072])
@pytest.mark.parametrize("sm_count", [2, 132])
def test_plan_splits(programs, S, sm_count):
    splits, chunk = plan_splits(programs, S, sm_count)
    want = -(-4 * sm_count // programs)  # splits that give PROGRAMS_PER_SM programs per multiprocessor
    assert splits >= 1
    assert chunk % 64 == 0 and chunk >= 64
    assert splits * chunk >= S  # every key is in a split
    assert (splits - 1) * chunk < S  # and no split is empty
    if S <= MIN_CHUNK:
        assert splits == 1
    if splits > 1:
        assert chunk >= MIN_CHUNK * 3 // 4  # ~MIN_CHUNK keys per split (ceil + rounding to 64: 192 at worst)
        assert S / splits > MIN_CHUNK / 2
    assert splits <= want  # no more programs than the GPU needs
    assert splits >= 0.6 * min(want, S // MIN_CHUNK)  # and about as many as it needs, where the keys allow


def test_plan_splits_more_splits_for_fewer_programs():
    S, sm = 32768, 132
    counts = [plan_splits(p, S, sm)[0] for p in (1, 4, 16, 64, 528, 5000)]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] > counts[2] > counts[4]
    assert counts[-1] == 1  # a full grid: no split
    assert plan_splits(1, 100, sm) == (1, 128)  # few keys: one split however idle the GPU


# which tests this process has: the kernel tests where triton interprets, else the test that starts such a process
if INTERPRETED:
    del test_kernel_tests_in_interpreter_process
else:
    for _name in [name for name, obj in globals().items() if getattr(obj, "runs_kernel", False)]:
        del globals()[_name]


H200_SHARED = 232448  # bytes a block may opt into on sm90 (what Triton reported as the hardware limit)


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("D, D_v", [(16, 16), (40, 40), (64, 64), (128, 128), (128, 64), (256, 256), (96, 200)])
@pytest.mark.parametrize("shared", [H200_SHARED, 163 * 1024, 99 * 1024])
def test_config_fits_shared_memory(itemsize, D, D_v, shared):
    config = config_for(D, D_v, itemsize, shared)
    assert pipeline_bytes(config, D, D_v, itemsize) + SHARED_MEMORY_HEADROOM <= shared


def test_config_measured_on_h200():
    """What the H200 runs showed: bf16 at D=128 takes the default (128 keys, 3 stages: 0-9% of SDPA flash); float32
    at D=128 with it asked 294,912 bytes of shared memory and failed to compile, so it gets a smaller one."""
    assert config_for(128, 128, 2, H200_SHARED) == DEFAULT_CONFIG
    assert pipeline_bytes(DEFAULT_CONFIG, 128, 128, 4) + SHARED_MEMORY_HEADROOM > H200_SHARED
    assert config_for(128, 128, 4, H200_SHARED) != DEFAULT_CONFIG
    assert config_for(256, 256, 2, H200_SHARED) == (32, 8, 2)  # passed the GPU tests in every dtype
