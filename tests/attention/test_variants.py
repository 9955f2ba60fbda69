"""Sliding windows, logit soft-capping and attention sinks: every backend that claims them against a float64
oracle written here (explicit index comparisons, sinks as one more softmax column), against HF transformers' own
eager functions (Gemma 2's soft-capping, gpt-oss's sinks), gradients by ``gradcheck``, and clear errors."""

from __future__ import annotations

import types

import pytest
import torch

import gqa
from tests.helpers.reference import TOL


def oracle(q, k, v, *, mask=None, is_causal=False, window=None, softcap=None, sinks=None, scale=None):
    """float64, K/V repeated per query head, every rule written out."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(G, dim=-3), v.repeat_interleave(G, dim=-3)
    L, S = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(L)[:, None] + (S - L)
    j = torch.arange(S)[None, :]
    allowed = torch.ones(scores.shape, dtype=torch.bool)
    if is_causal:
        allowed &= j <= i
    if window is not None:
        left, right = (window, None) if isinstance(window, int) else window
        if left is not None:
            allowed &= j >= i - left
        if right is not None:
            allowed &= j <= i + right
    if mask is not None:
        allowed &= mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    top = scores.amax(-1, keepdim=True).clamp_min(-1e300)  # a row of -inf: no NaN
    weights = (scores - top).exp()
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-300)
    if sinks is not None:
        weights = weights[..., :-1]
    return weights @ v


def qkv(batch=(2,), H_q=18, H_kv=6, L=3, S=7, D=5, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*batch, h, n, D, generator=g).to(dtype) for h, n in ((H_q, L), (H_kv, S), (H_kv, S))]


WINDOWS = [2, (1, 1), (0, 0), (0, None), (None, 1), 10, 0]


FLEX_CASES = [(torch.float32, (2, 3), True), (torch.bfloat16, (), False)]  # unfused on CPU: ~0.2 s a call


@pytest.mark.parametrize(
    ("backend", "dtype", "batch", "is_causal"),
    [
        (b, d, n, c)
        for b in ("auto", "grouped", "reference")
        for d in (torch.float32, torch.bfloat16, torch.float16)
        for n in ((), (2,), (2, 3))
        for c in (False, True)
    ]
    + [("flex", *case) for case in FLEX_CASES],
)
def test_every_option_and_their_combination_matches_float64(backend, dtype, batch, is_causal):
    q, k, v = qkv(batch, dtype=dtype)
    sinks = torch.randn(18, generator=torch.Generator().manual_seed(5))
    mask = torch.rand(*batch, 1, 3, 7, generator=torch.Generator().manual_seed(6)) > 0.3
    for window in WINDOWS:
        for softcap, use_sinks, use_mask in ((None, False, False), (2.5, False, False), (None, True, False),
                                             (1.5, True, True)):  # fmt: skip
            s = sinks if use_sinks else None
            m = mask if use_mask else None
            out = gqa.grouped_attention(q, k, v, attn_mask=m, is_causal=is_causal, window=window, softcap=softcap,
                                        sinks=s, backend=backend)  # fmt: skip
            ref = oracle(q, k, v, mask=m, is_causal=is_causal, window=window, softcap=softcap, sinks=s)
            torch.testing.assert_close(out.double(), ref, **TOL[dtype], msg=f"{window} {softcap} {use_sinks}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [(), (2, 3)])
@pytest.mark.parametrize("L", [1, 3])
def test_the_native_kernel_takes_softcap_and_sinks(dtype, batch, L):
    """``backend="fused"`` (the native CPU decode kernel, its vectorised tanh and the sinks in its final combine) on
    odd shapes and a context long enough for several splits, every option combination, against the float64 oracle;
    ``auto`` runs it for decode shapes."""
    from gqa import kernels

    if not kernels.available():
        pytest.skip("native kernels not built")
    q, k, v = qkv(batch, H_q=18, H_kv=6, L=L, S=1100, D=5, dtype=dtype)
    q = q * 3  # scores large enough for the caps to bend them
    sinks = torch.randn(18, generator=torch.Generator().manual_seed(5)) * 2
    mask = torch.rand(*batch, 1, L, 1100, generator=torch.Generator().manual_seed(6)) > 0.3
    cases = [(2.5, False, False, None, False), (None, True, False, None, True), (1.5, True, True, 300, True),
             (30.0, True, False, (40, 0), False)]  # fmt: skip
    for softcap, use_sinks, use_mask, window, is_causal in cases:
        s = sinks if use_sinks else None
        m = mask if use_mask else None
        kw = dict(attn_mask=m, is_causal=is_causal, window=window, softcap=softcap, sinks=s)
        out = gqa.grouped_attention(q, k, v, backend="fused", **kw)
        ref = oracle(q, k, v, mask=m, is_causal=is_causal, window=window, softcap=softcap, sinks=s)
        torch.testing.assert_close(out.double(), ref, **TOL[dtype], msg=f"{softcap} {use_sinks} {window}")
    gqa.grouped_attention(q[..., -1:, :], k, v, softcap=2.5, sinks=sinks)
    assert gqa.attention.last_backend() == "fused"
    with torch.enable_grad():  # sinks being trained: the kernel has no backward, grouped runs it
        gqa.grouped_attention(q[..., -1:, :], k, v, sinks=sinks.clone().requires_grad_())
    assert gqa.attention.last_backend() == "grouped"


@pytest.mark.parametrize("backend", ["sdpa", "fused"])
def test_a_window_alone_runs_on_every_mask_taking_backend(backend):
    q, k, v = qkv((2,), H_q=8, H_kv=2, L=1 if backend == "fused" else 20, S=40, D=16)
    try:
        out = gqa.grouped_attention(q, k, v, is_causal=True, window=7, backend=backend)
    except ValueError as err:  # this build or machine cannot run it: said, not a wrong answer
        pytest.skip(str(err))
    torch.testing.assert_close(out.double(), oracle(q, k, v, is_causal=True, window=7), **TOL[torch.float32])


def test_long_decode_with_a_window_sees_only_the_window():
    q, k, v = qkv((1,), H_q=8, H_kv=2, L=1, S=4096, D=32)
    out = gqa.grouped_attention(q, k, v, window=256)
    tail = gqa.grouped_attention(q, k[..., -257:, :], v[..., -257:, :])  # the same keys, nothing else
    torch.testing.assert_close(out, tail, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["grouped", "reference", "sdpa"])
def test_a_windowed_call_hands_its_backend_only_the_keys_a_window_reaches(monkeypatch, backend):
    """L=3 queries, S=4096 keys, a 100-key left window: the first query sees from key 3993 - 100 on, so the backend
    gets the last 103 keys (and the padding mask's last 103 columns); with ``return_weights`` it gets all of them."""
    from gqa.attention import functional

    seen = []
    real = functional.BACKENDS[backend]

    def spy(q, k, v, **kwargs):
        seen.append((k.shape[-2], None if kwargs["attn_mask"] is None else kwargs["attn_mask"].shape[-1]))
        return real(q, k, v, **kwargs)

    monkeypatch.setitem(functional.BACKENDS, backend, spy)
    q, k, v = qkv((2,), H_q=8, H_kv=2, L=3, S=4096, D=8)
    pad = torch.ones(2, 1, 1, 4096, dtype=torch.bool)
    pad[1, ..., :4000] = False  # row 1: left padding that reaches into the window
    out = gqa.grouped_attention(q, k, v, pad, is_causal=True, window=100, backend=backend)
    assert seen == [(103, 103)]
    want = oracle(q, k, v, mask=pad, is_causal=True, window=100)
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    if backend != "sdpa":
        _, weights = gqa.grouped_attention(q, k, v, is_causal=True, window=100, backend=backend, return_weights=True)
        assert seen[-1] == (4096, 4096) and weights.shape[-1] == 4096


SOFTCAPS = [1e-300, 1e-30, 1e-2, 1.0, 30.0, 50.0, 1e4, 1e7, 1e20, 3e38, 1e39, 1e300]


@pytest.mark.parametrize("backend", ["fused", "grouped", "reference", "flex"])
def test_softcap_keeps_float32_accuracy_for_every_cap(backend):
    """``cap * tanh(s / cap)`` to float32's rounding whatever the finite cap. The native kernel's vectorised tanh,
    ``(e^2u - 1) / (e^2u + 1)``, lost the scores' digits to cancellation near ``u = s / cap = 0`` (1.7e-4 off at a cap
    of 1e4, 8e-2 at 1e7); a cap beyond float32's range gave NaN everywhere (``s / inf * inf``) and one below its
    smallest turned the capping off. 100 keys: six vectors of 16 scores and a partial one."""
    from gqa import kernels

    if backend == "fused" and not kernels.available():
        pytest.skip("native kernels not built")
    q, k, v = qkv((2,), H_q=18, H_kv=6, L=3, S=100, D=5)
    q = q * 3  # scores large enough for the small caps to bend them
    for cap in SOFTCAPS:
        out = gqa.grouped_attention(q, k, v, softcap=cap, backend=backend)
        ref = oracle(q, k, v, softcap=cap)
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-6, (cap, err)


def sink_kinds() -> dict[str, torch.Tensor | None]:
    mixed = torch.randn(18, generator=torch.Generator().manual_seed(8))
    mixed[::2] = float("-inf")
    return {"none": None, "-inf": torch.full((18,), float("-inf")), "finite": mixed.nan_to_num(neginf=-1.0),
            "mixed": mixed}  # fmt: skip


@pytest.mark.parametrize(
    "backend, sinks",
    [(b, s) for b in ("auto", "reference", "grouped", "fused", "flex") for s in sink_kinds()] + [("sdpa", "none")],
)
def test_a_row_that_sees_no_key_is_zeros_on_every_backend(backend, sinks):
    """A query row with no visible key returns zeros, with zero gradients (``grouped_attention``'s docstring), with
    sinks and without, on every backend, so the answer does not depend on which one ``auto`` picks for the shape: a
    sink of ``-inf`` is no sink (``grouped`` and ``reference`` returned NaN there, ``flex`` too, ``fused`` zeros).
    Bool and float masks; gradients where the backend has a backward."""
    from gqa import kernels

    if backend == "fused" and not kernels.available():
        pytest.skip("native kernels not built")
    q, k, v = qkv((2,), H_q=18, H_kv=6, L=3, S=7, D=5)
    sink = sink_kinds()[sinks]
    allowed = torch.rand(2, 1, 3, 7, generator=torch.Generator().manual_seed(9)) > 0.3
    allowed[..., 0] = True
    allowed[0, :, 1] = False  # batch 0, query 1 sees no key
    float_mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    for mask in (allowed, float_mask):
        out = gqa.grouped_attention(q, k, v, mask, sinks=sink, backend=backend)
        assert not out.isnan().any()
        assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
        torch.testing.assert_close(out.double(), oracle(q, k, v, mask=allowed, sinks=sink), **TOL[torch.float32])
        if sinks == "-inf":
            torch.testing.assert_close(out, gqa.grouped_attention(q, k, v, mask, backend=backend), atol=1e-7, rtol=0)
    if backend not in ("auto", "reference", "grouped", "sdpa"):
        return  # no backward (CPU FlexAttention, the native kernel)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    sg = None if sink is None else sink.clone().requires_grad_()
    out = gqa.grouped_attention(qg, kg, vg, allowed, sinks=sg, backend=backend)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(10)))
    for grad in (qg.grad, kg.grad, vg.grad, None if sg is None else sg.grad):
        assert grad is None or torch.isfinite(grad).all()
    assert torch.equal(qg.grad[0, :, 1], torch.zeros_like(qg.grad[0, :, 1]))


