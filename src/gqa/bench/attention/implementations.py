"""Every attention implementation the benchmark compares, behind one interface.

An :class:`Impl` turns a case's :class:`~gqa.bench.attention.cases.Inputs` into a zero-argument call returning
``out (B, H_q, L, D)``. ``prepare`` does the per-case set-up outside the timing (expanding a mask to a peer's layout,
building a FlexAttention block mask) and raises ``NotImplementedError`` (or ``ValueError`` / ``RuntimeError``) for a
case the implementation cannot run; the benchmark records the message and skips it.

* ours: ``gqa.grouped_attention`` with each backend of ``gqa.attention.backends.BACKENDS`` (read when the run starts,
so a
  backend registered later is picked up) and ``auto``;
* ``torch-sdpa``: ``F.scaled_dot_product_attention(enable_gqa=True)``, torch's own choice of kernel;
* ``hf-repeat_kv``: HF transformers' Llama path: ``repeat_kv`` (expand + reshape, a copy of K/V per query head), then
  SDPA without ``enable_gqa``;
* ``repeat_interleave``: the seed blog posts' way: ``repeat_interleave`` K/V to ``H_q`` heads, ``q k^T`` matmul,
  softmax in float32, ``@ v``;
* ``gqa-pytorch``: ``scaled_dot_product_gqa`` of the ``grouped-query-attention-pytorch`` package. Its layout is
  ``(b, n, h, d)`` and its ``scale`` *divides* the query (``scale=sqrt(D)`` is the usual attention); ``is_causal`` is
  top-left (right for ``L == S``), masks must be bool ``(b, n, s)``;
* CUDA only: ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient``, ``sdpa-math``: SDPA held to one kernel with
  ``torch.nn.attention.sdpa_kernel`` (a kernel that refuses the case is recorded with torch's reason), and ``flex``:
  compiled ``flex_attention(enable_gqa=True)`` with a causal block mask (the bool mask as a ``mask_mod``, the
  additive one as a ``score_mod``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import gqa

from ...attention.backends import BACKENDS
from ...attention.masks import causal_mask
from .cases import Case, Inputs

Call = Callable[[], torch.Tensor]

# The errors that mean "this implementation does not run this case" (recorded, not raised).
REFUSALS = (ValueError, NotImplementedError, RuntimeError)


@dataclass(frozen=True)
class Impl:
    """A named implementation: ``prepare(case, inputs) -> call``; ``extra_bytes(case, inputs)`` estimates the memory
    it allocates beyond the inputs (copies of K/V, materialized scores), used to skip what would not fit."""

    name: str
    group: str  # "ours", "peer" or "torch-kernel"
    description: str
    prepare: Callable[[Case, Inputs], Call]
    extra_bytes: Callable[[Case, Inputs], int] = field(default=lambda case, inputs: 0)


# ----------------------------------------------------------------------------------------------------------------
# Memory estimates (bytes beyond the inputs)


def _scores(case: Case, element_bytes: int = 4) -> int:
    """One ``(B, H_q, L, S)`` score tensor."""
    return case.batch * case.q_heads * case.q_len * case.kv_len * element_bytes


def _kv_copy(case: Case) -> int:
    """K and V copied to ``H_q`` heads."""
    return 2 * case.batch * case.q_heads * case.kv_len * case.head_dim * case.element_bytes


def _sdpa_is_math(inputs: Inputs, *, grouped: bool) -> bool:
    """Whether torch would run this SDPA call on its math path (which copies K/V and materializes the scores);
    ``grouped=False`` asks about K/V already repeated to ``H_q`` heads (a stride-0 view stands in for the copy)."""
    q, k, v = inputs.q, inputs.k, inputs.v
    if not grouped:
        k, v = (t[:, :1].expand(-1, q.shape[1], -1, -1) for t in (k, v))  # (B, H_q, S, D) views
    try:
        choice = torch._fused_sdp_choice(q, k, v, inputs.attn_mask, 0.0, inputs.is_causal, scale=inputs.scale,
                                         enable_gqa=grouped)  # fmt: skip
    except Exception:
        return True
    return SDPBackend(choice) in (SDPBackend.MATH, SDPBackend.ERROR)


def _math_bytes(case: Case, inputs: Inputs, *, grouped: bool) -> int:
    if not _sdpa_is_math(inputs, grouped=grouped):
        return 0
    half = case.element_bytes < 4
    return (_kv_copy(case) if grouped else 0) + 2 * _scores(case, 4 if not half else 6)


# ----------------------------------------------------------------------------------------------------------------
# Ours


def _ours(backend: str) -> Impl:
    def prepare(case: Case, inp: Inputs) -> Call:
        q, k, v, mask, causal = inp.q, inp.k, inp.v, inp.attn_mask, inp.is_causal
        return lambda: gqa.grouped_attention(q, k, v, attn_mask=mask, is_causal=causal, backend=backend)

    def extra(case: Case, inp: Inputs) -> int:
        if backend == "reference":  # float32 copies of half K/V, float32 scores and weights
            return (2 * case.kv_bytes * 4 // case.element_bytes if case.element_bytes < 4 else 0) + 2 * _scores(case)
        if backend in ("grouped", "auto"):  # float32 scores and weights (auto may pick grouped)
            return 2 * _scores(case) + (_scores(case, case.element_bytes) if case.element_bytes < 4 else 0)
        return 0

    what = "auto policy" if backend == "auto" else f"backend={backend!r}"
    return Impl(backend, "ours", f"gqa.grouped_attention, {what}", prepare, extra)


def our_impls() -> list[Impl]:
    """Each backend in ``gqa.attention.backends.BACKENDS`` as it is now, then ``auto``."""
    return [_ours(name) for name in BACKENDS] + [_ours("auto")]


# ----------------------------------------------------------------------------------------------------------------
# Peers


def _torch_sdpa(case: Case, inp: Inputs) -> Call:
    q, k, v, mask, causal = inp.q, inp.k, inp.v, inp.attn_mask, inp.is_causal
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)


def repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """HF transformers' ``repeat_kv``: ``(B, H_kv, S, D)`` -> ``(B, H_kv * n_rep, S, D)`` by ``expand`` + ``reshape``
    (a copy unless ``n_rep == 1``, where the input is returned as is)."""
    if n_rep == 1:
        return hidden
    B, H_kv, S, D = hidden.shape
    return hidden[:, :, None].expand(B, H_kv, n_rep, S, D).reshape(B, H_kv * n_rep, S, D)


def _hf_repeat_kv(case: Case, inp: Inputs) -> Call:
    q, k, v, mask, causal, G = inp.q, inp.k, inp.v, inp.attn_mask, inp.is_causal, case.group

    def call() -> torch.Tensor:
        k_rep, v_rep = repeat_kv(k, G), repeat_kv(v, G)  # (B, H_q, S, D), copies
        return F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask, is_causal=causal)

    return call


def _repeat_interleave(case: Case, inp: Inputs) -> Call:
    q, k, v, scale, G = inp.q, inp.k, inp.v, inp.scale, case.group
    mask = causal_mask(case.q_len, case.kv_len, q.device) if inp.is_causal else inp.attn_mask

    def call() -> torch.Tensor:
        k_rep = k.repeat_interleave(G, dim=1)  # (B, H_q, S, D), a copy
        v_rep = v.repeat_interleave(G, dim=1)  # (B, H_q, S, D), a copy
        scores = torch.matmul(q, k_rep.transpose(-1, -2)) * scale  # (B, H_q, L, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)  # (B, H_q, L, S)
        return torch.matmul(weights, v_rep)  # (B, H_q, L, D)

    return call


@cache
def _gqa_pytorch() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None:
    try:
        from grouped_query_attention_pytorch.attention import scaled_dot_product_gqa
    except ImportError:
        return None
    return scaled_dot_product_gqa


def gqa_pytorch_available() -> bool:
    return _gqa_pytorch() is not None


def _gqa_pytorch_call(case: Case, inp: Inputs) -> Call:
    fn = _gqa_pytorch()
    if fn is None:
        raise NotImplementedError(
            "grouped-query-attention-pytorch is not installed (pip install --no-deps grouped-query-attention-pytorch "
            "einops)"
        )
    if inp.attn_mask is not None and inp.attn_mask.dtype != torch.bool:
        raise NotImplementedError("grouped-query-attention-pytorch takes bool masks only")
    # Its layout is (b, n, h, d): transposed views; it transposes back to (b, h, n, d) inside, without a copy.
    q, k, v = (t.transpose(1, 2) for t in (inp.q, inp.k, inp.v))  # (B, L or S, H, D)
    mask = None if inp.attn_mask is None else inp.attn_mask.expand(case.batch, *inp.attn_mask.shape)  # (B, L, S)
    causal = True if inp.is_causal else None  # its causal mask is top-left: right here, where L == S
    scale = math.sqrt(case.head_dim)  # it divides the query by `scale`

    def call() -> torch.Tensor:
        out, _ = fn(q, k, v, scale=scale, mask=mask, is_causal=causal)  # (B, L, H_q, D)
        return out.transpose(1, 2)  # (B, H_q, L, D)

    return call


def peer_impls() -> list[Impl]:
    """The implementations we compare against, on any device."""

    def copy_extra(case: Case, inp: Inputs) -> int:
        return (_kv_copy(case) if case.group > 1 else 0) + _math_bytes(case, inp, grouped=False)

    def seed_extra(case: Case, inp: Inputs) -> int:
        return _kv_copy(case) + 3 * _scores(case)

    def package_extra(case: Case, inp: Inputs) -> int:
        return 3 * _scores(case, case.element_bytes) + _scores(case, 1) // case.q_heads

    return [
        Impl("torch-sdpa", "peer", "F.scaled_dot_product_attention(enable_gqa=True), torch's kernel choice",
             _torch_sdpa, lambda case, inp: _math_bytes(case, inp, grouped=True)),
        Impl("hf-repeat_kv", "peer", "HF transformers: repeat_kv (expand+reshape copy) + SDPA", _hf_repeat_kv,
             copy_extra),
        Impl("repeat_interleave", "peer", "copies K/V per head: repeat_interleave K/V, matmul, float32 softmax, matmul",
             _repeat_interleave, seed_extra),
        Impl("gqa-pytorch", "peer", "grouped-query-attention-pytorch scaled_dot_product_gqa (einops)",
             _gqa_pytorch_call, package_extra),
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# CUDA: SDPA held to one kernel, and FlexAttention

SDPA_KERNELS = {
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
    "sdpa-math": SDPBackend.MATH,
}


def _sdpa_kernel(kernel: SDPBackend) -> Callable[[Case, Inputs], Call]:
    def prepare(case: Case, inp: Inputs) -> Call:
        from torch.nn.attention import sdpa_kernel

        q, k, v, mask, causal = inp.q, inp.k, inp.v, inp.attn_mask, inp.is_causal

        def call() -> torch.Tensor:
            with sdpa_kernel([kernel]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)

        return call

    return prepare


def _flex_compiled(compile: bool) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    if not compile:
        return flex_attention
    return _compiled_flex()


@cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):  # one compilation per shape; the default limit is 8
            setattr(torch._dynamo.config, name, 4096)
    return torch.compile(flex_attention, dynamic=False)


def flex_prepare(case: Case, inp: Inputs, *, compile: bool = True) -> Call:
    """FlexAttention for one case: causal as a block mask, the bool mask as a ``mask_mod`` (with the block mask
    built from it), the additive mask as a ``score_mod``; ``enable_gqa=True``."""
    from torch.nn.attention.flex_attention import create_block_mask

    fn = _flex_compiled(compile)
    q, k, v, scale, L, S = inp.q, inp.k, inp.v, inp.scale, case.q_len, case.kv_len
    block_mask, score_mod = None, None
    if inp.is_causal:

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + (S - L)  # bottom-right

        block_mask = create_block_mask(causal, None, None, L, S, device=q.device)
    elif inp.attn_mask is not None and inp.attn_mask.dtype == torch.bool:
        allowed = inp.attn_mask  # (L, S)

        def from_tensor(b, h, q_idx, kv_idx):
            return allowed[q_idx, kv_idx]

        block_mask = create_block_mask(from_tensor, None, None, L, S, device=q.device)
    elif inp.attn_mask is not None:
        bias = inp.attn_mask  # (L, S)

        def add_bias(score, b, h, q_idx, kv_idx):
            return score + bias[q_idx, kv_idx]

        score_mod = add_bias
    return lambda: fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True)


def cuda_impls() -> list[Impl]:
    """The CUDA-only implementations: SDPA per kernel, and compiled FlexAttention."""
    impls = [
        Impl(name, "torch-kernel", f"SDPA(enable_gqa=True) held to {kernel.name} by sdpa_kernel",
             _sdpa_kernel(kernel), (lambda case, inp: _kv_copy(case) + 2 * _scores(case)) if name == "sdpa-math"
             else (lambda case, inp: 0))
        for name, kernel in SDPA_KERNELS.items()
    ]  # fmt: skip
    impls.append(Impl("flex", "torch-kernel", "torch.compile(flex_attention), enable_gqa=True, block mask",
                      flex_prepare, lambda case, inp: _scores(case, 1) // max(case.q_heads, 1)))  # fmt: skip
    return impls


def implementations_for(device: torch.device) -> list[Impl]:
    """Every implementation that applies on ``device``, in table order."""
    impls = our_impls() + peer_impls()
    if device.type == "cuda":
        impls += cuda_impls()
    return impls
