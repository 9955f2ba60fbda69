"""The native ops at their edges, called directly as a caller with a bug would call them: caches whose shapes
disagree (refused before anything is written), empty batches (empty results), zero head sizes (clear errors), FFN
widths that are not a multiple of the SIMD width (a row's logits do not depend on the batch), RMSNorm of any width
against float64, huge finite inputs to the quantized GEMV (no NaN where float gives none), and a kernel library that
exists but cannot be loaded."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gqa import kernels

native = pytest.mark.skipif(not kernels.vectorized(), reason="native SIMD kernels not built on this machine")


# -- gqa::decode_attend / gqa::decode_layer: every shape check before the cache write ----------------------------------


def attend_args(B=2, Hq=4, H=2, C=8, D=4, pos=3, dtype=torch.float32):
    """q, k, v, cos, sin, key_cache, value_cache, start, cursor of a ``gqa::decode_attend`` call."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(B, Hq * D, generator=g).to(dtype),
        torch.randn(B, H * D, generator=g).to(dtype),
        torch.randn(B, H * D, generator=g).to(dtype),
        torch.ones(B, D),
        torch.zeros(B, D),
        torch.zeros(B, H, C, D, dtype=dtype),
        torch.zeros(B, H, C, D, dtype=dtype),
        torch.zeros(B, dtype=torch.long),
        torch.tensor(pos),
    ]


# value caches that are views of a larger zero buffer, one dim short of the key cache's (B=2, H_kv=2, C=8):
# a write to the missing row, head or slot would land in the buffer outside the view
SHORT_VALUE_CACHES = {
    "batch": (lambda big: big[:1], "value_cache"),
    "heads": (lambda big: big[:, :1], "value_cache"),
    "slots": (lambda big: big[:, :, :3], "value_cache"),
}


@native
@pytest.mark.parametrize("short", sorted(SHORT_VALUE_CACHES))
def test_decode_attend_refuses_a_value_cache_unlike_the_key_cache_before_writing(short):
    view, message = SHORT_VALUE_CACHES[short]
    args = attend_args()
    big = torch.zeros(2, 2, 8, 4)
    args[6] = view(big)
    keys_before = args[5].clone()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.gqa.decode_attend(*args, 0.5)
    assert big.abs().sum() == 0, "the value cache's buffer was written outside the view"
    assert torch.equal(args[5], keys_before) and int(args[8]) == 3  # no key written, the cursor unchanged


@native
def test_decode_layer_refuses_a_short_value_cache_before_writing():
    g = torch.Generator().manual_seed(1)
    B, E, Hq, H, D, F_ = 2, 16, 4, 2, 4, 24
    shapes = [(Hq * D, E), (H * D, E), (H * D, E), (E, Hq * D), (F_, E), (F_, E), (E, F_)]
    weights = [torch.randn(m, k, generator=g) for m, k in shapes]
    _, _, _, cos, sin, key_cache, _, start, cursor = attend_args(B=B, Hq=Hq, H=H, D=D)
    big = torch.zeros(B, H, 8, D)
    with pytest.raises(RuntimeError, match="value_cache"):
        torch.ops.gqa.decode_layer(torch.randn(B, E, generator=g), torch.ones(E), torch.ones(E), 1e-5, weights,
                                   [-1] * 7, [None] * 3, cos, sin, key_cache, big[:1], start, cursor, 0.5)  # fmt: skip
    assert big.abs().sum() == 0 and key_cache.abs().sum() == 0 and int(cursor) == 3


@native
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(D=0), "head_dim must be positive and even"),
        (dict(H=0, Hq=0), "H_kv must be positive"),
    ],
    ids=["head_dim-0", "H_kv-0"],
)
def test_decode_attend_refuses_zero_sizes(change, message):
    args = attend_args(**change)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.gqa.decode_attend(*args, 0.5)


@native
def test_decode_attend_on_an_empty_batch_returns_an_empty_result():
    args = attend_args(B=0)
    out = torch.ops.gqa.decode_attend(*args, 0.5)
    assert out.shape == (0, 4 * 4) and int(args[8]) == 4


# -- gqa::decode_model / gqa::decode_paged -------------------------------------------------------------------------