def test_weights_with_sinks_sum_to_less_than_one_and_empty_rows_are_zero():
    q, k, v = qkv((1,), L=4, S=4)
    sinks = torch.full((18,), 3.0)
    out, w = gqa.grouped_attention(q, k, v, is_causal=True, sinks=sinks, return_weights=True)
    assert (w.sum(-1) < 1).all() and (w.sum(-1) > 0).all()
    hidden = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    out = gqa.grouped_attention(q, k, v, attn_mask=hidden, sinks=sinks)
    assert torch.equal(out, torch.zeros_like(out))


def test_sinks_match_gpt_oss_eager_attention():
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v = qkv((2,), H_q=8, H_kv=2, L=6, S=6, D=16)
    sinks = torch.randn(8)
    module = types.SimpleNamespace(num_key_value_groups=4, sinks=sinks, training=False)
    causal = torch.zeros(6, 6).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    want, _ = gpt_oss.eager_attention_forward(module, q, k, v, causal[None, None], scaling=0.25)
    out = gqa.grouped_attention(q, k, v, is_causal=True, scale=0.25, sinks=sinks)
    torch.testing.assert_close(out.transpose(1, 2), want, atol=1e-5, rtol=1e-5)


def test_softcap_matches_gemma2_eager_attention():
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    q, k, v = qkv((2,), H_q=8, H_kv=2, L=6, S=6, D=16)
    q = q * 4  # scores large enough for the cap to bend them
    module = types.SimpleNamespace(num_key_value_groups=4, training=False)
    causal = torch.zeros(6, 6).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    want, _ = gemma2.eager_attention_forward(module, q, k, v, causal[None, None], scaling=0.25, softcap=3.0)
    out = gqa.grouped_attention(q, k, v, is_causal=True, scale=0.25, softcap=3.0)
    torch.testing.assert_close(out.transpose(1, 2), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["grouped", "reference"])
