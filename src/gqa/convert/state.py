"""KV-head conversion in memory: ``convert_state`` gives a model's config and HF-named tensors a new number of KV
heads; ``_calibration_activations`` are the per-layer attention inputs its calibrated methods read (the streamed
conversion, ``gqa.convert.streaming``, computes the same a layer at a time)."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

from ..models.config import ModelConfig
from .methods import check_kv_heads, convert_layer, layer_weights, local_rope, put_layer_weights, rope_config
from .streaming import source_windows

if TYPE_CHECKING:
    from ..loaders.tokenizer import Tokenizer


def convert_state(
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    kv_heads: int,
    method: str = "mean",
    activations: list[torch.Tensor] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """In memory: a model's config and HF-named tensors with ``kv_heads`` KV heads in every layer.

    Parameters
    ----------
    cfg, state : as ``gqa.loaders.read_model`` returns them (float32 tensors by HF name).
    kv_heads : N, the new KV head count.
    method : a name in ``METHODS``, used when N < ``cfg.num_kv_heads``.
    activations : per layer, ``(T, hidden)`` calibration inputs of the attention, or ``None``.

    Returns
    -------
    (ModelConfig, dict) : the new config (``num_kv_heads = N``) and a new dict; tensors that do not change are the
    input's own (not copies).
    """
    check_kv_heads(cfg, kv_heads, method)
    out = dict(state)
    for i in range(cfg.num_layers):
        new = convert_layer(
            layer_weights(state, i), rope_config(cfg, local_rope(cfg, i)), kv_heads, method,
            None if activations is None else activations[i],
        )  # fmt: skip
        put_layer_weights(out, i, new)
    return dataclasses.replace(cfg, num_kv_heads=kv_heads), out


def _calibration_activations(
    cfg: ModelConfig, state: dict[str, torch.Tensor], tok: Tokenizer, text: str | list[int], progress: bool = False
) -> list[torch.Tensor]:
    """Per layer ``(T, hidden)``: the input of each attention (after ``input_layernorm``) in the source model, on
    ``text`` (or token ids) cut into windows of at most ``min(max_position_embeddings, SOURCE_WINDOW)`` tokens
    (``source_windows``). The model in memory; ``stream_convert`` computes the same a layer at a time."""
    from ..models import CausalLM

    ids = tok.encode(text) if isinstance(text, str) else text
    if not ids:
        raise ValueError("calibration_text encodes to no tokens")
    model = CausalLM.from_state(cfg, state, assign=True)  # shares the tensors: no second copy of the weights
    acts: list[list[torch.Tensor]] = [[] for _ in range(cfg.num_layers)]
    hooks = [
        layer.self_attn.register_forward_pre_hook(lambda _m, args, i=i: acts[i].append(args[0].flatten(0, 1)))
        for i, layer in enumerate(model.model.layers)
    ]
    windows = tqdm(source_windows(cfg, ids), desc="calibration", unit="window", disable=not progress, file=sys.stderr)
    try:
        with torch.inference_mode():
            for window in windows:
                model(window, last_only=True)  # the layers see every token; the logits are not needed
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(a) for a in acts]  # (T, hidden) each
