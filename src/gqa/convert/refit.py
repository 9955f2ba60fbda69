"""The least-squares ``o_proj`` (and ``v_proj``) refit: after a layer's K/V heads are merged, solve its output
projection again so the layer's attention output matches the source's on calibration text, one layer after another
along the converted model's own activations.

A merge method fits keys and values each in its own metric and ignores the softmax. What the rest of the model sees
is ``y = O W_o^T`` with ``O = [o_1 ... o_Hq] (T, H_q * D)`` the per-query-head attention outputs: linear in ``W_o``.
So, given the merged heads, the best ``W_o`` in the least-squares sense is a ridge regression against the source
layer's output ``Y (T, E)`` on the same inputs:

    W_o' = argmin_W ||O W^T - Y||^2 + lam ||W - W_o||^2,     W_o'^T = (O^T O + lam I)^(-1) (O^T Y + lam W_o^T)

with ``lam = ridge * mean(diag(O^T O))`` pulling towards the merge's own ``W_o`` in directions the calibration text
barely visits. Where the merge was exact, ``O W_o^T = Y`` and the solution is ``W_o`` itself. The whole ``o_proj``
is solved at once (all heads together), so heads can also make up for each other's losses.

The values are solved with it (``value_refit.py``): each merged value stays in the span of its group's source value
heads, and ``v_proj`` and ``o_proj`` are refit by alternating least squares on the same target (``value_steps``).

Calibration windows: half the tokens in windows of 512 (long contexts), half in windows of 32 (short prompts).

Sequential: layer ``l`` is merged and refit on the hidden states of the model converted so far (layers ``< l``
merged and refit), and its target is the source layer's attention on those same inputs, so each layer also works
from the inputs it will really see (as GPTQ does for quantisation). The merge method gets these activations too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..attention.module import GroupedQueryAttention
from ..models.config import ModelConfig
from ..models.gemma import GemmaDecoderLayer
from .methods import (
    AttentionWeights,
    check_kv_heads,
    convert_layer,
    layer_weights,
    put_layer_weights,
    rope_config,
    with_bias_column,
    with_ones_column,
)
from .query_refit import refit_queries
from .value_refit import VALUE_STEPS, ValueGrams, refit_values_and_output, solve_output

__all__ = [
    "CALIBRATION_WINDOW",
    "RIDGE",
    "SHORT_WINDOW",
    "calibration_windows",
    "check_refit",
    "refit_convert_state",
    "refit_layer",
    "refit_output",
]

# lam / mean(diag(O^T O)). SmolLM2 3 -> 1, o_proj refit, 25k calibration tokens: LICENSE ppl 45.9 at 1e-2, 52.9 at
# 1e-1; v_proj/o_proj refit: 20.39 at 1e-2, 20.32 at 3e-3 (docs/bench/conversion-history.md)
RIDGE = 3e-3
CALIBRATION_WINDOW = 512  # tokens per long calibration window (positions 0..511, as the evaluation windows)
# Every other block of CALIBRATION_WINDOW tokens is cut into windows this short: the first positions of a prompt,
# where attention leans on the first token, then weigh as much as long contexts. With 512-token windows only, the
# refit fit long contexts and broke short prompts (SmolLM2 3 -> 1, a 27-token text: original 543, pca 3,245, refit
# 28,229 perplexity; with half the tokens in 32-token windows 788, and LICENSE.txt 48.0 instead of 45.9).
SHORT_WINDOW = 32
BATCH_TOKENS = 4096  # calibration tokens per batch of windows (bounds the (B, H_q, L, L) attention weights' memory)
QUERY_REFIT = False  # whether refit_layer also refits q_proj (query_refit.py) before the values
# the v_proj/o_proj solves' dtype (the Grams are summed in float64): SmolLM2 3 -> 1, 256 turns, layer 3's objective
# gain over the o_proj refit alone 204,557.9 in float32 vs 204,558.2 in float64, 0.9 vs 1.7 s (docs/conversion.md)
SOLVE_DTYPE = torch.float32


def refit_output(heads: Tensor, Y: Tensor, W0: Tensor, ridge: float = RIDGE) -> Tensor:
    """The ridge least-squares output projection (module docstring), solved in float64.

    Parameters
    ----------
    heads : ``(T, H_q * D)`` ``O``, the per-head attention outputs of the merged layer (``o_proj``'s input).
    Y : ``(T, E)`` the source layer's attention output on the same inputs, minus any ``o_proj`` bias.
    W0 : ``(E, H_q * D)`` the merged layer's ``o_proj`` weight (the ridge's anchor).
    ridge : ``lam / mean(diag(O^T O))``, ``>= 0``.

    Returns
    -------
    ``(E, H_q * D)`` in ``W0``'s dtype.
    """
    if heads.dim() != 2 or Y.dim() != 2 or heads.shape[0] != Y.shape[0] or W0.shape != (Y.shape[1], heads.shape[1]):
        raise ValueError(
            f"refit_output needs heads (T, H*D), Y (T, E), W0 (E, H*D); got heads {tuple(heads.shape)}, "
            f"Y {tuple(Y.shape)}, W0 {tuple(W0.shape)}"
        )
    if ridge < 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")
    H = heads.double()
    return solve_output(H.T @ H, H.T @ Y.double(), W0, ridge)


def _windows(ids: Sequence[int], length: int) -> list[Tensor]:
    """``ids`` cut into windows, alternately one of ``length`` tokens and ``length`` tokens in windows of
    ``SHORT_WINDOW`` (pieces shorter than 2 tokens are dropped), stacked by length into ``(B, L)`` batches of at most
    ``BATCH_TOKENS`` tokens."""
    by_length: dict[int, list[list[int]]] = {}
    start, long = 0, True
    while start < len(ids):
        block = list(ids[start : start + length])
        size = length if long else min(SHORT_WINDOW, length)
        for piece in (block[i : i + size] for i in range(0, len(block), size)):
            if len(piece) > 1:
                by_length.setdefault(len(piece), []).append(piece)
        start, long = start + length, not long
    per_batch = {n: max(1, BATCH_TOKENS // n) for n in by_length}
    return [torch.tensor(p[i : i + per_batch[n]]) for n, p in by_length.items() for i in range(0, len(p), per_batch[n])]


def _attention(cfg: ModelConfig, n: int, w: AttentionWeights, source: GroupedQueryAttention) -> GroupedQueryAttention:
    """A ``GroupedQueryAttention`` with ``n`` KV heads holding ``w`` and everything else of the ``source`` layer's
    attention: RoPE (or none), window, soft-cap, score scale, q/k norms (their weights shared); no ``o_proj`` bias
    (the refit's targets leave it out)."""
    norm = source.q_norm
    attn = GroupedQueryAttention(
        cfg.hidden_size, cfg.num_heads, n, cfg.head_dim, qkv_bias=cfg.attention_bias, rope=source.rope,
        window=source.window, softcap=source.softcap, scale=source.scale, qk_norm=norm is not None,
        norm_eps=1e-6 if norm is None else norm.eps, unit_offset_norm=norm is not None and norm.unit_offset,
    ).eval().to(w.q.device)  # fmt: skip
    for f in ("q", "k", "v", "o"):
        proj = getattr(attn, f"{f}_proj")
        proj.weight.copy_(getattr(w, f))
        if proj.bias is not None:
            proj.bias.copy_(getattr(w, f"{f}_bias"))
    if norm is not None:
        attn.q_norm.weight.copy_(source.q_norm.weight)
        attn.k_norm.weight.copy_(source.k_norm.weight)
    return attn


def layer_output(layer: nn.Module, h: Tensor, attended: Tensor) -> Tensor:
    """The decoder ``layer``'s output for its input ``h`` and its attention's output ``attended`` (``o_proj``'s, bias
    included): Llama's residual sums, or Gemma's with the norms after attention and around the MLP."""
    if isinstance(layer, GemmaDecoderLayer):
        h = h + layer.post_attention_layernorm(attended)
        return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
    h = h + attended
    return h + layer.mlp(layer.post_attention_layernorm(h))


@contextlib.contextmanager
def _timed(times: dict[str, float] | None, phase: str) -> Iterator[None]:
    """Add the wall time of the block to ``times[phase]`` (nothing when ``times`` is ``None``)."""
    start = time.perf_counter()
    yield
    if times is not None:
        times[phase] = times.get(phase, 0.0) + time.perf_counter() - start


def _refit_layer(
    cfg: ModelConfig,
    source: AttentionWeights,
    merged: AttentionWeights,
    attn: GroupedQueryAttention,
    X: list[Tensor],
    targets: list[Tensor],
    cos_sin: Callable,
    ridge: float,
    value_steps: int,
    times: dict[str, float] | None = None,
) -> AttentionWeights:
    """``merged`` with ``v_proj`` and ``o_proj`` refit (``value_refit.py``) against the source layer's outputs
    ``targets`` (``(B * L, E)`` per batch of windows ``X (B, L, E)``), ``attn`` holding ``merged``."""
    H, D, N = cfg.num_heads, cfg.head_dim, attn.num_kv_heads
    r = cfg.num_kv_heads // N * D  # source value dims per new KV head
    device = merged.v.device
    groups = torch.arange(H, device=device) // (H // N)  # the new KV head each query head reads
    W_src = with_bias_column(source.v, source.v_bias).view(N, r, -1)  # group g's source value rows (r, E + 1)
    v_new = with_bias_column(merged.v, merged.v_bias).view(N, D, -1)
    B = torch.stack([torch.linalg.lstsq(W_src[g].T.cpu(), v_new[g].T.cpu(), driver="gelsd").solution.T
                     for g in range(N)]).to(device)  # fmt: skip  # gelsd (rank-revealing) is CPU-only
    grams = ValueGrams(H, r, cfg.hidden_size, device)
    with _timed(times, "grams"):
        for x, y in zip(X, targets, strict=True):
            _, A = attn(x, attn_mask=None, is_causal=True, rope_cos_sin=cos_sin(x.shape[1]), cache=None,
                        need_weights=True)  # fmt: skip
            values = (
                (with_ones_column(x) @ W_src.flatten(0, 1).T).float().unflatten(-1, (N, r)).transpose(1, 2)
            )  # (B, N, L, r)
            grams.add((A @ values[:, groups]).transpose(0, 1).flatten(1, 2), y)  # U (H, B * L, r)
    with _timed(times, "solve"):
        solve_dtype = torch.promote_types(SOLVE_DTYPE, merged.o.dtype)  # a float64 model solves in float64
        B, W_o = refit_values_and_output(grams, B, merged.o, groups, value_steps, ridge, solve_dtype)
    v = torch.einsum("gdr,gre->gde", B.to(W_src.dtype), W_src).flatten(0, 1).to(merged.v.dtype)  # (N * D, E + 1)
    v_bias = v[:, -1].contiguous() if source.v_bias is not None else None
    return dataclasses.replace(merged, v=v[:, :-1].contiguous(), v_bias=v_bias, o=W_o)


def refit_layer(
    cfg: ModelConfig,
    layer: nn.Module,
    w: AttentionWeights,
    hidden: list[Tensor],
    kv_heads: int,
    method: str,
    *,
    ridge: float = RIDGE,
    value_steps: int = VALUE_STEPS,
    times: dict[str, float] | None = None,
) -> tuple[AttentionWeights, list[Tensor]]:
    """One step of the sequential refit: merge and refit source layer ``layer`` (a ``DecoderLayer`` holding ``w``)
    on ``hidden``, the converted model's hidden states entering it (``(B, L, E)`` per batch of windows, float32 on
    the layer's device); returns the merged weights and the hidden states leaving the merged layer. ``times``, when
    given, gets each phase's wall seconds added: ``merge``, ``targets`` (the source layer's outputs), ``grams`` (the
    merged attention's passes and Gram sums), ``solve`` (the alternating least squares), ``carry`` (the hidden states
    through the refit layer)."""
    source = layer.self_attn
    rope = source.rope

    def cos_sin(length: int) -> tuple[Tensor, Tensor] | None:  # None: a layer without RoPE
        return None if rope is None else rope.cos_sin(torch.arange(length, device=rope.inv_freq.device))

    X = [layer.input_layernorm(h) for h in hidden]
    with _timed(times, "merge"):
        acts = torch.cat([x.flatten(0, 1) for x in X]).cpu()  # the merge's small eigen problems run on the CPU
        merged = convert_layer(
            w.to("cpu"), rope_config(cfg, getattr(layer, "local_rope", False)), kv_heads, method, acts
        ).to(w.q.device)
    if QUERY_REFIT:

        def probabilities(x: Tensor) -> Tensor:  # the source layer's attention on x: (B, H_q, L, L)
            return layer.self_attn(x, is_causal=True, rope_cos_sin=cos_sin(x.shape[1]), need_weights=True)[1]

        merged = refit_queries(cfg, w, merged, X, probabilities, ridge)
    attn = _attention(cfg, kv_heads, merged, source)
    with _timed(times, "targets"):
        targets = [source(x, attn_mask=None, is_causal=True, rope_cos_sin=cos_sin(x.shape[1]), cache=None)
                   .flatten(0, 1) for x in X]  # fmt: skip
    o_bias = source.o_proj.bias
    if o_bias is not None:
        targets = [t - o_bias for t in targets]
    merged = _refit_layer(cfg, w, merged, attn, X, targets, cos_sin, ridge, value_steps, times)
    attn = _attention(cfg, kv_heads, merged, source)
    outputs = []
    with _timed(times, "carry"):
        for h, x in zip(hidden, X, strict=True):  # through the refit layer's attention
            attended = attn(x, attn_mask=None, is_causal=True, rope_cos_sin=cos_sin(x.shape[1]), cache=None)
            outputs.append(layer_output(layer, h, attended if o_bias is None else attended + o_bias))
    return merged, outputs


def check_refit(cfg: ModelConfig, kv_heads: int, method: str, value_steps: int) -> None:
    """``ValueError`` unless the refit applies: a merge ``kv_heads < H_kv`` by a known method, ``value_steps >= 0``."""
    check_kv_heads(cfg, kv_heads, method)
    if isinstance(value_steps, bool) or not isinstance(value_steps, int) or value_steps < 0:
        raise ValueError(f"value_steps must be an int >= 0, got {value_steps!r}")
    if kv_heads >= cfg.num_kv_heads:
        raise ValueError(f"the refit applies to merges only: kv_heads ({kv_heads}) >= {cfg.num_kv_heads}")


def calibration_windows(cfg: ModelConfig, calibration_ids: Sequence[int], window: int) -> list[Tensor]:
    """The refit's batches of calibration windows ``(B, L)`` (``_windows``); ``ValueError`` when there are none."""
    windows = _windows(list(calibration_ids), min(window, cfg.max_position_embeddings))
    if not windows:
        raise ValueError("calibration text must have at least 2 tokens for the o_proj refit")
    return windows


@torch.no_grad()
def refit_convert_state(
    cfg: ModelConfig,
    state: dict[str, Tensor],
    kv_heads: int,
    method: str,
    calibration_ids: Sequence[int],
    *,
    ridge: float = RIDGE,
    window: int = CALIBRATION_WINDOW,
    value_steps: int = VALUE_STEPS,
    progress: bool = False,
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Like ``convert_state`` with a merge (``kv_heads < H_kv``), sequentially calibrated, ``v_proj``/``o_proj`` refit.

    Parameters
    ----------
    cfg, state : the source model (float32 tensors by HF name).
    kv_heads : N, a divisor of ``cfg.num_kv_heads`` smaller than it.
    method : the merge (a name in ``METHODS``); it gets each layer's inputs ``(T, E)`` in the converted model.
    calibration_ids : the calibration text's token ids: blocks of ``window`` tokens, alternately one window and
        windows of ``SHORT_WINDOW`` tokens.
    ridge : see ``refit_output``.
    window : tokens per calibration window (at most the model's context).
    value_steps : value solves of the joint ``v_proj``/``o_proj`` refit (``value_refit.py``); 0: ``o_proj`` alone.
    progress : a tqdm bar over the layers on stderr.

    Returns
    -------
    ``(ModelConfig, dict)`` as ``convert_state``: tensors that do not change are the input's own. The whole model is
    in memory here; ``gqa.convert.streaming`` runs the same steps (``refit_layer``) one layer at a time from disk.
    """
    from ..models import CausalLM

    check_refit(cfg, kv_heads, method, value_steps)
    windows = calibration_windows(cfg, calibration_ids, window)
    source = CausalLM.from_state(cfg, state, assign=True)  # shares the tensors: only read
    out = dict(state)
    hidden = [source.model.embed(ids) for ids in windows]  # (B, L, E) each: the converted model's stream
    layers = tqdm(source.model.layers, desc="merge + refit", unit="layer", disable=not progress, file=sys.stderr)
    for i, layer in enumerate(layers):
        w = layer_weights(state, i)
        merged, hidden = refit_layer(cfg, layer, w, hidden, kv_heads, method, ridge=ridge, value_steps=value_steps)
        put_layer_weights(out, i, merged)
    return dataclasses.replace(cfg, num_kv_heads=kv_heads), out