def test_gradients_through_window_softcap_and_sinks(backend):
    q, k, v = (t.double().requires_grad_() for t in qkv((1,), H_q=4, H_kv=2, L=3, S=5, D=3))
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def fn(q, k, v, sinks):
        return gqa.grouped_attention(q, k, v, is_causal=True, window=(2, 0), softcap=1.5, sinks=sinks,
                                     backend=backend)  # fmt: skip

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks))


def test_flex_refuses_gradients_it_cannot_give():
    """FlexAttention has no backward on CPU, and sinks' gradient would go through its log-sum-exp: refused by name
    (``auto`` on CUDA sends sinks that need a gradient to the grouped matmul)."""
    q, k, v = (t.double().requires_grad_() for t in qkv((1,), H_q=4, H_kv=2, L=3, S=5, D=3))
    with pytest.raises(ValueError, match="backend 'flex' cannot run this call: inputs that need gradients on CPU"):
        gqa.grouped_attention(q, k, v, window=2, backend="flex")
    q, k, v = (t.detach() for t in (q, k, v))
    with pytest.raises(ValueError, match="sinks that require grad"):
        gqa.grouped_attention(q, k, v, sinks=torch.zeros(4, dtype=torch.float64, requires_grad=True), backend="flex")


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(window=-1), ValueError, "window's left side must be >= 0"),
        (dict(window=(1, -2)), ValueError, "window's right side must be >= 0"),
        (dict(window=(1, 2, 3)), TypeError, "window must be an int"),
        (dict(window=1.5), TypeError, "window must be an int"),
        (dict(window=True), TypeError, "window must be an int"),
        (dict(softcap=0.0), ValueError, "softcap must be a finite number > 0"),
        (dict(softcap=float("inf")), ValueError, "softcap must be a finite number > 0"),
        (dict(softcap=True), TypeError, "softcap must be a float"),
        (dict(sinks=torch.zeros(5)), ValueError, r"sinks must have shape \(H_q,\) = \(18,\)"),
        (dict(sinks=torch.zeros(18, dtype=torch.long)), TypeError, "sinks must be a floating-point tensor"),
        (dict(sinks=[0.0] * 18), TypeError, "sinks must be a torch.Tensor"),
        (dict(softcap=2.0, backend="sdpa"), ValueError, "backend='sdpa' cannot apply softcap or sinks"),
        (dict(sinks=torch.zeros(18), backend="triton"), ValueError, "backend .triton. cannot run this call: device"),
    ],
)
def test_bad_options_are_refused_by_name(kwargs, error, words):
    q, k, v = qkv()
    with pytest.raises(error, match=words):
        gqa.grouped_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("L", [1, 3])  # decode-like shapes (the native kernel's) and a short chunk
