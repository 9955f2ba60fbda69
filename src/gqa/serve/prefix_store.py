"""Prefix-cache blocks on disk: one file per full KV block, found again after a restart by its key.

A file's name is its key: a hash of the *identity* (``fields``: the model's weights and shapes, the activation and
KV storage types, the pool's block layout, ``VERSION``) and the block's chained token-id hash (``blocks.block_hash``,
which covers every token before it too), so one directory can serve several models and pool layouts without mixing
them. A file per block, not per prompt: prompts that share a prefix share its files, and eviction and lookup go block
by block, as the in-memory prefix cache does.

    MAGIC (8 bytes) | header length (u32, little-endian) | header (JSON: fields, block hash, payload bytes) | payload
    | CRC-32 of everything before it (u32, little-endian)

A file is used only when all of that checks out: a truncated, tampered or foreign file (another model, dtype,
layout or format version) is ignored with one warning and deleted. Files are written atomically (``_atomic``), the
directory is kept under ``max_bytes`` by deleting the least recently used files first (a read touches its file).

    store = PrefixStore(directory, max_bytes, fields, block_bytes)
    store.write(block_hash, parts)   # parts: buffers (numpy arrays, bytes) of block_bytes bytes in all
    payload = store.read(block_hash) # the payload (a writable memoryview), or None: missing or not usable
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from .._atomic import atomic_path

__all__ = ["MAGIC", "SUFFIX", "VERSION", "PrefixStore", "writable_directory"]

MAGIC = b"GQAKVBLK"
VERSION = 1  # of the file format and of what the key covers: a change makes every older file foreign
# Of how the stored K/V bytes are computed (bump it with any change to them under the same dtype names: q8_0 keys
# became rotated, for one): part of every key, so that blocks an older gqa wrote are foreign, never read as valid
KV_BYTES = 2
_HEADER_MAX = 1 << 16  # a block file's header is a few hundred bytes; a file longer than its payload by more is damage
SUFFIX = ".kv"
# The checksum finds damage (a truncated or changed file), not forgery — whoever can write the directory can write a
# matching checksum of any kind —, so it is zlib's CRC-32: 1.8 GB/s where blake2b did 0.38 on a 2-core EPYC, and a
# block is checked on the engine thread at admission and summed on a thread beside the native step's.
_DIGEST = 4
_STALE_TEMP_SECONDS = 3600  # a temporary file older than this is a write that died with its process

log = logging.getLogger(__name__)


class PrefixStore:
    """The files of ``directory`` whose key covers ``fields`` (a JSON-able dict: what makes a block's bytes valid for
    a pool), each a payload of ``block_bytes`` bytes; at most ``max_bytes`` of files in the directory (this process's
    count: files other processes add are found when read, counted once seen)."""

    def __init__(self, directory: str | os.PathLike, max_bytes: int, fields: dict, block_bytes: int) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
        self.directory = Path(directory)
        self.max_bytes, self.block_bytes = max_bytes, block_bytes
        self.fields = {"version": VERSION, "kv_bytes": KV_BYTES, **fields}
        self.identity = hashlib.blake2b(_canonical(self.fields), digest_size=16).digest()
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        self._bad: set[str] = set()  # files found unusable and not deletable: warned about once, not read again
        self._write_failed = False
        self.total_bytes = 0
        writable_directory(self.directory, "prefix_cache_dir")
        self._scan()

    def __len__(self) -> int:
        return len(self._files)

    def __str__(self) -> str:
        return (f"{self.directory} ({len(self)} blocks, {self.total_bytes / 2**30:.2f} of "
                f"{self.max_bytes / 2**30:.2f} GiB)")  # fmt: skip

    def name(self, block_hash: bytes) -> str:
        """The file name of the block with chained hash ``block_hash``."""
        return hashlib.blake2b(self.identity + block_hash, digest_size=20).hexdigest() + SUFFIX

    def __contains__(self, block_hash: bytes) -> bool:
        """Whether this store knows a file for ``block_hash`` (written or seen by this process; not checked)."""
        return self.name(block_hash) in self._files

    def write(self, block_hash: bytes, parts: Sequence) -> bool:
        """Store the block ``block_hash`` whose payload is ``parts`` (buffers, ``block_bytes`` bytes together) and
        evict the least recently used files beyond ``max_bytes``; whether it was written (an ``OSError`` is a
        warning, not an exception: a full disk must not stop serving)."""
        size = sum(memoryview(p).nbytes for p in parts)
        if size != self.block_bytes:
            raise ValueError(f"a block's payload is {self.block_bytes} bytes, got {size}")
        header = self._header(block_hash)
        total = len(MAGIC) + 4 + len(header) + size + _DIGEST
        if total > self.max_bytes:
            return False
        name = self.name(block_hash)
        crc = 0
        try:
            with atomic_path(self.directory / name) as tmp, open(tmp, "wb") as f:
                for piece in (MAGIC, struct.pack("<I", len(header)), header, *parts):
                    crc = zlib.crc32(piece, crc)
                    f.write(piece)
                f.write(struct.pack("<I", crc))
        except OSError as e:  # said once (a full disk would say it for every block), then at debug level
            log.log(logging.DEBUG if self._write_failed else logging.WARNING, "prefix cache: cannot write %s: %s",
                    self.directory / name, e)  # fmt: skip
            self._write_failed = True
            return False
        with self._lock:
            self._add(name, total)
            self._evict()
        return True

    def read(self, block_hash: bytes) -> memoryview | None:
        """The payload stored for ``block_hash`` (and its file touched: recently used), or None where there is none
        or it is not usable (truncated, tampered, foreign: warned about once and deleted)."""
        name = self.name(block_hash)
        path = self.directory / name
        if name in self._bad:
            return None
        if name not in self._files:
            try:  # another process may have written it since this one started
                size = path.stat().st_size
            except OSError:
                return None
            with self._lock:
                self._add(name, size)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > self.block_bytes + _HEADER_MAX:  # not read into memory: no block file is that long
                    data, got = bytearray(), -1
                else:
                    data = bytearray(size)
                    got = f.readinto(data)
        except FileNotFoundError:  # evicted meanwhile (by another process): a miss, not damage
            self._forget(name)
            return None
        except OSError as e:
            log.warning("prefix cache: cannot read %s: %s", path, e)
            return None
        try:  # any failure to make sense of the file is damage: it costs this lookup, never the engine's step
            problem = (
                "the file changed while read or is too long" if got != len(data) else self._problem(data, block_hash)
            )
        except Exception as e:  # (a header of nested brackets raises RecursionError in json)
            problem = f"an unreadable header ({type(e).__name__})"
        if problem is not None:
            gone = self._delete(name)
            log.warning("prefix cache: ignoring %s (%s); %s", path, problem, "deleted" if gone else "cannot delete it")
            return None
        with self._lock:
            if name in self._files:
                self._files.move_to_end(name)
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used, for the next process's order too
        end = len(data) - _DIGEST
        return memoryview(data)[end - self.block_bytes : end]  # writable, not copied

    # -- files ------------------------------------------------------------------------------------------------------

    def _header(self, block_hash: bytes) -> bytes:
        return _canonical({"fields": self.fields, "block": block_hash.hex(), "payload": self.block_bytes})

    def _problem(self, data: bytearray, block_hash: bytes) -> str | None:
        """What is wrong with the file ``data`` as block ``block_hash`` of this store, or None: it is usable."""
        if len(data) < len(MAGIC) + 4 + _DIGEST or data[: len(MAGIC)] != MAGIC:
            return "not a gqa KV block file" if len(data) >= len(MAGIC) + 4 + _DIGEST else "truncated"
        (length,) = struct.unpack_from("<I", data, len(MAGIC))
        body = len(MAGIC) + 4 + length
        if len(data) < body + _DIGEST:
            return "truncated"
        try:
            header = json.loads(bytes(data[len(MAGIC) + 4 : body]))
        except ValueError:
            header = None
        if not isinstance(header, dict):
            return "a damaged header"
        if header != json.loads(self._header(block_hash)):
            fields = header.get("fields")
            if isinstance(fields, dict) and fields != self.fields:
                diff = sorted(k for k in fields.keys() | self.fields.keys() if fields.get(k) != self.fields.get(k))
                return f"written for another model or layout: {', '.join(diff)} differ"
            return "a header for another block"
        if len(data) != body + self.block_bytes + _DIGEST:
            return "truncated" if len(data) < body + self.block_bytes + _DIGEST else "trailing bytes"
        view = memoryview(data)
        if zlib.crc32(view[: len(data) - _DIGEST]) != struct.unpack_from("<I", data, len(data) - _DIGEST)[0]:
            return "checksum mismatch"
        return None

    def _scan(self) -> None:
        """Index the directory's block files, least recently used first; delete temporary files of writes that died."""
        found = []
        now = time.time()
        for entry in os.scandir(self.directory):
            try:
                st = entry.stat()
            except OSError:
                continue
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                found.append((st.st_mtime, entry.name, st.st_size))
            elif (
                entry.name.startswith(".") and f".tmp{SUFFIX}" in entry.name and now - st.st_mtime > _STALE_TEMP_SECONDS
            ):
                _unlink(Path(entry.path))
        with self._lock:
            for _, name, size in sorted(found):
                self._add(name, size)
            self._evict()

    def _add(self, name: str, size: int) -> None:  # under _lock
        self.total_bytes += size - self._files.pop(name, 0)
        self._files[name] = size

    def _evict(self) -> None:  # under _lock
        while self.total_bytes > self.max_bytes and self._files:
            name, size = self._files.popitem(last=False)
            self.total_bytes -= size
            _unlink(self.directory / name)

    def _forget(self, name: str) -> None:
        with self._lock:
            self.total_bytes -= self._files.pop(name, 0)

    def _delete(self, name: str) -> bool:
        """Delete the file ``name`` (or, where that fails, never read it again); whether it is gone."""
        self._forget(name)
        gone = _unlink(self.directory / name)
        if not gone:
            self._bad.add(name)
        return gone


def writable_directory(path: Path, name: str) -> None:
    """Make ``path`` a directory this process can write (made if missing), else ``ValueError`` naming ``name``."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name} {path}: not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{name} {path}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path}: not writable")


def _unlink(path: Path) -> bool:
    """Delete ``path`` if it is there; whether it is gone."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        return False
    return True


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
