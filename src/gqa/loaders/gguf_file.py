"""Read a llama.cpp GGUF file (llama, qwen2/3, gemma2/3, smollm3: ``gguf_meta.GGUF_ARCHITECTURES``) as a
``ModelConfig`` and tensors with HF names: float tensors and kept quantized blocks are views of the file's memory map
(``gguf_reader``), other blocks are dequantized (the native kernels for Q8_0/Q4_*/Q5_*/Q6_K, ``gguf.quants`` for the
rest).

Three layout facts: GGUF lists a tensor's dims fastest-first (``ne0`` = columns), the reverse of torch's shape;
llama.cpp's converter reorders the rows of each llama/smollm3 q/k head from HF's rotate-half order to interleaved
pairs, which ``unpermute_qk_`` undoes (Qwen and Gemma files are not permuted: llama.cpp runs them with NEOX-style
rope); and it stores Gemma's norm weights plus one (its ``1 + weight`` folded in), which the reader takes off.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..models.config import ModelConfig
from ..models.quantized import FORMATS, QuantizedTensor, dequantize
from .gguf_meta import _FLOAT_NAMES, PERMUTED_QK, gguf_tensors, stored_dtype_name
from .gguf_reader import GGUFFile, GGUFTensorInfo

_FLOATS = {kind: getattr(torch, name) for kind, name in _FLOAT_NAMES.items()}


def unpermute_qk_(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a llama q or k projection (weight or bias), in place.

    In place, one head at a time: where ``w`` is a view of a file's copy-on-write map, the reordered rows take the
    place of the file's pages in memory rather than sitting beside them (a 1B model's q and k: 45 MiB once, not
    twice), and the temporary is one head's rows.

    Parameters
    ----------
    w : (n_heads * D, *rest) tensor, contiguous
        As stored in the GGUF: within each head, rows ``(0, D/2, 1, D/2 + 1, ...)`` of the HF tensor, i.e. rope's
        rotated pairs interleaved.
    n_heads : int
        ``num_heads`` for q, ``num_kv_heads`` for k.

    Returns
    -------
    ``w``, now (n_heads * D, *rest) in HF's rotate-half row order.
    """
    D = w.shape[0] // n_heads
    # numpy, one thread, on the rows' bytes: torch's copy of one head's few hundred KiB is an OpenMP region that waits
    # for a second core, and on a busy 2-core machine that took a 3B model's q and k 22 s to load, not 0.1 s
    rows = w.view(w.shape[0], -1).view(torch.uint8).numpy()  # (n_heads * D, bytes per row), w's memory
    for head in rows.reshape(n_heads, D, -1):
        head[:] = head.reshape(D // 2, 2, -1).transpose(1, 0, 2).reshape(D, -1)  # (D/2, 2) -> (2, D/2)
    return w


def stored_dtype(t: GGUFTensorInfo) -> torch.dtype:
    """The torch dtype a GGUF tensor is read in: its own for F32/F16/BF16, float32 for quantized blocks."""
    return getattr(torch, stored_dtype_name(t))


def _dequantize(t: GGUFTensorInfo, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 ``shape`` from the blocks ``data`` of a quantized tensor ``t``."""
    rows = data.reshape(-1, t.dims[0] // t.type.block * t.type.block_bytes)  # (rows, bytes per row)
    fmt = FORMATS.get(t.type.name.lower())
    if fmt is not None:
        return dequantize(torch.from_numpy(rows), fmt, t.dims[0]).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    arr = gguf_dequantize(rows, GGMLQuantizationType(t.type.id)).reshape(shape)
    return torch.from_numpy(np.require(arr, np.float32, ["C_CONTIGUOUS", "WRITEABLE"]))


def gguf_tensor(
    cfg: ModelConfig,
    name: str,
    t: GGUFTensorInfo,
    shape: tuple[int, ...],
    data: np.ndarray,
    keep_quantized: bool = False,
    reordered: set[str] | None = None,
) -> Any:
    """The HF-layout torch tensor of GGUF tensor ``t`` (HF name ``name``, torch ``shape``) from its raw bytes
    ``data`` (``uint8 (t.nbytes,)``: a view of the file's map, or the same bytes read from it): in
    ``stored_dtype(t)`` (or a ``QuantizedTensor``, see ``read_gguf``), llama q/k rows put back in HF order, Gemma's
    norm weights back to HF's offsets from one. Float tensors and kept blocks are views of ``data`` where no alignment
    fix is needed.

    ``reordered``: for ``data`` in a file's copy-on-write map, the file's ``GGUFFile.reordered``. q/k rows kept as
    views of the map (float32, kept blocks) are reordered there, in place and once per file: their pages take the
    place of the file's in memory rather than sitting beside them. F16/BF16 ones (converted to float32 by the caller)
    are reordered in a copy, leaving the map's pages clean. ``None``: ``data`` is the caller's own (read from the
    file), reordered in place."""
    kind = t.type.name
    mapped = reordered is not None
    if keep_quantized and kind.lower() in FORMATS and len(shape) == 2:
        w = torch.from_numpy(data).reshape(shape[0], -1)  # (M, blocks bytes)
    elif kind in _FLOATS:
        if data.ctypes.data % _FLOATS[kind].itemsize:
            data, mapped = data.copy(), False  # an alignment below the element size: torch wants aligned storage
        w = torch.from_numpy(data).view(_FLOATS[kind]).reshape(shape)
    else:
        w, mapped = _dequantize(t, data, shape), False
    if cfg.arch in PERMUTED_QK and (".q_proj." in name or ".k_proj." in name):
        heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
        if not mapped:
            unpermute_qk_(w, heads)
        elif w.dtype in (torch.uint8, torch.float32):  # kept as a view of the map
            if name not in reordered:
                unpermute_qk_(w, heads)
                reordered.add(name)
        else:
            w = unpermute_qk_(w.clone(), heads)
    elif cfg.gemma and name.endswith("norm.weight"):
        w = w - 1  # HF's offset from one

    if w.dtype == torch.uint8:
        w = QuantizedTensor(w.contiguous(), FORMATS[kind.lower()], shape)
    return w


def _say_dequantized(tensors) -> None:
    """One line naming the block types of ``tensors`` that no native kernel takes (they are read as float32)."""
    counts = Counter(t.type.name for t in tensors if t.type.name not in _FLOATS and t.type.name.lower() not in FORMATS)
    if counts:
        kinds = ", ".join(f"{n} {kind} tensor{'s' * (n > 1)}" for kind, n in sorted(counts.items()))
        warnings.warn(f"{kinds}: no native kernel for the type, dequantized to float32", stacklevel=3)


def read_gguf(path: str | Path | GGUFFile, *, keep_quantized: bool = False) -> tuple[ModelConfig, dict[str, Any]]:
    """Read a GGUF file of a supported architecture.

    Returns
    -------
    (ModelConfig, dict) : the config, and HF-named float32 tensors in torch layout (``lm_head.weight`` only when the
    file has ``output.weight``); llama q/k rows are put back in HF order. With ``keep_quantized``, 2-D weights stored
    as Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K come as ``gqa.models.quantized.QuantizedTensor`` (their
    blocks as they are,
    rows reordered like the float ones) instead of float tensors. F32 tensors and kept blocks are copy-on-write views
    of the file's memory map: nothing is copied for them, and writing to them never changes the file.

    Raises
    ------
    ValueError
        A damaged file, unsupported architecture or quantization type, or missing/unexpected/misshapen tensors.
    """
    reader, cfg, by_name, shapes = gguf_tensors(path if isinstance(path, GGUFFile) else Path(path))
    if keep_quantized:
        _say_dequantized(by_name.values())
    tensors: dict[str, Any] = {}
    for name, t in by_name.items():
        w = gguf_tensor(cfg, name, t, shapes[name], reader.data(t), keep_quantized, reader.reordered)
        tensors[name] = w if isinstance(w, QuantizedTensor) else w.float()
    return cfg, tensors