def test_a_learned_additive_mask_gets_its_gradient(L):
    """A bias that needs a gradient (ALiBi / T5-style, q/k/v frozen) is never sent to an inference kernel: ``auto``
    takes a differentiable path and its gradient is the float64 reference's; ``fused`` refuses by name (it ran and the
    bias' gradient was silently None)."""
    from tests.helpers.reference import attention64

    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 18, L, 32, generator=g), torch.randn(2, 6, 20, 32, generator=g), torch.randn(
        2, 6, 20, 32, generator=g)  # fmt: skip
    bias = (0.1 * torch.randn(1, 18, L, 20, generator=g)).requires_grad_()
    gqa.grouped_attention(q, k, v, bias, is_causal=True).sum().backward()
    ref = bias.detach().double().requires_grad_()
    attention64(q.double(), k.double(), v.double(), ref, is_causal=True)[0].sum().backward()
    assert bias.grad is not None
    torch.testing.assert_close(bias.grad.double(), ref.grad, atol=1e-5, rtol=1e-4)
    if L == 1:
        with pytest.raises(ValueError, match="backend 'fused' cannot run this call: inputs that need gradients"):
            gqa.grouped_attention(q, k, v, bias, is_causal=True, backend="fused")
    if L == 1 and gqa.kernels.available():
        with torch.no_grad():  # no gradient wanted: the kernel takes it again
            gqa.grouped_attention(q, k, v, bias, is_causal=True)
        assert gqa.last_backend() == "fused"
