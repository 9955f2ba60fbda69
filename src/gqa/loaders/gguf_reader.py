"""A GGUF file's header in one pass: metadata, the tensor index, and the tensors as views of a memory map.

``GGUFFile(path)`` reads the header in bulk (numeric arrays with ``numpy.frombuffer`` over the map, strings walked
once) and checks every count, length, type and offset against the file's size before it reads or allocates anything:
a damaged or hostile file is a ``ValueError`` naming the problem, never a huge allocation, a hang or another
exception. Tensor data is not read here: ``GGUFFile.data(t)`` is a ``uint8`` view of the file (copy-on-write map, so
the file itself is never written).

The layout (llama.cpp's ``gguf.h``, versions 2 and 3, little-endian)::

    "GGUF" u32 version  u64 n_tensors  u64 n_kv
    n_kv x     (string key, u32 value type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] fastest first, u32 ggml type, u64 offset)
    padding to ``general.alignment`` (32), then the tensor data; each offset is from the data's start.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["GGML_TYPES", "GGMLType", "GGUFFile", "GGUFTensorInfo"]

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays; llama.cpp writes none, so a few levels are plenty


class GGMLType(NamedTuple):
    """A ggml storage type: ``block`` elements stored in ``block_bytes`` bytes."""

    id: int
    name: str
    block: int
    block_bytes: int


GGML_TYPES: dict[int, GGMLType] = {
    t.id: t
    for t in (
        GGMLType(0, "F32", 1, 4),
        GGMLType(1, "F16", 1, 2),
        GGMLType(2, "Q4_0", 32, 18),
        GGMLType(3, "Q4_1", 32, 20),
        GGMLType(6, "Q5_0", 32, 22),
        GGMLType(7, "Q5_1", 32, 24),
        GGMLType(8, "Q8_0", 32, 34),
        GGMLType(9, "Q8_1", 32, 40),
        GGMLType(10, "Q2_K", 256, 84),
        GGMLType(11, "Q3_K", 256, 110),
        GGMLType(12, "Q4_K", 256, 144),
        GGMLType(13, "Q5_K", 256, 176),
        GGMLType(14, "Q6_K", 256, 210),
        GGMLType(15, "Q8_K", 256, 292),
        GGMLType(16, "IQ2_XXS", 256, 66),
        GGMLType(17, "IQ2_XS", 256, 74),
        GGMLType(18, "IQ3_XXS", 256, 98),
        GGMLType(19, "IQ1_S", 256, 50),
        GGMLType(20, "IQ4_NL", 32, 18),
        GGMLType(21, "IQ3_S", 256, 110),
        GGMLType(22, "IQ2_S", 256, 82),
        GGMLType(23, "IQ4_XS", 256, 136),
        GGMLType(24, "I8", 1, 1),
        GGMLType(25, "I16", 1, 2),
        GGMLType(26, "I32", 1, 4),
        GGMLType(27, "I64", 1, 8),
        GGMLType(28, "F64", 1, 8),
        GGMLType(29, "IQ1_M", 256, 56),
        GGMLType(30, "BF16", 1, 2),
        GGMLType(34, "TQ1_0", 256, 54),
        GGMLType(35, "TQ2_0", 256, 66),
        GGMLType(39, "MXFP4", 32, 17),
    )
}

# metadata value types -> numpy dtype (little-endian); 8 is a string, 9 an array
_SCALARS = {
    0: np.dtype("<u1"),
    1: np.dtype("<i1"),
    2: np.dtype("<u2"),
    3: np.dtype("<i2"),
    4: np.dtype("<u4"),
    5: np.dtype("<i4"),
    6: np.dtype("<f4"),
    7: np.dtype("<u1"),  # bool
    10: np.dtype("<u8"),
    11: np.dtype("<i8"),
    12: np.dtype("<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the index: ``dims`` as GGUF lists them (fastest first), ``offset`` absolute in the file."""

    name: str
    type: GGMLType
    dims: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The torch shape: ``dims`` reversed."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; every overrun is a ``ValueError`` saying what was read."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.size, self.path = buf, 0, len(buf), path

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: truncated or malformed GGUF file: {what} (at byte {self.pos} of {self.size})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes, the file ends first")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings (the bound ``count * 8 <= bytes left`` is checked by the caller)."""
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out = []
        append = out.append
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                end = pos + n
                if end > size:
                    self.pos = pos
                    raise self.fail(f"string {len(out)} of {what} ({n} bytes) runs past the end of the file")
                append(str(buf[pos:end], "utf-8"))
                pos = end
        except struct.error:
            self.pos = pos
            raise self.fail(f"the length of string {len(out)} of {what} runs past the end of the file") from None
        except UnicodeDecodeError as e:
            self.pos = pos
            raise self.fail(f"string {len(out)} of {what} is not valid UTF-8 ({e.reason})") from None
        self.pos = pos
        return out

    def value(self, kind: int, what: str, depth: int = 0) -> Any:
        if kind in _SCALARS:
            dt = _SCALARS[kind]
            self.need(dt.itemsize, what)
            v = np.frombuffer(self.buf, dt, 1, self.pos)[0].item()
            self.pos += dt.itemsize
            return bool(v) if kind == _BOOL else v
        if kind == _STRING:
            return self.string(what)
        if kind != _ARRAY:
            raise self.fail(f"{what} has unknown value type {kind}")
        if depth >= MAX_NESTING:
            raise self.fail(f"{what} nests arrays more than {MAX_NESTING} deep")
        item = self.u32(f"the element type of {what}")
        count = self.u64(f"the length of {what}")
        smallest = _SCALARS[item].itemsize if item in _SCALARS else 8 if item in (_STRING, _ARRAY) else None
        if smallest is None:
            raise self.fail(f"{what} has unknown element type {item}")
        if count * smallest > self.size - self.pos:  # checked before anything is allocated
            raise self.fail(f"{what} claims {count} elements, more than the rest of the file can hold")
        if item in _SCALARS:
            arr = np.frombuffer(self.buf, _SCALARS[item], count, self.pos).copy()  # small next to the file
            self.pos += count * smallest
            return arr.astype(bool) if item == _BOOL else arr
        if item == _STRING:
            return self.strings(count, what)
        return [self.value(_ARRAY, f"{what}[{i}]", depth + 1) for i in range(count)]


