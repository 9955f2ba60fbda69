"""Streaming conversion: a model converted one layer at a time from disk, for models larger than memory.

``stream_convert`` reads the source lazily (``gqa.loaders.lazy``: safetensors shards memory-mapped a read at a time,
GGUF tensors read one by one), and for each decoder layer in turn reads its tensors, converts its attention, writes
every tensor of the layer to its planned place in the output shards (``gqa.convert.shards``) and lets the layer go.
The calibration text travels through the layers as hidden states, as in the in-memory conversions it reproduces:

* no calibration (``mean``/``first``, expansion, copying): each layer on its own (``convert_state``);
* calibrated merge without the refit: each layer's attention inputs in the *source* model, the hidden states carried
  through the source layers (``convert_state`` on ``_calibration_activations``' windows);
* with the refit (``refit_convert_state``): each layer merged and refit on the hidden states of the model converted so
  far, then carried through the converted layer (``refit.refit_layer``, the same step).

Peak memory: one layer's weights (as stored, and as float32 on ``device``), the embedding matrix while the calibration
windows are embedded, and the calibration hidden states (``T x hidden`` float32, a few copies with the refit) — not the
model. Arithmetic runs in float32 on ``device`` whatever the stored dtype. Unless a ``dtype`` is asked for, every tensor
is written in its own source dtype (``LazyModel.dtypes``; a GGUF's quantized blocks: float32), a computed tensor in
that of the source tensor it replaces: a bf16 model stays bf16, a llama.cpp file's F32 norms and biases next to its
BF16/F16 matrices stay F32, and the tensors the conversion does not touch come out bit for bit (``write_dtypes``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from tqdm.auto import tqdm

from ..attention.rope import RoPE
from ..loaders.lazy import LazyModel
from ..models.config import ModelConfig
from ..models.llama import decoder_layer, model_rope
from .methods import (
    check_kv_heads,
    convert_layer,
    layer_tensor_names,
    layer_weights,
    local_rope,
    put_layer_weights,
    rope_config,
)
from .refit import CALIBRATION_WINDOW, RIDGE, calibration_windows, check_refit, refit_layer
from .shards import DEFAULT_MAX_SHARD_SIZE, ShardedWriter
from .value_refit import VALUE_STEPS
from .writer import weight_specs

__all__ = ["SOURCE_WINDOW", "converted_shapes", "source_windows", "stream_convert", "write_dtypes"]

SOURCE_WINDOW = 2048  # tokens per calibration window read by the source model (no refit), at most its context


def source_windows(cfg: ModelConfig, ids: Sequence[int]) -> list[Tensor]:
    """``ids`` cut into ``(1, L)`` windows of ``min(context, SOURCE_WINDOW)`` tokens (the last one shorter)."""
    window = min(cfg.max_position_embeddings, SOURCE_WINDOW)
    return [torch.tensor([list(ids[i : i + window])]) for i in range(0, len(ids), window)]


def converted_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], kv_heads: int) -> dict[str, tuple]:
    """The shapes of the converted model's tensors: ``k_proj``/``v_proj`` (and biases) with ``kv_heads`` heads."""
    out = dict(shapes)
    for i in range(cfg.num_layers):
        for field, name in layer_tensor_names(i).items():
            if field[0] in "kv" and name in shapes:
                out[name] = (kv_heads * cfg.head_dim, *shapes[name][1:])
    return out


def write_dtypes(source: LazyModel, dtype: torch.dtype | None = None) -> dict[str, torch.dtype]:
    """The dtype each tensor of ``source`` is written in, by HF name: ``dtype`` for all of them, or (``None``) each
    its own source dtype (``source.dtypes``: F32 norms and biases stay float32 next to bf16 matrices; a GGUF's
    quantized blocks give float32). A converted ``k_proj``/``v_proj`` (or bias) takes the dtype of the tensor of the
    same name it replaces."""
    return dict(source.dtypes) if dtype is None else dict.fromkeys(source.shapes, dtype)


def _layer(
    cfg: ModelConfig, tensors: dict[str, Tensor], i: int, rope: RoPE, local: RoPE | None = None
) -> torch.nn.Module:
    """Source layer ``i`` as a module holding ``tensors`` (HF names, float32, on the rope's device); ``local``: the
    RoPE of Gemma 3's sliding layers."""
    prefix = f"model.layers.{i}."
    with torch.device("meta"):
        layer = decoder_layer(cfg, rope, i, local)
    layer.load_state_dict({n.removeprefix(prefix): t for n, t in tensors.items()}, strict=True, assign=True)
    return layer.eval()


def _embedded(cfg: ModelConfig, ids: Tensor, embed: Tensor) -> Tensor:
    """The first layer's input for token ids ``ids``: their embeddings, scaled by ``sqrt(hidden_size)`` for Gemma
    (in the embeddings' dtype, as ``GemmaBackbone.embed``)."""
    x = F.embedding(ids.to(embed.device), embed)
    return x * torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype) if cfg.gemma else x


