"""The native ops' Python surface (``gqa.kernels.ops``): the library calls ``torch.ops.gqa`` nowhere else, and every
op's fake kernel agrees with the real one (``torch.library.opcheck``: schema, fake shapes, autograd registration,
AOT dispatch with dynamic shapes) on small odd-shaped calls."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from gqa import kernels

native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built on this machine")
SRC = Path(__file__).resolve().parents[2] / "src" / "gqa"


def test_torch_ops_gqa_is_called_only_through_kernels_ops():
    raw = re.compile(r"torch\.ops\.gqa\b")
    offenders = [
        f"{path.relative_to(SRC)}:{number}"
        for path in SRC.rglob("*.py")
        if path != SRC / "kernels" / "ops.py"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if raw.search(line)
    ]
    assert offenders == []


def step_case(g: torch.Generator, B: int = 3, E: int = 32, F: int = 40, Hq: int = 6, Hkv: int = 2, D: int = 8):
    """A 2-layer float model's ``DecodeWeights`` and a batch's inputs for the one-call step."""
    from gqa.kernels.ops import DecodeWeights

    shapes = [(Hq * D, E), (Hkv * D, E), (Hkv * D, E), (E, Hq * D), (F, E), (F, E), (E, F)]
    weights = [torch.randn(m, k, generator=g) / k**0.5 for _ in range(2) for m, k in shapes]
    norms = [torch.ones(E) for _ in range(2)]
    w = DecodeWeights(
        norms,
        norms,
        1e-5,
        weights,
        [-1] * 14,
        [None] * 6,
        D**-0.5,
        torch.ones(E),
        1e-5,
        torch.randn(17, E, generator=g),
        -1,
    )
    angle = torch.rand(B, D // 2, generator=g)
    return w, torch.randn(B, E, generator=g), angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)


def cases() -> dict[str, tuple]:
    """An op and sample arguments for each op with tensor arguments."""
    from gqa.models.quantized import quantize

    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, D, C, K = 3, 6, 2, 8, 12, 64
    x = torch.randn(5, K, generator=g)
    blocks = quantize(torch.randn(7, K, generator=g), "q4_1").blocks
    q = torch.randn(B, Hkv, Hq // Hkv, D, generator=g)
    kv = torch.randn(B, Hkv, C, D, generator=g)
    pool = torch.randn(9, Hkv, 4, D, generator=g)
    table = torch.tensor([[0, 3, 5], [1, 2, 4], [8, 7, 6]])
    w, xs, cos, sin = step_case(g)

    def cache() -> tuple:  # key, value, start of a dense layer cache
        return torch.randn(B, Hkv, C, D, generator=g), torch.randn(B, Hkv, C, D), torch.zeros(B, dtype=torch.long)

    def dense(n: int) -> tuple:  # n layers' caches as decode_model takes them: keys, values, starts, cursors
        caches = [cache() for _ in range(n)]
        return [c[0] for c in caches], [c[1] for c in caches], [c[2] for c in caches], [torch.tensor(4)] * n

    model = (xs, w.norms1, w.norms2, w.eps, w.weights, w.formats, w.qkv_biases, cos, sin)
    head = (w.scale, w.final_norm, w.final_eps, w.head, -1)
    k, v, start = cache()
    ops = torch.ops.gqa
    return {
        "linear_rows": (ops.linear_rows, (x, torch.randn(7, K, generator=g), torch.randn(7, generator=g))),
        "linear_rows_n": (ops.linear_rows_n, (x, [torch.randn(7, K, generator=g), torch.randn(3, K)], [None, None])),
        "qlinear_rows_n": (ops.qlinear_rows_n, (x, [blocks], [2], [None])),
        "dequantize_rows": (ops.dequantize_rows, (blocks, 2, K, torch.float32)),
        "decode_attention": (ops.decode_attention, (q, kv, kv.clone(), None, 0.3, 1, False)),
        "paged_attention": (ops.paged_attention, (q.reshape(B, Hq, D), pool, pool.clone(), table,
                                                  torch.tensor([5, 12, 1]), 0.3)),
        "rms_norm": (ops.rms_norm, (x, torch.rand(K, generator=g), 1e-5)),
        "silu_mul": (ops.silu_mul, (x, torch.randn(5, K, generator=g))),
        "decode_attend": (ops.decode_attend, (torch.randn(B, Hq * D), torch.randn(B, Hkv * D),
                                              torch.randn(B, Hkv * D), cos, sin, k, v, start, torch.tensor(4), 0.3)),
        "decode_layer": (ops.decode_layer, (xs, w.norms1[0], w.norms2[0], w.eps, w.weights[:7], [-1] * 7, [None] * 3,
                                            cos, sin, *cache()[:3], torch.tensor(4), 0.3)),
        "decode_model": (ops.decode_model, (*model, *dense(2), *head, torch.empty(B, dtype=torch.long))),
        "decode_paged": (ops.decode_paged, (*model, [pool.clone(), pool.clone()], [pool.clone(), pool.clone()],
                                            table, torch.tensor([4, 0, 9]), *head, None, torch.tensor([2, 0]))),
        "quantize_kv": (ops.quantize_kv, (torch.randn(5, 3, K, generator=g), 1)),
        # a q8_0 K cache and a q4_0 V cache of 64-value heads
        "decode_attention blocks": (ops.decode_attention, (torch.randn(B, Hkv, 3, K), ops.quantize_kv(
            torch.randn(B, Hkv, C, K), 0), ops.quantize_kv(torch.randn(B, Hkv, C, K), 1), None, 0.3, 1, True, 0.0,
            None, 0, 1)),
    }  # fmt: skip


OPS = [
    "linear_rows",
    "linear_rows_n",
    "qlinear_rows_n",
    "dequantize_rows",
    "decode_attention",
    "paged_attention",
    "rms_norm",
    "silu_mul",
    "decode_attend",
    "decode_layer",
    "decode_model",
    "decode_paged",
    "quantize_kv",
]


@native
def test_every_op_with_tensors_has_a_case_here():
    registered = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("gqa::")}
    assert registered == {*OPS, "simd_width", "lane_rows", "reduce_seconds"}  # no tensors: one kernel for every backend


@native
@pytest.mark.parametrize("name", [*OPS, "decode_attention blocks"])
def test_the_fake_kernel_agrees_with_the_op(name):
    op, args = cases()[name]
    torch.library.opcheck(op.default, args)