class Step:
    """A 2-layer float model's arguments for ``gqa::decode_model`` and ``gqa::decode_paged`` (E=32, H_q=4, H_kv=2,
    vocab 50), FFN width ``F`` and head size ``D``."""

    def __init__(self, F: int = 24, D: int = 8, dtype=torch.float32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.E, self.F, self.Hq, self.Hkv, self.D, self.V, self.dtype = 32, F, 4, 2, D, 50, dtype
        E, Hq, Hkv = self.E, self.Hq, self.Hkv
        shapes = [(Hq * D, E), (Hkv * D, E), (Hkv * D, E), (E, Hq * D), (F, E), (F, E), (E, F)]
        self.layers = 2
        self.weights = [
            (torch.randn(m, k, generator=g) / max(k, 1) ** 0.5).to(dtype) for _ in range(self.layers) for m, k in shapes
        ]
        self.norms = [(1 + 0.1 * torch.randn(E, generator=g)).to(dtype) for _ in range(self.layers)]
        self.head = torch.randn(self.V, E, generator=g).to(dtype)
        self.g = g

    def rope(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        angle = torch.rand(B, max(self.D // 2, 0), generator=self.g)
        return angle.cos().repeat(1, 2).contiguous(), angle.sin().repeat(1, 2).contiguous()

    def head_args(self, x, cos, sin):
        n = self.layers
        return (x, self.norms, self.norms, 1e-5, self.weights, [-1] * 7 * n, [None] * 3 * n, cos, sin)

    def tail(self):
        return (max(self.D, 1) ** -0.5, torch.ones(self.E, dtype=self.dtype), 1e-5, self.head, -1)

    def dense(self, x, cos, sin, caches, starts, pos: int, greedy=None):
        cursors = [torch.tensor(pos) for _ in range(self.layers)]
        return torch.ops.gqa.decode_model(*self.head_args(x, cos, sin), [k for k, _ in caches], [v for _, v in caches],
                                          starts, cursors, *self.tail(), greedy), cursors  # fmt: skip

    def paged(self, x, cos, sin, pools, table, positions, greedy=None, logit_rows=None):
        return torch.ops.gqa.decode_paged(*self.head_args(x, cos, sin), [k for k, _ in pools], [v for _, v in pools],
                                          table, positions, *self.tail(), greedy, logit_rows)  # fmt: skip

    def caches(self, B: int, C: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = (B, self.Hkv, C, self.D)

        def noise() -> torch.Tensor:
            return torch.randn(shape, generator=self.g).to(self.dtype)

        return [(noise(), noise()) for _ in range(self.layers)]


@native
def test_decode_model_on_an_empty_batch_returns_empty_logits():
    s = Step()
    cos, sin = s.rope(0)
    caches = s.caches(0, 8)
    greedy = torch.empty(0, dtype=torch.long)
    logits, cursors = s.dense(torch.empty(0, s.E), cos, sin, caches, [torch.empty(0, dtype=torch.long)] * 2, 3, greedy)
    assert logits.shape == (0, s.V) and [int(c) for c in cursors] == [4, 4]


@native
@pytest.mark.parametrize("logit_rows", [None, torch.empty(0, dtype=torch.long)], ids=["all-rows", "no-rows"])
def test_decode_paged_on_an_empty_batch_returns_empty_logits(logit_rows):
    s = Step()
    cos, sin = s.rope(0)
    pools = s.caches(6, 4)  # 6 blocks of 4 slots
    table = torch.empty(0, 3, dtype=torch.long)  # its data pointer is null
    greedy = torch.empty(0, dtype=torch.long)
    logits = s.paged(torch.empty(0, s.E), cos, sin, pools, table, torch.empty(0, dtype=torch.long), greedy, logit_rows)
    assert logits.shape == (0, s.V)


@native
def test_decode_model_refuses_head_dim_zero():
    s = Step(D=0)
    cos, sin = s.rope(1)
    with pytest.raises(RuntimeError, match="head_dim must be positive and even"):
        s.dense(torch.randn(1, s.E), cos, sin, s.caches(1, 8), [torch.zeros(1, dtype=torch.long)] * 2, 3)


@native
def test_decode_paged_refuses_head_dim_zero():
    s = Step(D=0)
    cos, sin = s.rope(1)
    with pytest.raises(RuntimeError, match="head_dim must be positive and even"):
        s.paged(torch.randn(1, s.E), cos, sin, s.caches(4, 4), torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]))


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("F_", [7, 12, 100])
def test_a_row_alone_equals_the_row_in_a_batch_for_any_ffn_width(F_, dtype):
    """Each of 8 rows, decoded alone, gives the same logits bit for bit as in the batch of 8 — through
    ``decode_paged`` (ragged rows over shared blocks) and ``decode_model`` (dense caches, under 256 tokens so the
    context is one split whatever the batch) — with FFN widths 7, 12 and 100 (not multiples of the SIMD width)."""
    s = Step(F=F_, dtype=dtype, seed=F_)
    B, block = 8, 4
    x = torch.randn(B, s.E, generator=s.g).to(dtype)
    cos, sin = s.rope(B)
    positions = torch.tensor([3, 0, 9, 17, 5, 1, 30, 11])
    blocks_per_row = 8
    pools = s.caches(B * blocks_per_row, block)
    table = torch.randperm(B * blocks_per_row, generator=s.g).view(B, blocks_per_row).contiguous()
    batch = s.paged(x, cos, sin, pools, table, positions)
    for b in range(B):
        alone = s.paged(x[b : b + 1], cos[b : b + 1], sin[b : b + 1], pools, table[b : b + 1], positions[b : b + 1])
        assert torch.equal(alone[0], batch[b]), f"decode_paged row {b} differs alone (F={F_}, {dtype})"

    C, pos = 40, 31
    caches = s.caches(B, C)
    starts = [torch.tensor([0, 3, 9, 0, 30, 1, 2, 20])] * s.layers
    batch, _ = s.dense(x, cos, sin, [(k.clone(), v.clone()) for k, v in caches], starts, pos)
    for b in range(B):
        alone, _ = s.dense(x[b : b + 1], cos[b : b + 1], sin[b : b + 1],
                           [(k[b : b + 1].clone(), v[b : b + 1].clone()) for k, v in caches],
                           [st[b : b + 1] for st in starts], pos)  # fmt: skip
        assert torch.equal(alone[0], batch[b]), f"decode_model row {b} differs alone (F={F_}, {dtype})"


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 12, 100])
def test_silu_mul_gives_each_element_the_same_value_in_any_tensor(n, dtype):
    """``gqa::silu_mul`` on a row alone equals the same row inside a larger product (the one-call step's phase and
    the op-by-op path compute SwiGLU with it, bit for bit alike)."""
    g = torch.Generator().manual_seed(n)
    gate, up = torch.randn(5, n, generator=g).to(dtype) * 4, torch.randn(5, n, generator=g).to(dtype)
    whole = torch.ops.gqa.silu_mul(gate, up)
    for b in range(5):
        assert torch.equal(
            torch.ops.gqa.silu_mul(gate[b : b + 1].contiguous(), up[b : b + 1].contiguous())[0], whole[b]
        )
    expected = (F.silu(gate.double()).to(dtype).double() * up.double()).to(dtype)
    torch.testing.assert_close(whole, expected, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5)


@native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E", [1, 5, 16, 17, 576, 1000])
def test_rms_norm_matches_float64_and_each_row_its_value_in_any_batch(E, dtype):
    """``gqa::rms_norm`` (every norm of the decode steps) against HF's RMSNorm in float64 — ``w * T(x / rms(x))``,
    the rms in float32 — for widths below, at and past the SIMD width with a tail; rows of very different scales; a
    row alone equals the same row in a batch, bit for bit."""
    g = torch.Generator().manual_seed(E)
    scales = torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.5, 2.0, 7.0])[:, None]
    x = (torch.randn(7, E, generator=g) * scales).to(dtype)
    w = (torch.rand(E, generator=g) + 0.5).to(dtype)
    out = torch.ops.gqa.rms_norm(x, w, 1e-6)
    x64 = x.double()
    normed = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).double()
    expected = (w.double() * normed).to(dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=0, rtol=2e-6)
    else:  # the float32 sum may round x / rms to the neighbouring bf16 value: one ulp, up to 2 after times w
        torch.testing.assert_close(out.double(), expected.double(), atol=0, rtol=2**-6)
    for b in range(7):
        assert torch.equal(torch.ops.gqa.rms_norm(x[b : b + 1].contiguous(), w, 1e-6)[0], out[b])


