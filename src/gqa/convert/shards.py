"""Safetensors weights written tensor by tensor, in HF's layout: ``model.safetensors`` when they fit one shard, else
``model-00001-of-0000N.safetensors`` ... with ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes},
"weight_map": {name: file}}``), as ``transformers``' ``save_pretrained(max_shard_size=...)`` writes them.

The safetensors library writes a file from a dict of tensors all in memory; a streaming conversion must never hold the
model. Every output tensor's dtype and shape is known before the first weight is computed, so the files are planned
up front: each shard's header (the safetensors format: an 8-byte little-endian header size, a JSON header giving each
tensor's dtype, shape and byte range, then the tensors' bytes back to back) is written first, and each tensor's bytes
go to their place when the tensor is ready, in any order. Reading goes through the safetensors library as usual.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..options.defaults import DEFAULT_MAX_SHARD_SIZE, SIZE_UNITS, parse_size  # noqa: F401 - defined there, torch-free

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "ShardedWriter",
    "TensorSpec",
    "parse_size",
    "plan_shards",
]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def plan_shards(specs: Sequence[TensorSpec], max_shard_size: int | str) -> list[list[TensorSpec]]:
    """``specs`` in order, cut into shards: a new one started when the next tensor would take the current one past
    ``max_shard_size`` (a tensor larger than that gets its own)."""
    limit = parse_size(max_shard_size)
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        if shards[-1] and size + s.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += s.nbytes
    return shards


@dataclass(frozen=True)
class _Place:
    file: Path
    start: int  # absolute byte offset in the file
    spec: TensorSpec


class ShardedWriter:
    """Write the tensors ``specs`` into ``folder`` as (sharded) safetensors, one ``write`` each, in any order.

    Parameters
    ----------
    folder : an existing folder (a conversion's private staging folder).
    specs : the tensors, in the order they are laid out (``plan_shards`` cuts them into shards).
    max_shard_size : bytes, or a size like ``"5GB"``.
    """

    def __init__(self, folder: Path, specs: Sequence[TensorSpec], max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("ShardedWriter: a tensor name appears twice")
        for s in specs:
            if s.dtype not in SAFETENSORS_DTYPES:
                raise TypeError(f"ShardedWriter: {s.name} has dtype {s.dtype}; writable: float64/32/16, bfloat16")
        shards = plan_shards(specs, max_shard_size)
        n = len(shards)
        self.folder = Path(folder)
        self.files = [self.folder / (WEIGHTS_NAME if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
                      for i in range(n)]  # fmt: skip
        self.places: dict[str, _Place] = {}
        for file, shard in zip(self.files, shards, strict=True):
            self._start(file, shard)
        self.total_size = sum(s.nbytes for s in specs)
        self._missing = set(names)

    def _start(self, file: Path, shard: list[TensorSpec]) -> None:
        """Write ``file``'s header and size it; record where each tensor's bytes go."""
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for s in shard:
            header[s.name] = {"dtype": SAFETENSORS_DTYPES[s.dtype], "shape": list(s.shape),
                              "data_offsets": [offset, offset + s.nbytes]}  # fmt: skip
            offset += s.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
        with open(file, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            f.truncate(8 + len(text) + offset)
        begin = 8 + len(text)
        for s in shard:
            self.places[s.name] = _Place(file, begin, s)
            begin += s.nbytes

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (any device; cast to the planned dtype) as ``name``; ``ValueError`` for an unplanned name,
        a second write or a shape other than planned."""
        place = self.places.get(name)
        if place is None:
            raise ValueError(f"ShardedWriter: {name} is not one of the planned tensors")
        if name not in self._missing:
            raise ValueError(f"ShardedWriter: {name} was written already")
        if tuple(tensor.shape) != place.spec.shape:
            raise ValueError(f"ShardedWriter: {name} has shape {tuple(tensor.shape)}, planned {place.spec.shape}")
        data = tensor.detach().to("cpu", place.spec.dtype).contiguous().view(torch.uint8).numpy()
        with open(place.file, "r+b") as f:
            f.seek(place.start)
            f.write(memoryview(data).cast("B") if data.size else b"")
        self._missing.discard(name)

    def close(self) -> list[Path]:
        """Check every planned tensor was written and write the index (when sharded); the files written."""
        if self._missing:
            raise RuntimeError(f"ShardedWriter: never written: {', '.join(sorted(self._missing))}")
        if len(self.files) == 1:
            return list(self.files)
        index = {"metadata": {"total_size": self.total_size},
                 "weight_map": {name: p.file.name for name, p in self.places.items()}}  # fmt: skip
        (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        return [*self.files, self.folder / INDEX_NAME]