class GGUFFile:
    """A GGUF file's header, checked, and its tensors' bytes as views of a memory map.

    Attributes
    ----------
    path : the file.
    version : 2 or 3.
    metadata : ``{key: value}``: ints, floats, bools, strings; numeric arrays as numpy arrays, string arrays as
        lists of ``str``.
    tensors : the tensor index in file order (names unique; each tensor inside the file, where the one before it ends
        padded to the alignment, as llama.cpp requires).
    alignment, data_start : the data section's alignment and absolute start.
    header_bytes : the bytes before the data section (what the metadata and index were read from).
    reordered : names of the tensors whose bytes in the (copy-on-write) map a reader has rewritten in place (llama q/k
        rows put in HF order, ``gguf_file.gguf_tensor``): every later read of this file finds them so.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reordered: set[str] = set()
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
                if magic != b"GGUF":
                    raise ValueError(
                        f"{self.path}: not a GGUF file: it starts with {magic!r}, a GGUF file starts with b'GGUF'"
                    )
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise ValueError(f"{self.path}: cannot open the GGUF file ({e.strerror or e})") from None
        cur = _Cursor(memoryview(self._map), self.path)
        cur.pos = 4
        self.version = cur.u32("the version")
        if self.version not in (2, 3):
            swapped = int.from_bytes(self.version.to_bytes(4, "little"), "big")
            hint = " (a big-endian file?)" if swapped in (2, 3) else ""
            raise ValueError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are){hint}")
        n_tensors = cur.u64("the tensor count")
        n_kv = cur.u64("the metadata count")
        # each entry takes at least 8 + 4 (+ 1) bytes, each tensor 8 + 4 + 4 + 8: counts the file cannot hold are lies
        if n_kv * 13 + n_tensors * 24 > cur.size - cur.pos:
            raise cur.fail(f"it claims {n_kv} metadata entries and {n_tensors} tensors, more than the file can hold")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}")
            if key in self.metadata:
                raise cur.fail(f"metadata key {key!r} appears twice")
            self.metadata[key] = cur.value(cur.u32(f"the type of {key!r}"), repr(key))
        self.alignment = self.metadata.get("general.alignment", 32)
        if not isinstance(self.alignment, int) or self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise cur.fail(f"general.alignment must be a power of two, got {self.alignment!r}")
        index = [self._tensor_info(cur, i) for i in range(n_tensors)]
        self.data_start = -(-cur.pos // self.alignment) * self.alignment
        self.header_bytes = cur.pos
        self.tensors = self._place(index, cur.size)

    def _place(self, index: list[tuple[str, GGMLType, tuple[int, ...], int, int]], size: int) -> list[GGUFTensorInfo]:
        """The tensors of ``index`` placed in the data section as llama.cpp requires: in the index's order, each
        where the one before it ends (padded to the alignment), the first at offset 0, the last inside the file and
        nothing after it but its padding. A type or shape that makes a tensor's size disagree with the next offset (a
        tensor running into the next, or a gap) names the tensor; bytes left after the last name a wrong count."""
        bad = f"{self.path}: truncated or malformed GGUF file"
        tensors, names, expected, after = [], set(), 0, "the data section's start"
        for name, kind, dims, offset, nbytes in index:
            if name in names:
                raise ValueError(f"{bad}: tensor {name!r} appears twice")
            names.add(name)
            if self.data_start + offset + nbytes > size:
                raise ValueError(
                    f"{bad}: tensor {name!r} ({nbytes} bytes at data offset {offset}) runs past the end of the file "
                    f"({size} bytes)"
                )
            if offset % self.alignment:
                alignment = self.alignment
                raise ValueError(f"{bad}: tensor {name!r} starts at offset {offset}, not a multiple of {alignment}")
            if offset != expected:
                raise ValueError(
                    f"{bad}: tensor {name!r} starts at data offset {offset}, expected {expected}, right after {after}: "
                    f"{'they overlap' if offset < expected else 'a gap between them'} (a type or shape that does not "
                    "match the data)"
                )
            tensors.append(GGUFTensorInfo(name, kind, dims, self.data_start + offset, nbytes))
            expected = -(-(offset + nbytes) // self.alignment) * self.alignment
            after = f"tensor {name!r} ({kind.name}, {nbytes} bytes and its padding)"
        if tensors and size > self.data_start + expected:
            raise ValueError(
                f"{bad}: {size - self.data_start - expected} bytes follow the last tensor ({tensors[-1].name!r}) of "
                f"the {len(tensors)} the header counts: a wrong tensor count?"
            )
        return tensors

    def _tensor_info(self, cur: _Cursor, i: int) -> tuple[str, GGMLType, tuple[int, ...], int, int]:
        name = cur.string(f"the name of tensor {i}")
        n_dims = cur.u32(f"the dimension count of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = tuple(cur.u64(f"dimension {d} of tensor {name!r}") for d in range(n_dims))
        type_id = cur.u32(f"the type of tensor {name!r}")
        offset = cur.u64(f"the offset of tensor {name!r}")
        kind = GGML_TYPES.get(type_id)
        if kind is None:
            raise cur.fail(f"tensor {name!r} has unknown ggml type {type_id}")
        if any(d == 0 for d in dims):
            raise cur.fail(f"tensor {name!r} has an empty dimension: {list(dims)}")
        if dims[0] % kind.block:
            raise cur.fail(f"tensor {name!r} of type {kind.name} has {dims[0]} columns, not whole {kind.block}-blocks")
        n = 1
        for d in dims:  # Python ints: no overflow; the size is checked against the file by the caller
            n *= d
        return name, kind, dims, offset, n // kind.block * kind.block_bytes

    def data(self, t: GGUFTensorInfo) -> np.ndarray:
        """Tensor ``t``'s bytes: a writable ``uint8`` view of the (copy-on-write) map, ``(nbytes,)``."""
        return np.frombuffer(self._map, np.uint8, t.nbytes, t.offset)

    def release(self, views: Iterable[torch.Tensor]) -> int:
        """Drop this process's pages of the map under ``views`` (contiguous tensors made by ``data``; others are
        ignored), e.g. once a tensor-parallel rank has copied its shard out of them: the pages it touched stop counting
        in its resident memory, and a later read finds the file's bytes again (a rewritten tensor loses its place
        in ``reordered``). Only whole pages inside a view are dropped. Returns the bytes dropped."""
        base = np.frombuffer(self._map, np.uint8, 1).ctypes.data
        page, dropped = mmap.PAGESIZE, 0
        for v in views:
            start = v.data_ptr() - base
            if not v.is_contiguous() or not 0 <= start < len(self._map):
                continue
            end = start + v.numel() * v.element_size()
            first, last = -(-start // page) * page, end // page * page
            if last > first:
                self._map.madvise(mmap.MADV_DONTNEED, first, last - first)
                dropped += last - first
            self.reordered -= {t.name for t in self.tensors if t.offset < end and start < t.offset + t.nbytes}
        return dropped

    def tensor(self, name: str) -> GGUFTensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(f"{self.path}: no tensor {name!r}")

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"