# -- the quantized GEMV with huge finite inputs ---------------------------------------------------------------------


@native
@pytest.mark.parametrize("rows", [1, 4, 5])
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_quantized_gemv_gives_no_nan_for_huge_finite_inputs(fmt, rows):
    """Inputs of 1e36 (finite) overflow the integer path's sums: the kernel gives what float gives — the same
    infinities where the float64 product is beyond float32, close values where it is not — never a NaN."""
    from gqa.models.quantized import QuantizedLinear, dequantize, quantize

    g = torch.Generator().manual_seed(rows)
    M, K = 12, 128
    layer = QuantizedLinear(quantize(torch.randn(M, K, generator=g), fmt), None)
    x = torch.randn(rows, K, generator=g)
    x[:, 32:64] *= 1e36  # one block per row: sums up to ~1e37, finite in float
    x[rows - 1, 96:] = 3e37 * torch.sign(torch.randn(32, generator=g))  # the last row's sums overflow float32
    with torch.inference_mode():
        y = layer(x)
    weight = dequantize(layer.blocks, layer.format, K, torch.float64)
    ref = x.double() @ weight.T  # float64: finite everywhere here
    assert not y.isnan().any(), y
    beyond = ref.abs() > 3.4e38
    assert torch.equal(y[beyond], torch.where(ref[beyond] > 0, torch.inf, -torch.inf).float())
    inside = ref.abs() < 1e38
    torch.testing.assert_close(y[inside].double(), ref[inside], rtol=1e-4, atol=1e-3 * ref.abs().max().item() * 1e-3)
    assert inside[:-1].all() and beyond.any()


