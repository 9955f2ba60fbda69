"""Write an HF checkpoint folder safely: never into the source, never over an existing folder without ``force``, and
all-or-nothing — everything is written into a hidden temporary folder next to the destination (same filesystem) and
renamed into place at the end; a replaced folder is moved aside first and deleted only once the new one is in place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..models.config import ModelConfig
from .shards import DEFAULT_MAX_SHARD_SIZE, INDEX_NAME, WEIGHTS_NAME, ShardedWriter, TensorSpec

__all__ = [
    "WEIGHTS_NAME",
    "check_destination",
    "remove_weights",
    "staged",
    "weight_specs",
    "write_checkpoint",
    "write_config",
    "write_weights",
]


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (both already resolved)."""
    return path == folder or folder in path.parents


def check_destination(sources: list[Path], dst: Path, force: bool) -> Path:
    """The resolved destination, after refusing one that would touch a source or an existing path.

    Parameters
    ----------
    sources : the paths the model is read from (as given and as resolved: a folder, a ``.gguf`` file, or both).
    dst : the folder to write.
    force : allow replacing an existing ``dst``.

    Raises
    ------
    ValueError
        ``dst`` is a source file, is inside a source folder, or contains a source (replacing it would delete it).
    FileExistsError
        ``dst`` exists and ``force`` is false.
    """
    out = Path(dst).expanduser().resolve()
    for src in sources:
        src = Path(src).expanduser().resolve()
        if src.is_dir() and _inside(out, src):
            raise ValueError(f"destination {dst} is inside the source folder {src}; choose a folder outside it")
        if _inside(src, out):
            what = "is the source file" if src == out else "contains the source"
            raise ValueError(f"destination {dst} {what} {src}; choose another destination")
    if (out.exists() or out.is_symlink()) and not force:
        raise FileExistsError(f"destination {dst} already exists; pass force=True (--force) to replace it")
    return out


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def _move_into_place(tmp: Path, dst: Path, force: bool) -> None:
    """Rename ``tmp`` to ``dst``; with ``force`` an existing ``dst`` is moved aside first and deleted afterwards,
    or moved back if the rename fails."""
    old = None
    if dst.exists() or dst.is_symlink():
        if not force:
            raise FileExistsError(f"destination {dst} appeared while converting; pass force=True to replace it")
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        old.rmdir()  # only the unique name is wanted
        os.replace(dst, old)
    try:
        os.replace(tmp, dst)
    except BaseException:
        if old is not None:
            os.replace(old, dst)
        raise
    if old is not None:
        _remove(old)


@contextmanager
def staged(dst: Path, force: bool = False) -> Iterator[Path]:
    """A new empty folder next to ``dst`` (same filesystem, hidden name) to write a checkpoint into; when the block
    ends it is renamed to ``dst`` (an existing ``dst`` replaced only with ``force``), and on any failure or interrupt
    it is removed and ``dst`` is left as it was. ``dst``'s parent is created if missing."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
        yield tmp
        _move_into_place(tmp, dst, force)
    except BaseException:
        _remove(tmp)
        raise


def write_config(
    folder: Path, cfg: ModelConfig, dtype: torch.dtype = torch.float32, generation_config: dict[str, Any] | None = None
) -> None:
    """``config.json`` (``cfg.to_hf()``, weights in ``dtype``) and ``generation_config.json`` (if given)."""
    hf = cfg.to_hf() | {"dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    if generation_config is not None:
        text = json.dumps(generation_config, indent=2) + "\n"
        (folder / "generation_config.json").write_text(text, encoding="utf-8")


def weight_specs(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> list[TensorSpec]:
    """The tensors a checkpoint of ``cfg`` stores, from every tensor's shape by HF name: in the model's order
    (embeddings, layers, norm, head), ``lm_head.weight`` left out when tied (as HF saves it), all in ``dtype``."""

    def order(name: str) -> tuple[int, int, str]:
        if name.startswith("model.layers."):
            return (1, int(name.split(".")[2]), name)
        return (0 if name.startswith("model.embed_tokens.") else 2, 0, name)

    names = sorted((n for n in shapes if not (cfg.tie_word_embeddings and n == "lm_head.weight")), key=order)
    return [TensorSpec(n, dtype, tuple(shapes[n])) for n in names]


def write_checkpoint(
    dst: Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    force: bool = False,
    generation_config: dict[str, Any] | None = None,
    extra: Callable[[Path], None] | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``config.json``, the weights and ``generation_config.json`` (if given) for ``cfg``, run ``extra(folder)``
    to add more files (the tokenizer), then move the folder to ``dst`` in one rename.

    Parameters
    ----------
    dst : Path
        Resolved destination folder (see ``check_destination``); its parent is created if missing.
    cfg : ModelConfig
        Written as ``config.json`` via ``cfg.to_hf()``.
    state : dict[str, Tensor]
        Tensors by HF name, written in ``dtype``: ``model.safetensors``, or shards of at most ``max_shard_size``
        with ``model.safetensors.index.json`` (``gqa.convert.shards``); ``lm_head.weight`` is left out when
        ``cfg.tie_word_embeddings`` (as HF saves it).

    Returns
    -------
    Path : ``dst``. On any failure (or interrupt) nothing is left at ``dst`` that was not there before, and no
    temporary folder remains.
    """
    with staged(dst, force) as tmp:
        write_config(tmp, cfg, dtype, generation_config)
        write_weights(tmp, cfg, state, dtype, max_shard_size)
        if extra is not None:
            extra(tmp)
    return dst


def write_weights(
    folder: Path, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype, max_shard_size: int | str
) -> list[Path]:
    """``state``'s tensors into ``folder`` in ``dtype`` (``weight_specs``, ``ShardedWriter``); the files written."""
    specs = weight_specs(cfg, {n: tuple(t.shape) for n, t in state.items()}, dtype)
    writer = ShardedWriter(folder, specs, max_shard_size)
    for spec in specs:
        writer.write(spec.name, state[spec.name])
    return writer.close()


def remove_weights(folder: Path) -> None:
    """Delete the safetensors weights (and their index) in ``folder``."""
    for file in [*folder.glob("*.safetensors"), folder / INDEX_NAME]:
        file.unlink(missing_ok=True)
