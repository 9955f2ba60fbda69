"""Write an HF checkpoint folder safely: never into the source, never over an existing folder without ``force``, and
all-or-nothing — everything is written into a hidden temporary folder next to the destination (same filesystem) and
renamed into place at the end; a replaced folder is moved aside first and deleted only once the new one is in place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from ..models.config import ModelConfig

__all__ = ["WEIGHTS_NAME", "check_destination", "write_checkpoint"]

WEIGHTS_NAME = "model.safetensors"


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


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing memory with another (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, t in state.items():
        t = t.detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
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


def write_checkpoint(
    dst: Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    force: bool = False,
    generation_config: dict[str, Any] | None = None,
    extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` and ``generation_config.json`` (if given) for ``cfg``, run
    ``extra(folder)`` to add more files (the tokenizer), then move the folder to ``dst`` in one rename.

    Parameters
    ----------
    dst : Path
        Resolved destination folder (see ``check_destination``); its parent is created if missing.
    cfg : ModelConfig
        Written as ``config.json`` via ``cfg.to_hf()``.
    state : dict[str, Tensor]
        Tensors by HF name; ``lm_head.weight`` is left out when ``cfg.tie_word_embeddings`` (as HF saves it).

    Returns
    -------
    Path : ``dst``. On any failure (or interrupt) nothing is left at ``dst`` that was not there before, and no
    temporary folder remains.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary folder
        hf = cfg.to_hf() | {"dtype": "float32"}
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
        if generation_config is not None:
            text = json.dumps(generation_config, indent=2) + "\n"
            (tmp / "generation_config.json").write_text(text, encoding="utf-8")
        tensors = {k: v for k, v in state.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        safetensors.torch.save_file(_unshared(tensors), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        if extra is not None:
            extra(tmp)
        _move_into_place(tmp, dst, force)
    except BaseException:
        _remove(tmp)
        raise
    return dst