# -- a kernel library that exists but cannot be loaded ----------------------------------------------------------


def test_an_unloadable_library_falls_back_with_one_warning(tmp_path):
    """A truncated library in the build folder: ``gqa.kernels.load`` warns once naming the file and returns False
    (the PyTorch paths run), in every call of the process."""
    env = {**os.environ, "GQA_KERNELS_DIR": str(tmp_path)}
    code = (
        "import warnings, gqa.kernels as k\n"
        "k.library_path().parent.mkdir(parents=True)\n"
        "k.library_path().write_bytes(b'\\x7fELF truncated')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    print(k.load(), k.available(), k.vectorized())\n"
        "print(len(w), w[0].message if w else '')\n"
        "import gqa, torch\n"
        "out = gqa.grouped_attention(torch.randn(1, 4, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8))\n"
        "print(tuple(out.shape))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "False False False"
    assert lines[1].startswith("1 ") and "gqa_cpu_kernels.so" in lines[1] and "cannot be loaded" in lines[1]
    assert lines[2] == "(1, 4, 1, 8)"


def test_the_build_command_rebuilds_a_library_that_cannot_be_loaded(tmp_path, monkeypatch, capsys):
    from gqa.kernels import __main__ as build_command

    monkeypatch.setenv("GQA_KERNELS_DIR", str(tmp_path))
    path = kernels.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF truncated")
    built = []

    def fake_build(verbose: bool = False):
        assert not path.exists(), "the unloadable library was not removed before the rebuild"
        built.append(verbose)
        return path

    monkeypatch.setattr(build_command, "build", fake_build)
    monkeypatch.setattr(sys, "argv", ["python -m gqa.kernels"])
    build_command.main()
    assert built == [False]
    assert "cannot be loaded" in capsys.readouterr().out


@native
@pytest.mark.parametrize(
    "options, message",
    [
        (([torch.ones(8)], 1e-6, [], []), r"qk_norms must hold 2 norms per layer \(4\), got 1"),
        ((None, 1e-6, [3], []), r"windows must be empty or one per layer \(2\), got 1"),
        ((None, 1e-6, [3, -2], []), r"layer 1's window must be >= 0 or -1, got -2"),
        ((None, 1e-6, [], [1, 0, 1]), r"rotates must be empty or one per layer \(2\), got 3"),
        ((None, 1e-6, [], [1, 3]), r"layer 1's rotates must be 0, 1 or 2, got 3"),
        ((None, 1e-6, [], [2, 1]), r"layer 0 rotates with the local tables: cos_local and sin_local needed"),
        ((None, 1e-6, [], [], [torch.ones(32)]), r"post_norms must hold 2 norms per layer \(4\), got 1"),
        ((None, 1e-6, [], [], None, True, True, [1.0]), r"softcaps must be empty or one per layer \(2\), got 1"),
        ((None, 1e-6, [], [], None, True, True, [1.0, -1.0]), r"layer 1's softcap must be >= 0, got -1"),
        (([torch.ones(8)] * 3 + [torch.ones(7)], 1e-6, [], []), r"layer 1's q/k norms must be contiguous"),
    ],
)
def test_decode_model_refuses_bad_layer_options_by_name(options, message):
    s = Step()
    cos, sin = s.rope(1)
    caches = s.caches(1, 8)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.gqa.decode_model(*s.head_args(torch.randn(1, s.E), cos, sin), [k for k, _ in caches],
                                   [v for _, v in caches], [torch.zeros(1, dtype=torch.long)] * 2,
                                   [torch.tensor(3)] * 2, *s.tail(), None, *options)  # fmt: skip