def _rotations(cfg: ModelConfig, rope: RoPE, local: RoPE | None, length: int) -> tuple:
    """What a layer's forward takes for positions ``0..length-1``: ``(cos, sin)``, or Gemma's (global, local) pair."""
    positions = torch.arange(length, device=rope.inv_freq.device)
    glob = rope.cos_sin(positions)
    if not cfg.gemma:
        return glob
    return glob, glob if local is None else local.cos_sin(positions)


@torch.no_grad()
def stream_convert(
    source: LazyModel,
    folder: Path,
    kv_heads: int,
    method: str,
    *,
    calibration_ids: Sequence[int] | None = None,
    refit: bool = False,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    ridge: float = RIDGE,
    window: int = CALIBRATION_WINDOW,
    value_steps: int = VALUE_STEPS,
    progress: bool = False,
) -> tuple[ModelConfig, list[Path]]:
    """Convert ``source`` to ``kv_heads`` KV heads one layer at a time, writing its weights into ``folder``.

    Parameters
    ----------
    source : the model to convert (``gqa.loaders.lazy.open_lazy``).
    folder : an existing folder to write the weight files into (``model.safetensors``, or shards of at most
        ``max_shard_size`` and ``model.safetensors.index.json``); nothing else is written.
    kv_heads, method : as ``gqa.convert.convert``.
    calibration_ids : token ids the merge (and the refit) calibrate on, or ``None``.
    refit : run the sequential ``v_proj``/``o_proj`` refit (needs ``calibration_ids`` and a merge).
    dtype : the dtype every written tensor is cast to; default ``None``: each tensor its own source dtype
        (``write_dtypes``), so the tensors the conversion does not change are written bit for bit.
    device : where the arithmetic runs (the merges' small eigen/least-squares problems run on the CPU).
    ridge, window, value_steps : the refit's (``gqa.convert.refit.refit_convert_state``).
    progress : a tqdm bar over the layers on stderr, with the time left (and, with the refit, the last layer's
        seconds per phase).

    Returns
    -------
    ``(ModelConfig, files)`` : the converted model's config and the weight files written.
    """
    cfg = source.config
    device = torch.device(device)
    check_kv_heads(cfg, kv_heads, method)
    merging = kv_heads < cfg.num_kv_heads
    refit = refit and merging
    if refit:
        if calibration_ids is None:
            raise ValueError("the refit calibrates on text: pass calibration_ids")
        check_refit(cfg, kv_heads, method, value_steps)
        windows = calibration_windows(cfg, calibration_ids, window)
    else:
        windows = source_windows(cfg, calibration_ids) if merging and calibration_ids else []
    if merging and calibration_ids is not None and not windows:
        raise ValueError("the calibration text encodes to no tokens")
    new_cfg = dataclasses.replace(cfg, num_kv_heads=kv_heads)
    dtypes = write_dtypes(source, dtype)
    specs = weight_specs(new_cfg, converted_shapes(cfg, source.shapes, kv_heads), source.dtype)
    specs = [dataclasses.replace(s, dtype=dtypes[s.name]) for s in specs]
    writer = ShardedWriter(folder, specs, max_shard_size)

    def write(tensors: dict[str, Tensor]) -> None:
        for name, t in tensors.items():
            if name in writer.places:  # a tied lm_head is not stored
                writer.write(name, t)

    embed_name = "model.embed_tokens.weight"
    embed = source.read([embed_name])[embed_name]
    write({embed_name: embed})
    hidden = [_embedded(cfg, ids, embed).to(device, torch.float32) for ids in windows]
    del embed
    rope = model_rope(cfg).to(device)
    local = model_rope(cfg, local=True).to(device) if cfg.rope_local_theta is not None else None
    bar = tqdm(range(cfg.num_layers), desc="merge + refit" if refit else "convert", unit="layer",
               disable=not progress, file=sys.stderr, dynamic_ncols=True)  # fmt: skip
    for i in bar:
        stored = source.read(n for n in source.shapes if n.startswith(f"model.layers.{i}."))
        tensors = {n: t.to(device, torch.float32) for n, t in stored.items()}
        del stored
        layer = _layer(cfg, tensors, i, rope, local)
        w = layer_weights(tensors, i)
        if refit:
            times: dict[str, float] = {}
            merged, hidden = refit_layer(cfg, layer, w, hidden, kv_heads, method, ridge=ridge, value_steps=value_steps,
                                         times=times)  # fmt: skip
            bar.set_postfix_str(" ".join(f"{k} {v:.1f}s" for k, v in times.items()), refresh=False)
        else:
            acts = None
            if hidden:
                rotations = [_rotations(cfg, rope, local, h.shape[1]) for h in hidden]
                acts = torch.cat([layer.input_layernorm(h).flatten(0, 1) for h in hidden]).cpu()  # (T, E)
                hidden = [layer(h, None, r, None) for h, r in zip(hidden, rotations, strict=True)]
            merged = convert_layer(w.to("cpu"), rope_config(cfg, local_rope(cfg, i)), kv_heads, method, acts)
        put_layer_weights(tensors, i, merged)
        write(tensors)
        del tensors, layer, w, merged
    write(source.read(n for n in ("model.norm.weight", "lm_head.weight") if n in source.shapes))
    return new_cfg, writer.close()
