"""The per-signature route cache of ``grouped_attention``: a repeated call skips the checks and the choice, yet
every call — first or repeated — matches the float64 reference, and an invalid call is refused every time."""

from __future__ import annotations

import pytest
import torch

import gqa
from gqa.attention import functional, routes
from tests.helpers.reference import TOL, attention64


def _qkv(batch=(2,), H_q=18, H_kv=6, L=3, S=7, D=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, H_q, L, D, generator=g).to(dtype)
    k = torch.randn(*batch, H_kv, S, D, generator=g).to(dtype)
    v = torch.randn(*batch, H_kv, S, D, generator=g).to(dtype)
    return q, k, v


def _close(out, ref, dtype):
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("backend", ["auto", "grouped", "reference", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["decode", "prefill-causal", "chunk-causal", "batchless", "three-batch-dims"])
def test_a_repeated_call_skips_the_checks_and_still_matches_float64(monkeypatch, backend, dtype, case):
    batch, L, S, causal = {"decode": ((2,), 1, 33, False), "prefill-causal": ((2,), 20, 20, True),
                           "chunk-causal": ((2,), 4, 21, True), "batchless": ((), 3, 7, True),
                           "three-batch-dims": ((2, 1, 3), 3, 17, True)}[case]  # fmt: skip
    q, k, v = _qkv(batch, L=L, S=S, D=8, dtype=dtype)
    try:
        first = gqa.grouped_attention(q, k, v, is_causal=causal, backend=backend)
    except ValueError as err:  # sdpa refuses what torch would copy K/V for (3-D batch dims on some builds)
        pytest.skip(str(err))
    chosen = gqa.attention.last_backend()
    assert routes.route_count() == 1

    def no_checks(*args, **kwargs):
        raise AssertionError("a remembered signature was checked again")

    monkeypatch.setattr(functional, "check_qkv", no_checks)
    monkeypatch.setattr(functional, "choose_backend", no_checks)
    for seed in (1, 2):  # new values, same signature: the route holds no data
        q, k, v = _qkv(batch, L=L, S=S, D=8, dtype=dtype, seed=seed)
        out = gqa.grouped_attention(q, k, v, is_causal=causal, backend=backend)
        assert gqa.attention.last_backend() == chosen
        _close(out, attention64(q, k, v, is_causal=causal)[0], dtype)
    assert first.shape == out.shape and routes.route_count() == 1


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_route_never_keeps_the_mask_values(kind):
    q, k, v = _qkv((2,), L=2, S=40, D=8)
    for seed in range(3):
        g = torch.Generator().manual_seed(10 + seed)
        allowed = torch.rand(2, 1, 2, 40, generator=g) > 0.5
        allowed[..., seed] = True  # no empty row
        mask = allowed if kind == "bool" else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        out = gqa.grouped_attention(q, k, v, attn_mask=mask)
        _close(out, attention64(q, k, v, mask=mask)[0], torch.float32)
    assert routes.route_count() == 1


def test_strides_dtypes_and_grad_mode_are_part_of_the_signature():
    q, k, v = _qkv((2,), L=1, S=40, D=8)
    gqa.grouped_attention(q, k, v)
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # same shape, other strides
    out = gqa.grouped_attention(q, kt, v)
    _close(out, attention64(q, k, v)[0], torch.float32)
    assert routes.route_count() == 2
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out = gqa.grouped_attention(qg, kg, vg)  # needs a backend with a backward, not the inference kernel's route
    out.sum().backward()
    ref_q, ref_k, ref_v = (t.double().requires_grad_() for t in (q, k, v))
    attention64(ref_q, ref_k, ref_v)[0].sum().backward()
    for got, want in ((qg, ref_q), (kg, ref_k), (vg, ref_v)):
        torch.testing.assert_close(got.grad.double(), want.grad, **TOL[torch.float32])
    with torch.no_grad():
        gqa.grouped_attention(qg, kg, vg)  # grad mode off: another signature
    assert routes.route_count() == 4


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(is_causal=1), TypeError, "is_causal"),
        (dict(dropout_p=False), TypeError, "dropout_p"),
        (dict(scale=True), TypeError, "scale"),
        (dict(scale=[1.0]), TypeError, "scale"),
        (dict(backend="nope"), ValueError, "backend"),
    ],
)
def test_an_invalid_call_is_refused_every_time_even_after_its_valid_twin(kwargs, error, words):
    q, k, v = _qkv((2,), L=1, S=40, D=8)
    valid = dict(is_causal=True, dropout_p=0.0, scale=1.0, backend="auto")
    gqa.grouped_attention(q, k, v, **valid)  # 1 == True, False == 0.0: equal keys but for their types
    for _ in range(2):
        with pytest.raises(error, match=words):
            gqa.grouped_attention(q, k, v, **(valid | kwargs))
    assert routes.route_count() == 1


def test_arguments_that_are_not_tensors_are_refused_by_name_every_time():
    q, k, v = _qkv((2,), L=1, S=40, D=8)
    for _ in range(2):
        with pytest.raises(TypeError, match=r"key must be a torch\.Tensor"):
            gqa.grouped_attention(q, k.tolist(), v)
        with pytest.raises(TypeError, match=r"attn_mask must be a torch\.Tensor"):
            gqa.grouped_attention(q, k, v, attn_mask=[[True]])
    assert routes.route_count() == 0


def test_the_table_starts_over_when_full(monkeypatch):
    monkeypatch.setattr(routes, "MAX_ROUTES", 3)
    for S in range(10, 15):
        q, k, v = _qkv((1,), L=1, S=S, D=8)
        _close(gqa.grouped_attention(q, k, v), attention64(q, k, v)[0], torch.float32)
        assert routes.route_count() <= 3
    routes.clear_routes()
    assert routes.route_count() == 0
