"""Read an HF checkpoint folder: ``config.json`` and ``*.safetensors`` weights, single-file or sharded through
``model.safetensors.index.json``. Tensor names are already HF names; tensors come back as float32. The config and the
tensor index (names, shapes, dtypes) are read without importing torch (``gqa info``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from ..models.config import ModelConfig
from .expected import check_tensors

if TYPE_CHECKING:
    import torch

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
    """``name -> (shape, dtype name)`` for every tensor in a safetensors file, or (``keep`` given) ``name -> tensor``
    (as stored) for those named in ``keep``. The file is memory-mapped only while this runs; torch is imported only
    for the tensors (the header is read as numpy's)."""
    try:
        with safe_open(file, framework="numpy" if keep is None else "pt") as f:
            if keep is None:
                return {name: _shape_dtype(f.get_slice(name)) for name in f.keys()}  # noqa: SIM118
            return {name: f.get_tensor(name) for name in f.keys() if name in keep}  # noqa: SIM118
    except Exception as e:  # safetensors raises SafetensorError, OSError, ... on damaged files
        raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None


_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors -> torch name


def _shape_dtype(view: Any) -> tuple[tuple[int, ...], str | None]:
    return tuple(view.get_shape()), _DTYPES.get(view.get_dtype())


def hf_tensor_index(folder: Path) -> tuple[ModelConfig, dict[str, tuple[Path, tuple[int, ...], str | None]]]:
    """An HF checkpoint folder's config, and by HF name the shard, shape and stored dtype (torch's name for it,
    ``"bfloat16"``; ``None``: not a float) of every tensor the model uses (no ``lm_head.weight`` when tied, no
    ``rotary_emb.inv_freq``); no weights are read, nor torch imported.

    Raises
    ------
    ValueError
        A missing or damaged ``config.json``, index or shard, or missing/unexpected/misshapen tensors.
    """
    cfg = hf_config(folder)
    index: dict[str, tuple[Path, tuple[int, ...], str | None]] = {}
    for file in _shard_files(folder):
        for name, (shape, dtype) in _read_shard(file).items():
            if name in index:
                raise ValueError(f"{file}: tensor {name} is stored in more than one shard")
            index[name] = (file, shape, dtype)
    ignored = {n for n in index if n.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        ignored.add("lm_head.weight")
    index = {n: v for n, v in index.items() if n not in ignored}
    check_tensors(cfg, {n: v[1] for n, v in index.items()}, str(folder))
    return cfg, index


def read_hf_tensors(index: dict[str, tuple[Path, Any, Any]], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` (as stored) from the shards ``hf_tensor_index`` found, each shard opened once."""
    by_file: dict[Path, set[str]] = {}
    for name in names:
        by_file.setdefault(index[name][0], set()).add(name)
    out: dict[str, torch.Tensor] = {}
    for file, keep in by_file.items():
        out |= _read_shard(file, keep)
    return out


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
    cfg, index = hf_tensor_index(Path(folder))
    tensors: dict[str, torch.Tensor] = {}
    for file in dict.fromkeys(entry[0] for entry in index.values()):  # a shard at a time: its float32 copies
        names = [name for name, entry in index.items() if entry[0] == file]
        tensors |= {name: t.float() for name, t in read_hf_tensors(index, names).items()}
    return cfg, tensors
