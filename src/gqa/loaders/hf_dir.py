"""Read an HF checkpoint folder: ``config.json`` and ``*.safetensors`` weights, single-file or sharded through
``model.safetensors.index.json``. Tensor names are already HF names; tensors come back as float32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..models.config import ModelConfig
from .expected import check_tensors

INDEX_NAME = "model.safetensors.index.json"


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{file}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not a readable JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def hf_config(folder: Path) -> ModelConfig:
    """The ``ModelConfig`` of ``folder/config.json``."""
    file = folder / "config.json"
    try:
        return ModelConfig.from_hf(_read_json(file))
    except ValueError as e:
        raise ValueError(str(e) if str(e).startswith(str(file)) else f"{file}: {e}") from None


def _shard_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights: those the index names, else every ``*.safetensors``."""
    index = folder / INDEX_NAME
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: lacks a non-empty 'weight_map'")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{folder}: no *.safetensors weights (and no {INDEX_NAME})")
    for file in files:
        if not file.is_file():
            raise ValueError(f"{file}: safetensors shard not found (listed in {index})")
    return files


def _read_shard(file: Path, keep: set[str] | None = None) -> dict[str, Any]:
    """``name -> shape`` for every tensor in a safetensors file, or (``keep`` given) ``name -> float32 tensor`` for
    those named in ``keep``."""
    try:
        with safe_open(file, framework="pt") as f:
            if keep is None:
                return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
            return {name: f.get_tensor(name).float() for name in f.keys() if name in keep}  # noqa: SIM118
    except Exception as e:  # safetensors raises SafetensorError, OSError, ... on damaged files
        raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def read_hf_dir(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF checkpoint folder.

    Returns
    -------
    (ModelConfig, dict) : the config and the float32 tensors by HF name; no ``lm_head.weight`` when the config ties
    it to ``model.embed_tokens.weight`` (a stored copy is dropped).

    Raises
    ------
    ValueError
        A missing or damaged ``config.json``, index or shard, or missing/unexpected/misshapen tensors.
    """
    folder = Path(folder)
    cfg = hf_config(folder)
    files = _shard_files(folder)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        for name, shape in _read_shard(file).items():
            if name in shapes:
                raise ValueError(f"{file}: tensor {name} is stored in more than one shard")
            shapes[name] = shape
    ignored = {n for n in shapes if n.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        ignored.add("lm_head.weight")
    keep = set(shapes) - ignored
    check_tensors(cfg, {n: shapes[n] for n in keep}, str(folder))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors |= _read_shard(file, keep)
    return cfg, tensors
