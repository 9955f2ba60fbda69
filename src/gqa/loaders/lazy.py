"""A model's weights read on demand, a few tensors at a time: what streaming conversion reads a model larger than
memory with.

``open_lazy(path)`` checks the whole model (config, every tensor's name and shape) without reading a weight; ``read``
then loads the tensors asked for, in the dtype they are stored in. An HF folder's shards are memory-mapped only while
a ``read`` runs (so the pages it touched leave the process with it); a GGUF tensor is read from the file with an
ordinary read (quantized blocks dequantized to float32, llama q/k rows put back in HF order). Opening imports no torch
(``gqa info`` reads the config and shapes alone); ``read``, ``dtypes`` and ``dtype`` do.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..cache.sizes import ITEMSIZE
from . import resolve_model_path
from .gguf_meta import gguf_tensors, stored_dtype_name
from .hf_dir import hf_tensor_index, read_hf_tensors

if TYPE_CHECKING:
    import torch

__all__ = ["LazyModel", "open_lazy"]


class LazyModel:
    """A checked model whose tensors are read when asked for.

    Attributes
    ----------
    path : the resolved ``.gguf`` file or HF folder.
    config : its ``ModelConfig``.
    shapes : torch shape of every tensor the model uses, by HF name (no ``lm_head.weight`` when tied).
    dtypes : the dtype each of them is read in, its own (a llama.cpp file's F32 norms and biases next to its BF16 or
        F16 matrices stay float32; GGUF quantized blocks: float32).
    dtype_names : the same dtypes by torch's name for them (``"bfloat16"``), without importing torch.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.is_dir():
            self.config, self._index = hf_tensor_index(path)
            self.shapes = {name: shape for name, (_, shape, _) in self._index.items()}
            self.dtype_names = {name: dtype or "float32" for name, (_, _, dtype) in self._index.items()}
        else:
            _, self.config, self._gguf, self.shapes = gguf_tensors(path)
            self.dtype_names = {name: stored_dtype_name(t) for name, t in self._gguf.items()}

    @cached_property
    def dtypes(self) -> dict[str, torch.dtype]:
        """``dtype_names`` as torch dtypes (imports torch)."""
        import torch

        return {name: getattr(torch, dtype) for name, dtype in self.dtype_names.items()}

    @property
    def dtype(self) -> torch.dtype:
        """The float dtype most of the 2-D weights' elements are read in (``bfloat16`` for a bf16 checkpoint, also
        one whose norms and biases are float32): the one a converted checkpoint's config names."""
        counts: Counter[torch.dtype] = Counter()
        matrices = [n for n, shape in self.shapes.items() if len(shape) == 2] or list(self.shapes)
        for name in matrices:
            counts[self.dtypes[name]] += math.prod(self.shapes[name])
        return counts.most_common(1)[0][0]

    def nbytes(self, name: str) -> int:
        """Bytes of tensor ``name`` once read."""
        return math.prod(self.shapes[name]) * ITEMSIZE[self.dtype_names[name]]

    def stored_bytes(self) -> dict[str, int]:
        """Bytes of the model's tensors as the checkpoint stores them, by storage type (a GGUF's block formats
        ``"q4_k"``, ``"q6_k"``, ... and float types ``"f32"``; a folder's torch dtype names), largest first."""
        sizes: Counter[str] = Counter()
        if self.path.is_dir():
            for name in self.shapes:
                sizes[self.dtype_names[name]] += math.prod(self.shapes[name]) * ITEMSIZE[self.dtype_names[name]]
        else:
            for t in self._gguf.values():
                sizes[t.type.name.lower()] += t.nbytes
        return dict(sizes.most_common())

    def block_bytes_per_value(self) -> dict[str, float]:
        """Bytes per value of the 2-D tensors a GGUF stores in a block format the native kernels keep (what
        ``load_model(dtype="auto")`` holds as blocks), by HF name; empty for a folder."""
        from ..models.quantized import FORMATS

        if self.path.is_dir():
            return {}
        return {
            name: t.nbytes / math.prod(t.dims)
            for name, t in self._gguf.items()
            if t.type.name.lower() in FORMATS and len(t.dims) == 2
        }

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` by HF name, each a fresh tensor of ``shapes[name]`` in ``dtypes[name]``.

        Raises ``KeyError`` naming a tensor the model does not have."""
        names = list(names)
        missing = [n for n in names if n not in self.shapes]
        if missing:
            raise KeyError(f"{self.path}: no tensor {', '.join(missing)}")
        if self.path.is_dir():
            return read_hf_tensors(self._index, names)
        from .gguf_file import gguf_tensor  # torch

        out = {}
        with open(self.path, "rb") as f:
            for name in names:
                t = self._gguf[name]
                f.seek(t.offset)
                raw = np.fromfile(f, dtype=np.uint8, count=t.nbytes)
                out[name] = gguf_tensor(self.config, name, t, self.shapes[name], raw)
        return out


def open_lazy(path: str | Path | None = None) -> LazyModel:
    """A ``LazyModel`` on a ``.gguf`` file, an HF checkpoint folder (single-file or sharded), a folder with one
    ``.gguf`` file, or ``None`` (the embedded SmolLM2); ``ValueError`` for a damaged or unsupported model."""
    return LazyModel(resolve_model_path(path))
