"""The engine's prefix cache on disk: full prompt blocks written to a ``PrefixStore`` once computed, read back into
fresh pool blocks when a later prompt — in this process or after a restart — starts with them.

    save(table, n)   after a prompt's prefill: its full blocks are queued for the writer thread
    restore(table)   at admission, after the in-memory prefix cache: the longest run of the blocks that follow it
                     found on disk is read into the table's fresh blocks and counts as computed
    collect()        each step: the blocks whose files are written go back, the next queued ones go to the writer

The writer thread reads the pool where the blocks lie: nothing is copied on the engine thread. A block is held (its
reference count up) until its file is written, so nobody overwrites it meanwhile; at most ``HELD_SHARE`` of the pool
at once, the next queued blocks then found by their hash in the in-memory prefix cache, where a finished request's
blocks stay until reclaimed. While it writes, decode steps take 1.3-2.4x as long on 2 cores (it takes CPU from the
native step: benchmarks/prefix_cache_restart.py). A read happens on the engine thread at admission, in place of the
prefill it saves. A block's bytes are exactly what the pool stores (float or quantized rows), so a restored block is
the block a prefill would have written (runner.py: a token's K/V do not depend on the batch or on how the prompt was
cut), and the greedy text is the same.

What makes a file valid for a pool is its key (``pool_fields``): a fingerprint of the weights (a sample of every
tensor's bytes, its name, shape and dtype), the model config, the activation dtype and device type, the K and V
storage types and the pool's block shapes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections import deque
from pathlib import Path

import numpy as np
import torch

from .blocks import BlockManager, BlockTable, block_hash
from .paged_cache import PagedKVCache
from .prefix_store import PrefixStore

__all__ = ["DiskPrefixCache", "pool_fields", "weights_fingerprint"]

HELD_SHARE = 0.25  # the most of the pool held for writing at once: a slow disk never takes the pool's capacity
_SAMPLES, _SAMPLE_BYTES = 16, 256  # per weight tensor: contiguous runs (a few pages of a memory-mapped file each)

log = logging.getLogger(__name__)


class DiskPrefixCache:
    """Full blocks of the pool ``cache`` (managed by ``blocks``) kept in ``store`` across restarts."""

    def __init__(self, store: PrefixStore, cache: PagedKVCache, blocks: BlockManager) -> None:
        self.store, self.cache, self.blocks = store, cache, blocks
        self.max_held = max(1, int(blocks.num_blocks * HELD_SHARE))
        self.hits = 0  # blocks read from disk instead of computed
        self.writes = 0  # block files written
        self._queued: set[bytes] = set()  # hashes of the blocks queued for writing, held or pending
        self._pending: deque[bytes] = deque()  # queued, not held yet (max_held are)
        self._held = 0
        self._jobs: deque[list[tuple[bytes, int]]] = deque()
        self._written: deque[tuple[bytes, int]] = deque()  # (hash, block) written (or given up): to give back
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None
        # the pool's tensors as numpy arrays of bytes on the host (sharing its memory): a block's bytes are moved by
        # one numpy call, not a torch op per layer
        tensors = cache.key + cache.value
        self._host = [t.view(torch.uint8).numpy() for t in tensors] if tensors[0].device.type == "cpu" else None

    @classmethod
    def open(
        cls, directory: str | Path, gib: float, model: torch.nn.Module, cache: PagedKVCache, blocks: BlockManager
    ) -> DiskPrefixCache:
        """The disk prefix cache in ``directory`` (made if missing), at most ``gib`` GiB, for ``model``'s pool."""
        block_bytes = sum(pool[0][0].nbytes for pool in (cache.key, cache.value)) * len(cache.key)
        store = PrefixStore(directory, max(1, int(gib * 2**30)), pool_fields(model, cache), block_bytes)
        return cls(store, cache, blocks)

    # -- the engine thread ------------------------------------------------------------------------------------------

    def restore(self, table: BlockTable) -> int:
        """Read the full prompt blocks of ``table`` that follow its cached ones from disk, as long as each is found
        and valid, into the table's fresh blocks; they count as computed (``table.cached_tokens`` grows, and they join
        the in-memory prefix cache). As ``BlockManager.allocate``, the last prompt token's block is left to compute.
        Returns how many blocks were read."""
        size, tokens = self.blocks.block_size, table.tokens
        first = table.cached_tokens // size
        parent = table.hashes[first - 1] if first else b""
        read = 0
        for i in range(first, (len(tokens) - 1) // size):
            h = block_hash(parent, tokens[i * size : (i + 1) * size])
            payload = self.store.read(h)
            if payload is None:
                break
            self._fill(table.blocks[i], payload)
            parent, read = h, read + 1
        if read:
            table.cached_tokens = (first + read) * size
            self.blocks.computed(table, table.cached_tokens)
            self.hits += read
        return read

    def save(self, table: BlockTable, num_tokens: int) -> int:
        """Queue the full blocks among ``table``'s first ``num_tokens`` tokens (computed: their hashes are known) that
        are not on disk yet for writing. Returns how many were queued."""
        end = min(num_tokens // self.blocks.block_size, len(table.hashes))
        queued = 0
        for h in table.hashes[table.released : end]:  # blocks before `released` went back (a sliding window)
            if h not in self._queued and h not in self.store:
                self._queued.add(h)
                self._pending.append(h)
                queued += 1
        self._hand_over()
        return queued

    def collect(self) -> None:
        """Give back the blocks whose files are written; hand the writer more."""
        while self._written:
            h, block = self._written.popleft()
            self._queued.discard(h)
            self._held -= 1
            self.blocks.release(block)
        self._hand_over()

    def _hand_over(self) -> None:
        """Hold queued blocks (at most ``max_held`` at once) and give them to the writer thread. A block reclaimed
        for another sequence before its turn (it is still cached when its request ends) is not written."""
        job = []
        while self._pending and self._held < self.max_held:
            h = self._pending.popleft()
            block = self.blocks.hold(h)
            if block is None:
                self._queued.discard(h)
                continue
            self._held += 1
            job.append((h, block))
        if job:
            with self._lock:
                self._jobs.append(job)
                if self._writer is None:
                    # not a daemon (the engine thread is one, and a thread inherits it): the interpreter waits for
                    # the files being written when the process ends
                    self._writer = threading.Thread(target=self._write_jobs, name="gqa-prefix-writer", daemon=False)
                    self._writer.start()

    def flush(self) -> None:
        """Wait until every queued block is written (or given up: reclaimed before its turn), the blocks given
        back."""
        while True:
            self.collect()
            if not (self._held or self._pending):
                return
            writer = self._writer
            if writer is None:
                if self._written:  # it ended since: take up what it wrote last
                    continue
                return  # blocks held and no writer: one that died (they stay held)
            writer.join()

    def _fill(self, block: int, payload: memoryview) -> None:
        """Copy ``payload`` (``_payload``'s layout) into pool block ``block``."""
        offset = 0
        if self._host is not None:
            data = np.frombuffer(payload, dtype=np.uint8)
            for a in self._host:
                n = a[0].size
                a[block] = data[offset : offset + n].reshape(a.shape[1:])
                offset += n
            return
        data = torch.frombuffer(payload, dtype=torch.uint8).to(self.cache.key[0].device)  # one host-to-device copy
        for t in self.cache.key + self.cache.value:
            n = t[0].nbytes
            t[block].view(torch.uint8).view(-1).copy_(data[offset : offset + n])
            offset += n

    def _payload(self, block: int) -> np.ndarray:
        """Pool block ``block``'s bytes as stored: K of every layer, then V, each ``(H_kv, block_size, D | row
        bytes)`` — one copy, made by one call (a thread beside the engine's holds the GIL as little as it can)."""
        if self._host is not None:
            return np.concatenate([a[block].reshape(-1) for a in self._host])
        parts = [t[block].reshape(-1).view(torch.uint8) for t in self.cache.key + self.cache.value]
        return torch.cat(parts).cpu().numpy()

    # -- the writer thread ------------------------------------------------------------------------------------------

    def _write_jobs(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._writer = None
                    return
                job = self._jobs.popleft()
            for h, block in job:
                try:
                    self.writes += self.store.write(h, [self._payload(block)])
                except Exception:  # a fault writing one block must not keep the others held
                    log.exception("prefix cache: writing a block failed")
                self._written.append((h, block))


def pool_fields(model: torch.nn.Module, cache: PagedKVCache) -> dict:
    """What a stored block's bytes depend on, for its key: the weights (``weights_fingerprint``), the model config,
    the activation dtype and device type, the K/V storage types and the pool's block shapes and storage dtypes."""
    config = getattr(model, "config", None)
    return {
        "weights": weights_fingerprint(model),
        "config": repr(config),
        "dtype": str(model.dtype),
        "device": model.device.type,
        "kv": [kind.name for kind in cache.kinds],
        "block_size": cache.block_size,
        "layers": len(cache.key),
        "key_block": [*cache.key[0].shape[1:], str(cache.key[0].dtype)],
        "value_block": [*cache.value[0].shape[1:], str(cache.value[0].dtype)],
    }


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash of every weight tensor's name, shape, dtype and a sample of its bytes (the whole of a small one;
    ``_SAMPLES`` runs of ``_SAMPLE_BYTES`` spread over a large one), and of each module's kind and storage format.
    Another checkpoint, a fine-tune of it, another quantization or dtype of the same one each give another hash; the
    same weights loaded again, from any copy of the file, give the same. A few pages per tensor are read: fast for a
    memory-mapped model of any size."""
    digest = hashlib.blake2b(digest_size=16)
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__name__}:{getattr(module, 'format', '')};".encode())
    for name, t in model.state_dict().items():
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        if t.numel() == 0:
            continue
        flat = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)  # (nbytes,)
        n = flat.numel()
        if n <= _SAMPLES * _SAMPLE_BYTES:
            sample = flat
        else:
            starts = [math.floor(i * (n - _SAMPLE_BYTES) / (_SAMPLES - 1)) for i in range(_SAMPLES)]
            sample = torch.cat([flat[s : s + _SAMPLE_BYTES] for s in starts])
        digest.update(sample.cpu().numpy().tobytes())
    return digest.hexdigest()
