"""The least-squares ``o_proj`` refit: after a layer's K/V heads are merged, solve its output projection again so the
layer's attention output matches the source's on calibration text, one layer after another along the converted
model's own activations.

A merge method fits keys and values each in its own metric and ignores the softmax. What the rest of the model sees
is ``y = O W_o^T`` with ``O = [o_1 ... o_Hq] (T, H_q * D)`` the per-query-head attention outputs: linear in ``W_o``.
So, given the merged heads, the best ``W_o`` in the least-squares sense is a ridge regression against the source
layer's output ``Y (T, E)`` on the same inputs:

    W_o' = argmin_W ||O W^T - Y||^2 + lam ||W - W_o||^2,     W_o'^T = (O^T O + lam I)^(-1) (O^T Y + lam W_o^T)

with ``lam = ridge * mean(diag(O^T O))`` pulling towards the merge's own ``W_o`` in directions the calibration text
barely visits. Where the merge was exact, ``O W_o^T = Y`` and the solution is ``W_o`` itself. The whole ``o_proj``
is solved at once (all heads together), so heads can also make up for each other's losses.

Calibration windows: half the tokens in windows of 512 (long contexts), half in windows of 32 (short prompts).

Sequential: layer ``l`` is merged and refit on the hidden states of the model converted so far (layers ``< l``
merged and refit), and its target is the source layer's attention on those same inputs, so each layer also works
from the inputs it will really see (as GPTQ does for quantisation). The merge method gets these activations too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..attention import GroupedQueryAttention
from ..models.config import ModelConfig
from .methods import AttentionWeights, check_kv_heads, convert_layer, layer_tensor_names

__all__ = ["CALIBRATION_WINDOW", "RIDGE", "SHORT_WINDOW", "refit_convert_state", "refit_output"]

RIDGE = 1e-2  # lam / mean(diag(O^T O)); SmolLM2 3 -> 1, 25k calibration tokens: LICENSE ppl 45.9 here, 52.9 at 1e-1
CALIBRATION_WINDOW = 512  # tokens per long calibration window (positions 0..511, as the evaluation windows)
# Every other block of CALIBRATION_WINDOW tokens is cut into windows this short: the first positions of a prompt,
# where attention leans on the first token, then weigh as much as long contexts. With 512-token windows only, the
# refit fit long contexts and broke short prompts (SmolLM2 3 -> 1, a 27-token text: original 543, pca 3,245, refit
# 28,229 perplexity; with half the tokens in 32-token windows 788, and LICENSE.txt 48.0 instead of 45.9).
SHORT_WINDOW = 32


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
    H, Y, W = heads.double(), Y.double(), W0.double()
    G = H.T @ H  # (H*D, H*D)
    lam = ridge * G.diagonal().mean()
    solved = torch.linalg.solve(G + lam * torch.eye(G.shape[0], dtype=G.dtype), H.T @ Y + lam * W.T)  # (H*D, E)
    return solved.T.to(W0.dtype).contiguous()


def _windows(ids: Sequence[int], length: int) -> list[Tensor]:
    """``ids`` cut into ``(1, L)`` windows: alternately one of ``length`` tokens and ``length`` tokens in windows of
    ``SHORT_WINDOW`` (pieces shorter than 2 tokens are dropped)."""
    out, start, long = [], 0, True
    while start < len(ids):
        block = ids[start : start + length]
        size = length if long else min(SHORT_WINDOW, length)
        out += [torch.tensor([block[i : i + size]]) for i in range(0, len(block), size) if len(block[i : i + size]) > 1]
        start, long = start + length, not long
    return out


def _attention(cfg: ModelConfig, n: int, w: AttentionWeights, rope) -> GroupedQueryAttention:
    """A ``GroupedQueryAttention`` with ``n`` KV heads holding ``w``."""
    attn = GroupedQueryAttention(
        cfg.hidden_size, cfg.num_heads, n, cfg.head_dim, qkv_bias=cfg.attention_bias, rope=rope
    ).eval()
    for f in ("q", "k", "v", "o"):
        proj = getattr(attn, f"{f}_proj")
        proj.weight.copy_(getattr(w, f))
        if proj.bias is not None:
            proj.bias.copy_(getattr(w, f"{f}_bias"))
    return attn


def _head_outputs(attn: GroupedQueryAttention, X: list[Tensor], cos_sin: Callable) -> list[Tensor]:
    """Per window, ``o_proj``'s input ``(1, L, H_q * D)``: the attention's per-head outputs."""
    captured: list[Tensor] = []
    hook = attn.o_proj.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        for x in X:
            attn(x, attn_mask=None, is_causal=True, rope_cos_sin=cos_sin(x.shape[1]), cache=None)
    finally:
        hook.remove()
    return captured


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
) -> tuple[ModelConfig, dict[str, Tensor]]:
    """Like ``convert_state`` with a merge (``kv_heads < H_kv``), sequentially calibrated and with ``o_proj`` refit.

    Parameters
    ----------
    cfg, state : the source model (float32 tensors by HF name).
    kv_heads : N, a divisor of ``cfg.num_kv_heads`` smaller than it.
    method : the merge (a name in ``METHODS``); it gets each layer's inputs ``(T, E)`` in the converted model.
    calibration_ids : the calibration text's token ids: blocks of ``window`` tokens, alternately one window and
        windows of ``SHORT_WINDOW`` tokens.
    ridge : see ``refit_output``.
    window : tokens per calibration window (at most the model's context).

    Returns
    -------
    ``(ModelConfig, dict)`` as ``convert_state``: tensors that do not change are the input's own.
    """
    from ..models import CausalLM

    check_kv_heads(cfg, kv_heads, method)
    if kv_heads >= cfg.num_kv_heads:
        raise ValueError(f"the refit applies to merges only: kv_heads ({kv_heads}) >= {cfg.num_kv_heads}")
    windows = _windows(list(calibration_ids), min(window, cfg.max_position_embeddings))
    if not windows:
        raise ValueError("calibration text must have at least 2 tokens for the o_proj refit")
    source = CausalLM.from_state(cfg, state, assign=True)  # shares the tensors: only read
    rope = source.model.rope

    def cos_sin(length: int) -> tuple[Tensor, Tensor]:
        return rope.cos_sin(torch.arange(length))

    out = dict(state)
    hidden = [source.model.embed_tokens(ids) for ids in windows]  # (1, L, E) each: the converted model's stream
    for i, layer in enumerate(source.model.layers):
        names = layer_tensor_names(i)
        X = [layer.input_layernorm(h) for h in hidden]
        w = AttentionWeights(**{f: state.get(n) for f, n in names.items()})
        merged = convert_layer(w, cfg, kv_heads, method, torch.cat([x.flatten(0, 1) for x in X]))
        attn = _attention(cfg, kv_heads, merged, rope)
        heads = _head_outputs(attn, X, cos_sin)
        target = torch.cat([layer.self_attn(x, attn_mask=None, is_causal=True, rope_cos_sin=cos_sin(x.shape[1]),
                                            cache=None).flatten(0, 1) for x in X])  # fmt: skip
        if attn.o_proj.bias is not None:
            target = target - attn.o_proj.bias
        merged = dataclasses.replace(merged, o=refit_output(torch.cat([o.flatten(0, 1) for o in heads]), target,
                                                            merged.o, ridge))  # fmt: skip
        attn.o_proj.weight.copy_(merged.o)
        hidden = [h + attn.o_proj(o) for h, o in zip(hidden, heads, strict=True)]  # the refit layer's attention
        hidden = [h + layer.mlp(layer.post_attention_layernorm(h)) for h in hidden]
        for f, n in names.items():
            t = getattr(merged, f)
            if t is not None:
                out[n] = t
    return dataclasses.replace(cfg, num_kv_heads=kv_heads), out
